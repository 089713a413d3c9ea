"""The parsed configuration: immutable, typed, and trusted by every other module.

Nothing here reads files or validates; `gateway.config.loader` builds these
objects once, and the rest of the gateway only reads them.
"""

from __future__ import annotations

import enum
import ipaddress
from dataclasses import dataclass, field
from typing import Any

from gateway.config.units import Address, Rate

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


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
    """Where a client identity comes from: the peer address, a named header, query or cookie,
    or a claim of a verified JWT."""

    kind: str  # "ip" | "header" | "query" | "cookie" | "jwt"
    name: str = ""  # header names lower case; for "jwt", the claim

    def __str__(self) -> str:
        return self.kind if self.kind == "ip" else f"{self.kind}:{self.name}"


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


@dataclass(frozen=True, kw_only=True)
class Limit:
    name: str
    rate: Rate
    burst: float
    key: tuple[IdentitySource, ...]
    on_store_error: FailurePolicy
    shadow: bool = False  # checked and charged, counted as shadow_limited, but never rejects

    @property
    def refill_seconds(self) -> float:
        """How long an empty bucket takes to fill completely."""
        return self.burst / self.rate.per_second


@dataclass(frozen=True, kw_only=True)
class RouteLimit:
    limit: Limit
    cost: int


@dataclass(frozen=True, kw_only=True)
class Match:
    path: str
    methods: frozenset[str] | None = None
    host: str | None = None
    case_sensitive: bool = True


@dataclass(frozen=True, kw_only=True)
class UpstreamTimeout:
    connect: float
    read: float
    queue: float = 1.0  # waiting for a free connection to the upstream; exceeded gives 503


@dataclass(frozen=True, kw_only=True)
class Route:
    match: Match
    upstream: str
    limits: tuple[RouteLimit, ...]
    strip_prefix: bool
    preserve_host: bool
    timeout: UpstreamTimeout
    allow_path_parameters: bool = False  # `;` parameters in the path; refused with 400 otherwise
    max_body_size: int | None = None  # bytes of request body; more is refused with 413, before the upstream hears of it

    @property
    def label(self) -> str:
        """The route's name in metrics: its prefix and methods, never anything a client chose."""
        methods = " " + ",".join(sorted(self.match.methods)) if self.match.methods else ""
        return f"{self.match.host or ''}{self.match.path}{methods}"


@dataclass(frozen=True, kw_only=True)
class ClientLimits:
    """What one client connection may hold of the gateway (see gateway.bounded_protocol).
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


@dataclass(frozen=True, kw_only=True)
class ListenTls:
    """TLS on the public listener: a PEM certificate chain and its key, and the oldest
    protocol version accepted ("TLSv1.2" or "TLSv1.3")."""

    cert_file: str
    key_file: str
    min_version: str = "TLSv1.2"


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
    # A bearer token /metrics and /readyz require, read from the environment at load; never shown.
    admin_token: str | None = field(default=None, repr=False)
    # The admin API's top limited clients show identities as sent ("header:x-api-key=...")
    # instead of hashed. Off by default: they are often credentials.
    admin_raw_identities: bool = False
    clients: ClientLimits = ClientLimits()
    upstream_connections: int = 1000  # per upstream and worker process; more requests wait up to timeout.queue
