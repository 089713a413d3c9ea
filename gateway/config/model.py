"""The parsed configuration: immutable, typed, and trusted by every other module.

Nothing here reads files or validates; `gateway.config.loader` builds these
objects once, and the rest of the gateway only reads them.
"""

from __future__ import annotations

import enum
import ipaddress
from collections.abc import Mapping
from dataclasses import InitVar, dataclass, field
from typing import Any

from gateway.config.body_template import BodyTemplate
from gateway.config.pool_model import UpstreamPool
from gateway.config.regex import Regex
from gateway.config.store_url import StoreTarget, parse_store_url
from gateway.config.units import Address, Rate
from gateway.config.usage import UsageSource

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
# Identity sources every request has: entries after one of them in a `key` list are never read.
ALWAYS_PRESENT = ("ip", "global", "path", "method")


class FailurePolicy(enum.Enum):
    """What a limit does when the shared store errors or times out."""

    OPEN = "open"  # allow: fairness limits, where an outage must not become our outage
    CLOSED = "closed"  # reject with 503: limits that protect something fragile
    LOCAL = "local"  # decide with a conservative in-process bucket


class ForwardedHeaders(enum.Enum):
    """What becomes of X-Forwarded-For, -Proto, -Host and Forwarded sent by a peer that is not trusted."""

    REPLACE = "replace"  # the edge: a client's own forwarding headers are dropped and written anew
    APPEND = "append"  # behind a proxy not listed in trusted_proxies: pass them on, our hop added


class JwtFailure(enum.Enum):
    """What an invalid, expired or unsigned bearer token does to a request."""

    NEXT = "next"  # it is not an identity: the next source of the limit's key decides
    REJECT = "reject"  # 401


class DotSegments(enum.Enum):
    """What `.` and `..` segments of a request path do (see gateway.proxy.paths)."""

    RESOLVE = "resolve"  # removed as RFC 3986 §5.2.4 says, and the resolved path is forwarded
    REJECT = "reject"  # 400


class EscapedSlashes(enum.Enum):
    """What an encoded slash (%2F) in a request path does (see gateway.proxy.paths)."""

    KEEP = "keep"  # stays inside its segment, for matching and forwarding: group%2Fproject
    REJECT = "reject"  # 400
    DECODE = "decode"  # becomes "/", for matching and forwarding


@dataclass(frozen=True, kw_only=True)
class PathNormalization:
    """How request paths are read; one setting for the whole gateway."""

    dot_segments: DotSegments = DotSegments.RESOLVE
    escaped_slashes: EscapedSlashes = EscapedSlashes.KEEP
    merge_slashes: bool = True


@dataclass(frozen=True, kw_only=True)
class IdentitySource:
    """Where a client identity comes from: the peer address (or its network), a named header,
    query or cookie, a claim of a verified JWT, the matched route's path, the Host, the method,
    nothing at all (`global`: one bucket for every client), or several of these at once
    (`composite`: one bucket per combination of its `parts`)."""

    # "ip" | "header" | "query" | "cookie" | "jwt" | "path" | "host" | "method" | "global" | "composite"
    kind: str
    name: str = ""  # header names lower case; for "jwt", the claim
    ipv4_prefix: int = 32  # "ip": clients are grouped by their network of this many leading bits
    ipv6_prefix: int = 128
    parts: tuple[IdentitySource, ...] = ()  # "composite": all present, or the entry is absent

    def __str__(self) -> str:
        if self.kind == "composite":
            return "+".join(str(part) for part in self.parts)
        if self.kind == "ip":
            if self.ipv6_prefix != 128:
                return f"ip/{self.ipv4_prefix},{self.ipv6_prefix}"
            return "ip" if self.ipv4_prefix == 32 else f"ip/{self.ipv4_prefix}"
        return f"{self.kind}:{self.name}" if self.name else self.kind

    @property
    def leaves(self) -> tuple[IdentitySource, ...]:
        """The single sources this one reads: its parts, or itself."""
        return self.parts or (self,)

    @property
    def always_present(self) -> bool:
        """Every request has a value for it, so a key listing it never falls back to the address."""
        return all(leaf.kind in ALWAYS_PRESENT for leaf in self.leaves)


class ClientIpHeader(enum.Enum):
    """The header a trusted proxy writes the client's address in."""

    X_FORWARDED_FOR = "x-forwarded-for"
    X_REAL_IP = "x-real-ip"  # one address, nginx's realip convention
    FORWARDED = "forwarded"  # RFC 7239: the `for=` parameter of each element


@dataclass(frozen=True, kw_only=True)
class ClientIpStrategy:
    """How the client's address is read from a trusted proxy's header (Traefik's ipStrategy).
    `depth` None: right to left, skipping trusted proxies; N: the N-th address from the right,
    whatever it is, for a chain of N trusted hops whose addresses are not known in advance."""

    header: ClientIpHeader = ClientIpHeader.X_FORWARDED_FOR
    depth: int | None = None


@dataclass(frozen=True, kw_only=True)
class JwtKey:
    """One key a bearer token may be signed with, bound to its one algorithm."""

    algorithm: str  # "HS256" | "RS256" | "ES256"
    key: Any  # bytes for HS256, a `cryptography` public key otherwise
    kid: str | None = None


@dataclass(frozen=True, kw_only=True)
class JwtConfig:
    keys: tuple[JwtKey, ...]
    issuer: str | None
    audience: str | None
    leeway: float  # seconds of clock skew allowed on exp, nbf and iat
    on_invalid: JwtFailure
    # Where the keys were read from, as the YAML names it: ("secret_env", VARIABLE),
    # ("public_key_file", PATH) or ("jwks_file", PATH); neither value is a secret.
    keys_from: tuple[str, str] = ("", "")


# Leased tokens a process has not spent lapse after this long. The fleet's under-admission
# is at most `lease` tokens per process per lapse; one second keeps that small and still
# lets a busy process spend a lease many times over.
DEFAULT_LEASE_LAPSE = 1.0
# Of a `response.body` that names no content_type.
DEFAULT_BODY_CONTENT_TYPE = "text/plain; charset=utf-8"


class HeaderStyle(enum.Enum):
    """How a limit is advertised on the responses of its routes."""

    IETF = "ietf"  # RateLimit-Policy and RateLimit (draft-ietf-httpapi-ratelimit-headers)
    X_RATELIMIT = "x-ratelimit"  # X-RateLimit-Limit, -Remaining, -Reset, as GitHub and Kong send them
    NONE = "none"  # not advertised; a rejection still carries Retry-After


@dataclass(frozen=True, kw_only=True)
class ResponseStyle:
    """What a limit's rejections look like, and how its routes advertise it."""

    status: int = 429  # of a rejection over the limit: 429 or 503
    headers: HeaderStyle = HeaderStyle.IETF
    body: BodyTemplate | None = None  # None: the problem+json body
    content_type: str = DEFAULT_BODY_CONTENT_TYPE  # of `body`


@dataclass(frozen=True, kw_only=True)
class Quota:
    """A fixed-window quota: `limit` per `per` window, the windows starting at `reset`
    seconds past midnight UTC (see gateway.limiter.quota)."""

    limit: float  # whole as configured; a share under `on_store_error: local` may be a fraction
    per: str  # "hour" | "day" | "week" | "month"
    reset: float  # seconds into the UTC day at which windows start


@dataclass(frozen=True, kw_only=True)
class ResponseCost:
    """A limit whose cost the response says (`cost: {from, reserve, missing}`): `reserve`
    is taken before forwarding, with the route's other limits, all or nothing; when the
    response has ended, what it says less `reserve` is settled (gateway.limiter.settlement)."""

    source: UsageSource  # json:PATH, sse-json:PATH, header:NAME or response-bytes (str() spells it)
    reserve: int  # taken before the request; at most the burst
    missing: int  # charged when the response does not say


@dataclass(frozen=True, kw_only=True)
class Tiers:
    """A limit's tiers: where a client's tier is read from, and each tier's limit (named
    `LIMIT/TIER`, so its buckets are apart from the default tier's and from each other's)."""

    limits: Mapping[str, Limit] = field(compare=False)  # tier name -> its limit
    header: str | None = None  # lower case; believed only from a trusted proxy
    file: str | None = None
    # sha256 hex of a key value -> its tier, from `file`
    members: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True, kw_only=True)
class Allowlist:
    """Clients a limit never applies to: by address, or by identity ("source=value")."""

    networks: tuple[IPNetwork, ...] = ()
    identities: frozenset[str] = frozenset()


@dataclass(frozen=True, kw_only=True)
class Limit:
    """A token bucket (`rate`, `burst`), or a fixed-window `quota`. A quota's `rate` and
    `burst` describe it, its limit per window, for headers, validation and display;
    the store counts it in windows."""

    name: str
    rate: Rate
    burst: float
    key: tuple[IdentitySource, ...]
    on_store_error: FailurePolicy
    shadow: bool = False  # checked and charged, counted as shadow_limited, but never rejects
    response: ResponseStyle = ResponseStyle()
    lease: int = 0  # tokens a gateway process takes from the shared bucket at once; 0: none
    lease_lapse: float = DEFAULT_LEASE_LAPSE  # seconds after which unspent leased tokens lapse
    # `mode: delay`: the longest a request waits to be admitted instead of rejected; 0 rejects.
    max_delay: float = 0.0
    quota: Quota | None = None
    tiers: Tiers | None = None  # the rate and burst above are then the default tier's
    allow: Allowlist | None = None
    cost: ResponseCost | None = None  # the cost comes from the response; None: the route's fixed cost

    @property
    def refill_seconds(self) -> float:
        """How long an empty bucket takes to fill completely."""
        return self.burst / self.rate.per_second


@dataclass(frozen=True, kw_only=True)
class ConcurrencyLimit:
    """`concurrency: N`: at most N requests of one identity in flight across the fleet
    (nginx's limit_conn). Its own kind of limit, beside the token buckets: each request
    holds a lease from its start until its response ends (gateway.limiter.concurrency)."""

    name: str
    concurrency: int
    lease_ttl: float  # seconds a lease outlives a gateway that died holding it; renewed meanwhile
    key: tuple[IdentitySource, ...]
    on_store_error: FailurePolicy


@dataclass(frozen=True, kw_only=True)
class RouteLimit:
    limit: Limit
    cost: int


class PathForm(enum.Enum):
    """How a route's `match` compares the request path (see gateway.proxy.routing)."""

    PREFIX = "path"  # a prefix on whole segments
    EXACT = "exact"
    REGEX = "regex"  # the whole path, by RE2


@dataclass(frozen=True, kw_only=True)
class ValueMatch:
    """What one request header or query parameter must be for a route to take the request."""

    name: str  # header names lower case
    present: bool = True  # False: the route takes only requests without it
    exact: str | None = None
    regex: Regex | None = None

    def __str__(self) -> str:
        if not self.present:
            return f"!{self.name}"
        if self.exact is not None:
            return f"{self.name}={self.exact}"
        return f"{self.name}~{self.regex}" if self.regex is not None else self.name


@dataclass(frozen=True, kw_only=True)
class Match:
    path: str  # as written: the prefix (without a trailing slash), the exact path or the regex
    form: PathForm = PathForm.PREFIX
    regex: Regex | None = None  # `path` compiled, for PathForm.REGEX
    methods: frozenset[str] | None = None
    host: str | None = None  # "*.example.com": any name of one or more labels under example.com
    case_sensitive: bool = True
    headers: tuple[ValueMatch, ...] = ()
    query: tuple[ValueMatch, ...] = ()


@dataclass(frozen=True, kw_only=True)
class HeaderRules:
    """A route's rewrite of the headers of one direction: `remove`, then `set`, then `add`."""

    set: tuple[tuple[str, str], ...] = ()
    add: tuple[tuple[str, str], ...] = ()
    remove: tuple[str, ...] = ()  # lower case


@dataclass(frozen=True, kw_only=True)
class UpstreamTimeout:
    connect: float
    read: float
    queue: float = 1.0  # waiting for a free connection to the upstream; exceeded gives 503
    total: float | None = None  # the whole upstream exchange, retries and response body included


@dataclass(frozen=True, kw_only=True)
class Route:
    match: Match
    upstream: str | UpstreamPool  # a base URL without a trailing slash, or a pool of them
    limits: tuple[RouteLimit, ...]
    strip_prefix: bool
    preserve_host: bool
    timeout: UpstreamTimeout
    allow_path_parameters: bool = False  # `;` parameters in the path; refused with 400 otherwise
    max_body_size: int | None = None  # bytes of request body; more is refused with 413, before the upstream hears of it
    concurrency: tuple[ConcurrencyLimit, ...] = ()  # the route's concurrency limits, after its rate limits
    request_headers: HeaderRules = HeaderRules()
    response_headers: HeaderRules = HeaderRules()

    @property
    def label(self) -> str:
        """The route's name in metrics: its match as configured, never anything a client chose.
        A prefix route is its host, prefix and methods; an exact path is marked `=`, a regex
        `~` (as nginx writes its locations), and header and query conditions follow."""
        match = self.match
        methods = " " + ",".join(sorted(match.methods)) if match.methods else ""
        form = {PathForm.PREFIX: "", PathForm.EXACT: "=", PathForm.REGEX: "~"}[match.form]
        conditions = "".join(f" header:{c}" for c in match.headers) + "".join(f" query:{c}" for c in match.query)
        return f"{match.host or ''}{form}{match.path}{methods}{conditions}"


@dataclass(frozen=True, kw_only=True)
class ClientLimits:
    """What one client connection may hold of the gateway (see gateway.proxy.bounded_protocol).
    The defaults are nginx's where it has one."""

    header_timeout: float = 60.0  # a request head must arrive whole within this of its first byte
    body_timeout: float = 60.0  # the longest wait between two reads of a request body
    keepalive_timeout: float = 75.0  # an idle connection between requests is closed after this
    keepalive_requests: int = 1000  # requests served on one connection before it is closed
    max_header_size: int = 32 * 1024  # request line and header lines together; more gets 431


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    url: str
    timeout: float
    prefix: str
    local_divisor: int
    max_pending: int  # commands queued or awaiting Redis, per gateway process
    key_secret: str | None
    tls_ca_file: str | None = None  # CA bundle to verify a rediss:// server; default: the system's
    required: bool = False  # refuse to start while the store is unreachable or refuses us
    # `url` parsed, for the store to connect by. An InitVar, not a field: the admin API's
    # config view shows every field, and the target holds the password in the clear.
    target: InitVar[StoreTarget | None] = None

    def __post_init__(self, target: StoreTarget | None) -> None:
        # The loader passes the target it validated; a StoreConfig built in code is parsed here.
        object.__setattr__(self, "target", target if target is not None else parse_store_url(self.url))


@dataclass(frozen=True, kw_only=True)
class ListenTls:
    """TLS on the public listener: a PEM certificate chain and its key, and the oldest
    protocol version accepted ("TLSv1.2" or "TLSv1.3")."""

    cert_file: str
    key_file: str
    min_version: str = "TLSv1.2"


# The kernel's queue of connections not yet accepted, as nginx's `listen ... backlog=`.
# aiohttp's 128 overflows when as many new clients arrive at once as a worker admits
# (max_in_flight), and a SYN the kernel drops is only retried a second later.
DEFAULT_LISTEN_BACKLOG = 1024


# The longest identity value a limit reads. Bearer JWTs from Azure AD and Okta run to 2 KB
# and more with group claims; 8 KiB is nginx's header buffer and llhttp's header line, so
# any value one header line carries fits. What the gateway remembers per identity is
# bounded by its digest (gateway.limiter.keys.memory_key), not by this.
DEFAULT_IDENTITY_MAX_LENGTH = 8 * 1024

# A response head the upstream client reads: its status line and header lines together,
# and its header lines. Envoy refuses past 60 KiB or 100 headers, nginx past its
# proxy_buffer_size (4 or 8 KiB); 64 KiB holds large Set-Cookie and CSP headers.
DEFAULT_UPSTREAM_MAX_HEADER_SIZE = 64 * 1024
DEFAULT_UPSTREAM_MAX_HEADER_LINES = 100


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    source: str
    listen: Address
    admin_listen: Address
    workers: int
    max_in_flight: int  # per worker process; past it, requests are shed with 503
    store: StoreConfig | None
    trusted_proxies: tuple[IPNetwork, ...]
    limits: tuple[Limit, ...]
    routes: tuple[Route, ...]
    shutdown_grace: float
    forwarded_headers: ForwardedHeaders = ForwardedHeaders.REPLACE
    jwt: JwtConfig | None = None  # how `jwt:CLAIM` identity sources verify their token
    path_normalization: PathNormalization = PathNormalization()
    listen_tls: ListenTls | None = None  # serve the public listener over TLS
    # Connections the kernel queues for the public and decision listeners before they are accepted.
    listen_backlog: int = DEFAULT_LISTEN_BACKLOG
    # The decision listener, for forward-auth proxies (gateway.proxy.decision); None: not opened.
    decision_listen: Address | None = None
    # A bearer token /metrics and /readyz require, read from the environment at load; never shown.
    admin_token: str | None = field(default=None, repr=False)
    admin_token_env: str | None = None  # the variable the token was read from (`admin_token_env`)
    # The admin API's top limited clients show identities as sent ("header:x-api-key=...")
    # instead of hashed. Off by default: they are often credentials.
    admin_raw_identities: bool = False
    # Names the admin listener answers to besides IP literals and localhost (gateway.admin.hosts).
    admin_hosts: frozenset[str] = frozenset()
    clients: ClientLimits = ClientLimits()
    access_log: str | None = None  # "text" or "json": one line per request on stdout; None: off
    upstream_connections: int = 1000  # per upstream and worker process; more requests wait up to timeout.queue
    # An upstream's response head past either is a 502, and its connection is closed.
    upstream_max_header_size: int = DEFAULT_UPSTREAM_MAX_HEADER_SIZE
    upstream_max_header_lines: int = DEFAULT_UPSTREAM_MAX_HEADER_LINES
    concurrency_limits: tuple[ConcurrencyLimit, ...] = ()
    max_delayed: int = 256  # requests one worker process holds waiting out a `mode: delay` wait; more are rejected
    client_ip: ClientIpStrategy = ClientIpStrategy()  # how a trusted proxy's header names the client
    # The longest identity value (characters) a limit reads; a longer one gets 431.
    identity_max_length: int = DEFAULT_IDENTITY_MAX_LENGTH
    # Bytes each in-process store may hold per worker: the store without `store:`, and the
    # stand-ins of `on_store_error: local`. Past it, the least recently checked bucket goes.
    local_store_memory: int = 32 * 1024 * 1024
    rls: RlsConfig | None = None  # Envoy's rate-limit service, when `rls_listen` is set

    @property
    def local_divisor(self) -> int:
        """What one process divides a limit by when it decides in process for a store that is
        down (`on_store_error: local`): `store.local_divisor` counts gateway instances, and
        each of an instance's `workers` keeps a stand-in bucket of its own."""
        return (self.store.local_divisor if self.store else 1) * self.workers


@dataclass(frozen=True, kw_only=True)
class RlsRateLimit:
    """One `rate_limit` of an envoyproxy/ratelimit config file, as the gateway counts it."""

    limit: Limit | None  # None: `unlimited: true`, never counted
    unit: str  # as Envoy's RateLimit.Unit names it, lower case: "second" ... "year"
    requests_per_unit: int  # 0: every request that costs anything is over the limit
    name: str = ""  # `rate_limit.name`, what another rate_limit's `replaces` refers to
    replaces: tuple[str, ...] = ()
    # The descriptor's `quota_mode` (without shadow_mode): `limit` is checked as a shadow one, and
    # its refusal refuses the request only when every quota-mode limit of it refuses.
    quota_mode: bool = False
    metadata: Mapping[str, Any] = field(default_factory=dict, compare=False)  # the descriptor's `metadata`
    charge_always: bool = False  # `charge: always`: every hit is charged, refused or not, into debt


@dataclass(frozen=True, kw_only=True)
class RlsDescriptor:
    """A node of a domain's descriptor tree: its rate limit, if it has one, and the nodes
    below it, by `key_value` for those with a value and by `key` for those without (any
    value matches, each value its own bucket). `wildcards`: the nodes whose value holds a
    `*`, in the order of the files, as (key, the value split on `*`, selector in children).
    `shared`: `share_threshold`, every value its wildcard matches counts in one bucket."""

    rate_limit: RlsRateLimit | None
    children: Mapping[str, RlsDescriptor] = field(default_factory=dict, compare=False)
    wildcards: tuple[tuple[str, tuple[str, ...], str], ...] = ()
    value: str = ""  # as written in the file: the pattern a shared node's buckets are keyed by
    shared: bool = False


@dataclass(frozen=True, kw_only=True)
class RlsConfig:
    """Envoy's rate-limit service (gateway.envoy): where it listens, and the descriptor trees
    of each domain, read from envoyproxy/ratelimit's YAML files at `config_path`."""

    listen: Address
    config_path: str
    domains: Mapping[str, RlsDescriptor] = field(compare=False)  # domain -> its root (no rate limit)
    merge_domains: bool = False  # `rls_merge_domains`: a domain may be split across files
