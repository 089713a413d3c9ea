"""Read the YAML file once and turn it into `GatewayConfig`, or fail with one clear line.

Trusts nothing in the file or the environment: every key is checked against
what it may hold, unknown keys are rejected, and each error names the file and
the YAML path (such as `routes[1].limits[0].name`) and what was expected.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import ipaddress
import os
import re
from collections.abc import Callable, Mapping
from typing import Any, NoReturn
from urllib.parse import SplitResult, urlsplit

import yaml

from gateway.config import jwt_keys, safe_yaml, tls
from gateway.config.body_template import parse_body_template, parse_content_type
from gateway.config.redaction import redacted_url
from gateway.config.regex import Regex
from gateway.config.model import (
    DEFAULT_BODY_CONTENT_TYPE,
    DEFAULT_LEASE_LAPSE,
    Allowlist,
    Balance,
    ClientIpHeader,
    ClientIpStrategy,
    ClientLimits,
    ConcurrencyLimit,
    DotSegments,
    EscapedSlashes,
    FailurePolicy,
    ForwardedHeaders,
    GatewayConfig,
    HeaderStyle,
    HeaderRules,
    HealthCheck,
    IdentitySource,
    JwtConfig,
    JwtFailure,
    Limit,
    ListenTls,
    Match,
    PassiveEjection,
    PathForm,
    PathNormalization,
    ResponseStyle,
    Quota,
    Route,
    RouteLimit,
    StoreConfig,
    Target,
    Tiers,
    UpstreamPool,
    UpstreamTimeout,
    ValueMatch,
)
from gateway.config.store_url import SingleTarget, parse_store_url
from gateway.config.units import (
    Address,
    Rate,
    parse_address,
    parse_duration,
    parse_rate,
    parse_size,
    parse_time_of_day,
)

# Envoy's rate-limit filter defaults to 20 ms; 10 ms leaves a same-zone Redis
# (~0.2 ms round trip) fifty times its usual latency before a request pays for it.
DEFAULT_STORE_TIMEOUT = "10ms"
DEFAULT_STORE_PREFIX = "rl:"
# Store commands queued or awaiting a reply, per gateway process: ~40 times what a
# healthy Redis has in flight at 10k checks/s. Past it, checks fail at once as store
# errors, so a Redis that stopped answering costs requests nothing.
DEFAULT_STORE_MAX_PENDING = 4096
DEFAULT_LISTEN = "0.0.0.0:8080"
DEFAULT_ADMIN_LISTEN = "127.0.0.1:9090"
# Long enough for ordinary API calls to finish, short enough for an orchestrator's
# default 30 s termination grace period.
DEFAULT_SHUTDOWN_GRACE = "20s"
# Processes, each a full gateway: far past the cores of any one machine.
MAX_WORKERS = 1024
DEFAULT_MAX_IN_FLIGHT = 1024  # per process; wrk: req/s flat from 100 to 2000 in flight, falling by 4000, so ~0.5 s of queue
DEFAULT_CONNECT_TIMEOUT = "5s"
DEFAULT_READ_TIMEOUT = "60s"
# A request waits this long for a free connection to its upstream before a 503: a
# saturated upstream answers at once that it is, instead of queueing clients unboundedly.
DEFAULT_QUEUE_TIMEOUT = "1s"
# nginx's defaults: client_header_timeout, client_body_timeout, keepalive_timeout, keepalive_requests.
DEFAULT_CLIENT_HEADER_TIMEOUT = "60s"
DEFAULT_CLIENT_BODY_TIMEOUT = "60s"
DEFAULT_KEEPALIVE_TIMEOUT = "75s"
DEFAULT_KEEPALIVE_REQUESTS = 1000
# The request line and all header lines together. nginx's effective cap is 4 buffers of
# 8 KiB (large_client_header_buffers), Node's 16 KiB, Tomcat's 8 KiB; 32 KiB leaves room
# for large cookies and tokens, and 300 unfinished heads then hold ~10 MB, not 400 MB.
DEFAULT_MAX_HEADER_SIZE = "32KiB"
# Connections per upstream and worker process (aiohttp's default of 100 queues the rest).
DEFAULT_UPSTREAM_CONNECTIONS = 1000
# Upstream pools. Passive ejection takes Envoy's outlier-detection defaults (5 consecutive
# errors, 30 s out); the active check defaults are nginx Plus's interval with Envoy-like
# thresholds, so one lost probe never flaps a target. One retry, as nginx's
# proxy_next_upstream passes a refused connection on to the next server by default.
DEFAULT_EJECT_AFTER = 5
DEFAULT_EJECT_FOR = "30s"
DEFAULT_RETRIES = 1
DEFAULT_HEALTH_INTERVAL = "5s"
DEFAULT_HEALTH_TIMEOUT = "1s"
DEFAULT_UNHEALTHY_AFTER = 3
DEFAULT_HEALTHY_AFTER = 2
# A concurrency lease outlives a gateway that died holding it by at most this. Leases of
# requests that last longer are renewed every third of it, so it only bounds that wait.
DEFAULT_LEASE_TTL = "60s"
# Renewals come every third of the TTL; below a second they would be most of the traffic.
MIN_LEASE_TTL = 1.0
# A rejection says "too many requests" (429), or, for clients that retry only on it, "unavailable" (503).
REJECTION_STATUSES = (429, 503)
# Requests one worker holds waiting out a `mode: delay` wait. Each keeps its connection and
# counts toward max_in_flight; a quarter of the default leaves the rest to requests that
# go straight through.
DEFAULT_MAX_DELAYED = 256
DEFAULT_LOCAL_STORE_MEMORY = "32MiB"
# The longest `max_delay`: a wait past it is better told to the client as Retry-After
# than held on an open connection.
MAX_MAX_DELAY = 60.0
# A quota's window lengths; a month's is nominal (its windows follow the calendar).
QUOTA_PERIODS = {"hour": 3600.0, "day": 86400.0, "week": 7 * 86400.0, "month": 30 * 86400.0}
IDENTITY_KINDS = ("header", "query", "cookie", "jwt")
# Sources that name no client but the request: the matched route's configured path (bounded
# by the config, unlike the request path, which a client could vary to mint buckets), the
# Host as routes match it, and the method (unregistered ones read as OTHER).
REQUEST_SOURCES = ("path", "host", "method")
# Sources every request has: entries after one of them in a `key` list are never read.
ALWAYS_PRESENT = ("ip", "global", "path", "method")
# The IANA HTTP Method Registry, less CONNECT (never routed: the gateway is no tunnel) and
# PRI (the HTTP/2 preface). A method outside it in `match.methods` is a typo such as GTE.
ROUTABLE_METHODS = frozenset(
    {
        "ACL", "BASELINE-CONTROL", "BIND", "CHECKIN", "CHECKOUT", "COPY", "DELETE", "GET", "HEAD", "LABEL",
        "LINK", "LOCK", "MERGE", "MKACTIVITY", "MKCALENDAR", "MKCOL", "MKREDIRECTREF", "MKWORKSPACE", "MOVE",
        "OPTIONS", "ORDERPATCH", "PATCH", "POST", "PROPFIND", "PROPPATCH", "PUT", "QUERY", "REBIND", "REPORT",
        "SEARCH", "TRACE", "UNBIND", "UNCHECKOUT", "UNLINK", "UNLOCK", "UPDATE", "UPDATEREDIRECTREF",
        "VERSION-CONTROL",
    }
)
# Hex digits in either case, as sha256sum (lower) and PowerShell's Get-FileHash (upper) print them.
# The most tokens, requests or leases a limit counts. Redis and Lua keep counts as
# doubles, which hold whole numbers exactly only up to 2^53: a bucket of 1e20 tokens
# never goes down by one. 10^15 leaves room for fractional refills.
MAX_COUNT = 10**15
_SHA256_RE = re.compile(r"^sha256:([0-9a-fA-F]{64})$")
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"})
_FORWARDING = frozenset({"x-forwarded-for", "x-forwarded-proto", "x-forwarded-host", "forwarded"})
# Headers an identity may not be read from: hop-by-hop fields never reach the upstream, and
# the forwarding headers are the gateway's to write (`ip` with trusted_proxies reads them).
UNKEYABLE_HEADERS = _HOP_BY_HOP | _FORWARDING
# Headers a route may not rewrite. Hop-by-hop fields describe one connection, and
# Content-Length is set by the HTTP library from the body each leg actually carries.
# Going upstream, the forwarding headers, Host (see preserve_host) and X-Request-ID
# are the gateway's to write; coming back, X-Request-ID and the RateLimit fields.
_UNREWRITABLE = _HOP_BY_HOP | {"content-length", "x-request-id"}
_UNREWRITABLE_REQUEST_HEADERS = _UNREWRITABLE | _FORWARDING | {"host"}
_UNREWRITABLE_RESPONSE_HEADERS = _UNREWRITABLE | {
    "ratelimit", "ratelimit-policy", "x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-reset"
}
_INTERPOLATION_RE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_LIMIT_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")
_WILDCARD_HOST_PREFIX = "*."
_HOST_RE = re.compile(r"^(?:[a-z0-9](?:[a-z0-9\-]*[a-z0-9])?\.)*[a-z0-9](?:[a-z0-9\-]*[a-z0-9])?$|^\[[0-9a-f:.]+\]$")
_HTTP_TOKEN_RE = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_TARGET_NAME_RE = re.compile(r"^[A-Za-z0-9_.:\-\[\]]+$")
_HEALTH_PATH_RE = re.compile(r"^/[!-~]*$")
_NOT_IN_ROUTE_PATH = re.compile(r"[%;?#\\\x00-\x1f\x7f]")
# A header value as a route sets it: visible ASCII, spaces and tabs inside (RFC 9110 §5.5),
# so no value can end a header line early.
_HEADER_VALUE_RE = re.compile(r"[!-~](?:[ \t!-~]*[!-~])?|")


def _misfit(value: str) -> str:
    """Where a header value breaks the rule, without quoting it: values are often secrets
    from the environment (`Authorization: "Bearer ${TOKEN}"`)."""
    if value[:1] in (" ", "\t") or value[-1:] in (" ", "\t"):
        return f"this one of {len(value)} characters starts or ends with a space or tab"
    position = next(i for i, char in enumerate(value) if not (" " <= char <= "~" or char == "\t"))
    return f"character {position + 1} of {len(value)} is {ascii(value[position])}"


class ConfigError(Exception):
    """An invalid config file; str() is the one line shown to the user. Characters that are
    not printable (a key holding a newline, a value with a control character) are escaped
    as Python writes them, so the message stays one line and writes nothing to a terminal."""

    def __init__(self, message: str) -> None:
        if not message.isprintable():
            message = "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)
        super().__init__(message)


class _Reader:
    """Walks the parsed document, remembering the YAML path for error messages."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, path: str, message: str) -> NoReturn:
        where = f"{self.source}: {path}" if path else self.source
        raise ConfigError(f"{where}: {message}")

    def mapping(
        self, value: Any, path: str, *, required: tuple[str, ...] = (), optional: tuple[str, ...] = ()
    ) -> Mapping[str, Any]:
        if not isinstance(value, dict):
            self.fail(path, f"expected a mapping, got {_type_name(value)}")
        for key in value:
            if key not in required and key not in optional:
                allowed = ", ".join(required + optional)
                self.fail(_join(path, str(key)), f"unknown key (expected one of: {allowed})")
        for key in required:
            if key not in value:
                self.fail(_join(path, key), "required key is missing")
        return value

    def string(self, value: Any, path: str) -> str:
        if not isinstance(value, str) or not value:
            self.fail(path, f"expected a non-empty string, got {_type_name(value)}")
        return value

    def boolean(self, value: Any, path: str) -> bool:
        if not isinstance(value, bool):
            self.fail(path, f"expected true or false, got {_type_name(value)}")
        return value

    def integer(self, value: Any, path: str, *, minimum: int, maximum: int = MAX_COUNT) -> int:
        """A whole number in [minimum, maximum]: every number in the config has a finite range."""
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(path, f"expected an integer, got {_type_name(value)}")
        if value < minimum:
            self.fail(path, f"expected an integer >= {minimum}, got {_shown_integer(value)}")
        if value > maximum:
            self.fail(path, f"expected an integer <= {maximum:,}, got {_shown_integer(value)}")
        return value

    def count(self, value: Any, path: str) -> int:
        """A number of tokens, requests or leases: from 1 to MAX_COUNT."""
        return self.integer(value, path, minimum=1, maximum=MAX_COUNT)

    def sequence(self, value: Any, path: str) -> list[Any]:
        if not isinstance(value, list):
            self.fail(path, f"expected a list, got {_type_name(value)}")
        return value

    def parsed(self, parse: Callable[[Any], Any], value: Any, path: str) -> Any:
        try:
            return parse(value)
        except ValueError as exc:
            self.fail(path, str(exc))


def load_config(path: str) -> GatewayConfig:
    """Read and validate the config file at `path`."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: cannot read: not UTF-8 text") from None
    return parse_config(text, source=path, environ=os.environ)


def parse_config(text: str, *, source: str, environ: Mapping[str, str]) -> GatewayConfig:
    reader = _Reader(source)
    try:
        # Plain data only, never Python objects; aliases bounded before the tree is walked.
        document = safe_yaml.load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{source}: malformed YAML: {where}{problem}") from None
    except RecursionError:
        raise ConfigError(f"{source}: malformed YAML: nested too deeply") from None
    try:
        document = _interpolate(document, "", environ, reader)
        return _build(document, reader, environ)
    except RecursionError:
        # Only reachable through aliases that nest a document into itself many times over.
        raise ConfigError(f"{source}: nested too deeply") from None


def _interpolate(value: Any, path: str, environ: Mapping[str, str], reader: _Reader) -> Any:
    if isinstance(value, dict):
        return {k: _interpolate(v, _join(path, str(k)), environ, reader) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, f"{path}[{i}]", environ, reader) for i, v in enumerate(value)]
    if not isinstance(value, str) or "$" not in value:
        return value

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, default = match.group(1), match.group(2)
        if name in environ:
            return environ[name]
        if default is not None:
            return default
        reader.fail(path, f"environment variable {name} is not set and has no default (${{{name}:-default}})")

    result = _INTERPOLATION_RE.sub(substitute, value)
    if _INTERPOLATION_RE.fullmatch(value) and value != "$$":
        # A value that is one whole ${VAR} takes the type its text has in YAML,
        # so `workers: ${WORKERS:-1}` is an integer, not the string "1".
        try:
            scalar = safe_yaml.load(result) if result else result
        except yaml.YAMLError:
            return result
        if isinstance(scalar, (int, float, bool)) or scalar is None:
            return scalar
    return result


# YAML 1.1 reads a bare `off` as false, so both spell "no access log".
ACCESS_LOG_FORMATS = ("text", "json")


def _access_log(value: Any, r: _Reader) -> str | None:
    if value is False or value == "off":
        return None
    if value not in ACCESS_LOG_FORMATS:
        r.fail("access_log", f"expected off, text or json, got {value!r}")
    return value


def _build(document: Any, r: _Reader, environ: Mapping[str, str]) -> GatewayConfig:
    if document is None:
        r.fail("", "the file is empty; it needs at least `routes`")
    top = r.mapping(
        document,
        "",
        required=("routes",),
        optional=(
            "listen", "admin_listen", "workers", "max_in_flight", "store", "trusted_proxies", "limits",
            "shutdown_grace", "forwarded_headers", "jwt", "path_normalization", "admin_token_env",
            "admin_raw_identities", "admin_hosts",
            "client_header_timeout", "client_body_timeout", "keepalive_timeout", "keepalive_requests",
            "max_header_size", "upstream_connections", "access_log", "response", "max_delayed", "client_ip",
            "local_store_memory",
        ),
    )
    listen, listen_tls = _listen(top.get("listen", DEFAULT_LISTEN), r)
    admin_listen = r.parsed(parse_address, top.get("admin_listen", DEFAULT_ADMIN_LISTEN), "admin_listen")
    workers = r.integer(top.get("workers", 1), "workers", minimum=1, maximum=MAX_WORKERS)
    max_in_flight = r.integer(top.get("max_in_flight", DEFAULT_MAX_IN_FLIGHT), "max_in_flight", minimum=1)
    store = _store(top["store"], r) if top.get("store") is not None else None
    if workers > 1 and store is None:
        r.fail(
            "workers",
            f"{workers} needs a shared `store:`; with the in-process store each worker "
            f"would count separately and clients would get {workers} times the limit",
        )
    for key, address in (("listen", listen), ("admin_listen", admin_listen)):
        if workers > 1 and address.port == 0:
            r.fail(key, f"port 0 needs workers: 1; with workers: {workers} each worker would get a different port")
    trusted = tuple(
        r.parsed(lambda v: _network(str(v)), item, f"trusted_proxies[{i}]")
        for i, item in enumerate(r.sequence(top.get("trusted_proxies", []), "trusted_proxies"))
    )
    forwarded_text = top.get("forwarded_headers", ForwardedHeaders.REPLACE.value)
    try:
        forwarded_headers = ForwardedHeaders(forwarded_text)
    except ValueError:
        r.fail("forwarded_headers", f"expected replace or append, got {forwarded_text!r}")
    client_ip = _client_ip(top["client_ip"], trusted, r) if "client_ip" in top else ClientIpStrategy()
    jwt_config = _jwt(top["jwt"], r, environ) if top.get("jwt") is not None else None
    limits_doc = top.get("limits") or {}
    response = _response(top.get("response", {}), "response", ResponseStyle(), r)
    limits = {
        name: (
            _concurrency_limit(name, spec, f"limits.{name}", r)
            if isinstance(spec, dict) and "concurrency" in spec
            else _limit(name, spec, f"limits.{name}", response, trusted, r)
        )
        for name, spec in r.mapping(limits_doc, "limits", optional=tuple(limits_doc) if isinstance(limits_doc, dict) else ()).items()
    }
    leased = next((name for name, limit in limits.items() if isinstance(limit, Limit) and limit.lease), None)
    if leased is not None and store is None:
        r.fail(
            f"limits.{leased}.lease",
            "a lease takes tokens from a shared store; without `store` the in-process buckets are local already",
        )
    jwt_sources = [
        (name, i)
        for name, limit in limits.items()
        for i, source in enumerate(limit.key)
        if any(leaf.kind == "jwt" for leaf in source.leaves)
    ]
    if jwt_sources and jwt_config is None:
        name, i = jwt_sources[0]
        r.fail(f"limits.{name}.key[{i}]", "a jwt:CLAIM source needs a top-level `jwt` block with the keys that verify tokens")
    if jwt_config is not None and not jwt_sources:
        r.fail("jwt", "no limit's `key` has a jwt:CLAIM source, so these keys would verify nothing")
    routes_doc = r.sequence(top["routes"], "routes")
    if not routes_doc:
        r.fail("routes", "expected at least one route")
    targets = _SharedTargets()
    routes = tuple(_route(item, f"routes[{i}]", limits, targets, r) for i, item in enumerate(routes_doc))
    return GatewayConfig(
        source=r.source,
        listen=listen,
        admin_listen=admin_listen,
        workers=workers,
        max_in_flight=max_in_flight,
        store=store,
        trusted_proxies=trusted,
        limits=tuple(limit for limit in limits.values() if isinstance(limit, Limit)),
        routes=routes,
        shutdown_grace=r.parsed(parse_duration, top.get("shutdown_grace", DEFAULT_SHUTDOWN_GRACE), "shutdown_grace"),
        forwarded_headers=forwarded_headers,
        jwt=jwt_config,
        path_normalization=_path_normalization(top.get("path_normalization", {}), r),
        listen_tls=listen_tls,
        admin_token=_admin_token(top.get("admin_token_env"), r, environ),
        admin_raw_identities=r.boolean(top.get("admin_raw_identities", False), "admin_raw_identities"),
        admin_hosts=_admin_hosts(top.get("admin_hosts", []), r),
        access_log=_access_log(top.get("access_log", False), r),
        clients=ClientLimits(
            header_timeout=r.parsed(
                parse_duration, top.get("client_header_timeout", DEFAULT_CLIENT_HEADER_TIMEOUT), "client_header_timeout"
            ),
            body_timeout=r.parsed(
                parse_duration, top.get("client_body_timeout", DEFAULT_CLIENT_BODY_TIMEOUT), "client_body_timeout"
            ),
            keepalive_timeout=r.parsed(
                parse_duration, top.get("keepalive_timeout", DEFAULT_KEEPALIVE_TIMEOUT), "keepalive_timeout"
            ),
            keepalive_requests=r.integer(
                top.get("keepalive_requests", DEFAULT_KEEPALIVE_REQUESTS), "keepalive_requests", minimum=1
            ),
            max_header_size=r.parsed(parse_size, top.get("max_header_size", DEFAULT_MAX_HEADER_SIZE), "max_header_size"),
        ),
        upstream_connections=r.integer(
            top.get("upstream_connections", DEFAULT_UPSTREAM_CONNECTIONS), "upstream_connections", minimum=1
        ),
        concurrency_limits=tuple(limit for limit in limits.values() if isinstance(limit, ConcurrencyLimit)),
        max_delayed=r.integer(top.get("max_delayed", DEFAULT_MAX_DELAYED), "max_delayed", minimum=1),
        client_ip=client_ip,
        local_store_memory=r.parsed(
            parse_size, top.get("local_store_memory", DEFAULT_LOCAL_STORE_MEMORY), "local_store_memory"
        ),
    )


def _listen(doc: Any, r: _Reader) -> tuple[Address, ListenTls | None]:
    """`listen: HOST:PORT`, or `listen: {address: HOST:PORT, tls: {cert, key, min_version}}`."""
    if not isinstance(doc, dict):
        return r.parsed(parse_address, doc, "listen"), None
    spec = r.mapping(doc, "listen", required=("address",), optional=("tls",))
    address = r.parsed(parse_address, spec["address"], "listen.address")
    if spec.get("tls") is None:
        return address, None
    tls_doc = r.mapping(spec["tls"], "listen.tls", required=("cert", "key"), optional=("min_version",))
    min_version = tls_doc.get("min_version", "TLSv1.2")
    if not isinstance(min_version, str) or min_version not in tls.TLS_VERSIONS:
        r.fail("listen.tls.min_version", f"expected {' or '.join(tls.TLS_VERSIONS)}, got {min_version!r}")
    listen_tls = ListenTls(
        cert_file=r.string(tls_doc["cert"], "listen.tls.cert"),
        key_file=r.string(tls_doc["key"], "listen.tls.key"),
        min_version=min_version,
    )
    try:
        tls.server_context(listen_tls)
    except tls.EncryptedKey as exc:
        r.fail("listen.tls.key", str(exc))
    except OSError as exc:
        r.fail("listen.tls", f"cannot load the certificate and key: {exc.strerror or exc}")
    return address, listen_tls


def _admin_hosts(value: Any, r: _Reader) -> frozenset[str]:
    """The names the admin listener answers to besides IP literals and localhost."""
    names = set()
    for i, item in enumerate(r.sequence(value, "admin_hosts")):
        name = r.string(item, f"admin_hosts[{i}]").lower().removesuffix(".")
        if not _HOST_RE.match(name) or name.startswith("["):
            r.fail(f"admin_hosts[{i}]", f"expected a host name without a port, got {item!r}")
        names.add(name)
    return frozenset(names)


def _admin_token(name: Any, r: _Reader, environ: Mapping[str, str]) -> str | None:
    """The admin bearer token from the environment variable `admin_token_env` names; the
    token itself never sits in the file, and no message shows it."""
    if name is None:
        return None
    name = r.string(name, "admin_token_env")
    token = environ.get(name)
    if token is None:
        r.fail("admin_token_env", f"environment variable {name} is not set")
    if len(token) < 16 or not token.isascii() or not token.isprintable() or " " in token:
        r.fail("admin_token_env", f"the token in {name} must be at least 16 visible ASCII characters")
    return token


def _jwt(doc: Any, r: _Reader, environ: Mapping[str, str]) -> JwtConfig:
    spec = r.mapping(
        doc,
        "jwt",
        optional=("secret_env", "public_key_file", "jwks_file", "issuer", "audience", "leeway", "on_invalid"),
    )
    given = [key for key in ("secret_env", "public_key_file", "jwks_file") if key in spec]
    if len(given) != 1:
        r.fail("jwt", "expected exactly one of secret_env (HS256), public_key_file or jwks_file (RS256, ES256)")
    where = f"jwt.{given[0]}"
    value = r.string(spec[given[0]], where)
    if given[0] == "secret_env":
        if value not in environ:
            r.fail(where, f"environment variable {value} is not set")
        keys = (r.parsed(jwt_keys.hs256_key, environ[value], where),)
    elif given[0] == "public_key_file":
        keys = (r.parsed(jwt_keys.public_key_file, value, where),)
    else:
        keys = r.parsed(jwt_keys.jwks_file, value, where)
    on_invalid_text = spec.get("on_invalid", JwtFailure.NEXT.value)
    try:
        on_invalid = JwtFailure(on_invalid_text)
    except ValueError:
        r.fail("jwt.on_invalid", f"expected next or reject, got {on_invalid_text!r}")
    return JwtConfig(
        keys=keys,
        issuer=r.string(spec["issuer"], "jwt.issuer") if "issuer" in spec else None,
        audience=r.string(spec["audience"], "jwt.audience") if "audience" in spec else None,
        leeway=r.parsed(parse_duration, spec["leeway"], "jwt.leeway") if "leeway" in spec else 0.0,
        on_invalid=on_invalid,
    )


def _path_normalization(doc: Any, r: _Reader) -> PathNormalization:
    spec = r.mapping(doc, "path_normalization", optional=("dot_segments", "escaped_slashes", "merge_slashes"))
    return PathNormalization(
        dot_segments=_choice(
            DotSegments, spec.get("dot_segments", DotSegments.RESOLVE.value), "path_normalization.dot_segments", r
        ),
        escaped_slashes=_choice(
            EscapedSlashes, spec.get("escaped_slashes", EscapedSlashes.KEEP.value), "path_normalization.escaped_slashes", r
        ),
        merge_slashes=r.boolean(spec.get("merge_slashes", True), "path_normalization.merge_slashes"),
    )


def _choice(kind: type[enum.Enum], value: Any, path: str, r: _Reader) -> Any:
    try:
        return kind(value)
    except ValueError:
        *others, last = (member.value for member in kind)
        r.fail(path, f"expected {', '.join(others)} or {last}, got {value!r}")


def _store(doc: Any, r: _Reader) -> StoreConfig:
    spec = r.mapping(
        doc,
        "store",
        required=("url",),
        optional=("timeout", "prefix", "local_divisor", "max_pending", "max_connections", "key_secret", "tls_ca_file", "required"),
    )
    if "max_connections" in spec:
        r.fail(
            "store.max_connections",
            "no longer used: each gateway process pipelines every check over one connection per Redis node; "
            "store.max_pending bounds the commands waiting on it",
        )
    url = r.string(spec["url"], "store.url")
    target = r.parsed(parse_store_url, url, "store.url")
    prefix = spec.get("prefix", DEFAULT_STORE_PREFIX)
    if not isinstance(prefix, str):
        r.fail("store.prefix", f"expected a string, got {_type_name(prefix)}")
    if "{" in prefix or "}" in prefix:
        r.fail("store.prefix", "must not contain { or }, which Redis Cluster reads as a hash tag")
    secret = spec.get("key_secret")
    ca_file = spec.get("tls_ca_file")
    if ca_file is not None:
        ca_file = r.string(ca_file, "store.tls_ca_file")
        if not (isinstance(target, SingleTarget) and target.tls):
            r.fail("store.tls_ca_file", "only applies to a rediss:// (TLS) store URL")
        if not os.path.isfile(ca_file):
            r.fail("store.tls_ca_file", f"no such file: {ca_file!r}")
    return StoreConfig(
        url=url,
        target=target,
        timeout=r.parsed(parse_duration, spec.get("timeout", DEFAULT_STORE_TIMEOUT), "store.timeout"),
        prefix=prefix,
        local_divisor=r.integer(spec.get("local_divisor", 1), "store.local_divisor", minimum=1),
        max_pending=r.integer(spec.get("max_pending", DEFAULT_STORE_MAX_PENDING), "store.max_pending", minimum=1),
        key_secret=r.string(secret, "store.key_secret") if secret is not None else None,
        tls_ca_file=ca_file,
        required=r.boolean(spec.get("required", False), "store.required"),
    )


def _limit(name: Any, doc: Any, path: str, response: ResponseStyle, trusted: tuple[Any, ...], r: _Reader) -> Limit:
    """`response`: the top-level `response`, which the limit's own overrides key by key."""
    if not isinstance(name, str) or not _LIMIT_NAME_RE.match(name):
        r.fail(path, "limit names may use letters, digits, '_', '-' and '.' only")
    spec = r.mapping(
        doc,
        path,
        optional=(
            "rate", "burst", "quota", "key", "on_store_error", "shadow", "mode", "max_delay", "response", "lease",
            "lease_lapse", "tiers", "allow",
        ),
    )
    if ("rate" in spec) == ("quota" in spec):
        r.fail(path, "expected exactly one of `rate` (a token bucket) and `quota` (a fixed window)")
    quota = None
    if "quota" in spec:
        if "burst" in spec:
            r.fail(f"{path}.burst", "a quota has no burst: its limit is what one window admits")
        quota = _quota(spec["quota"], f"{path}.quota", r)
        rate = Rate(tokens=quota.limit, period_seconds=QUOTA_PERIODS[quota.per], text=f"{quota.limit}/{quota.per}")
        burst = quota.limit
    else:
        rate, burst = _rate_and_burst(spec, path, r)
    max_delay = _max_delay(spec, path, r)
    if max_delay and quota is not None:
        r.fail(f"{path}.mode", "a quota cannot delay: its window refills only when it ends")
    if max_delay and spec.get("shadow") is True:
        r.fail(f"{path}.mode", "a shadow limit never holds a request back, so it cannot delay one")
    sources = _key(spec, path, r)
    policy = _choice(FailurePolicy, spec.get("on_store_error", FailurePolicy.OPEN.value), f"{path}.on_store_error", r)
    shadow = r.boolean(spec.get("shadow", False), f"{path}.shadow")
    if "response" in spec:
        response = _response(spec["response"], f"{path}.response", response, r)
    lease = r.count(spec["lease"], f"{path}.lease") if "lease" in spec else 0
    if lease > burst:
        r.fail(f"{path}.lease", f"a lease of {lease} is more than the burst {burst}, which is all a bucket ever holds")
    if "lease_lapse" in spec and not lease:
        r.fail(f"{path}.lease_lapse", "applies to a `lease`, which this limit does not have")
    lease_lapse = DEFAULT_LEASE_LAPSE
    if "lease_lapse" in spec:
        lease_lapse = r.parsed(parse_duration, spec["lease_lapse"], f"{path}.lease_lapse")
    if lease and (quota is not None or max_delay):
        r.fail(f"{path}.lease", "a lease takes tokens of a token bucket that rejects; a quota or a delaying limit has none to lease")
    limit = Limit(
        name=name,
        rate=rate,
        burst=burst,
        key=sources,
        on_store_error=policy,
        shadow=shadow,
        response=response,
        lease=lease,
        lease_lapse=lease_lapse,
        max_delay=max_delay,
        quota=quota,
    )
    if "allow" in spec:
        limit = dataclasses.replace(limit, allow=_allow(spec["allow"], f"{path}.allow", sources, r))
    if "tiers" in spec:
        if lease or quota is not None:
            r.fail(f"{path}.tiers", "tiers give buckets their own rate and burst; not with a quota or a lease")
        limit = dataclasses.replace(limit, tiers=_tiers(spec["tiers"], f"{path}.tiers", limit, trusted, r))
    return limit


def _response(doc: Any, path: str, inherited: ResponseStyle, r: _Reader) -> ResponseStyle:
    """A `response` block: each key given replaces the one `inherited`. `body` and
    `content_type` go together: a block that sets `body` gets its own content type."""
    spec = r.mapping(doc, path, optional=("status", "headers", "body", "content_type"))
    status = inherited.status
    if "status" in spec:
        status = r.integer(spec["status"], f"{path}.status", minimum=0)
        if status not in REJECTION_STATUSES:
            r.fail(f"{path}.status", f"expected 429 or 503, got {status}")
    headers = _choice(HeaderStyle, spec["headers"], f"{path}.headers", r) if "headers" in spec else inherited.headers
    if "content_type" in spec and "body" not in spec:
        r.fail(f"{path}.content_type", "sets the type of `body`, which this block does not set")
    body, content_type = inherited.body, inherited.content_type
    if "body" in spec:
        body = r.parsed(parse_body_template, spec["body"], f"{path}.body")
        content_type = r.parsed(parse_content_type, spec.get("content_type", DEFAULT_BODY_CONTENT_TYPE), f"{path}.content_type")
    return ResponseStyle(status=status, headers=headers, body=body, content_type=content_type)


def _concurrency_limit(name: Any, doc: Any, path: str, r: _Reader) -> ConcurrencyLimit:
    """A limit with `concurrency: N` is its own kind: it counts requests in flight, not a rate."""
    if not isinstance(name, str) or not _LIMIT_NAME_RE.match(name):
        r.fail(path, "limit names may use letters, digits, '_', '-' and '.' only")
    for key in ("rate", "burst", "shadow"):
        if key in doc:
            r.fail(
                _join(path, key),
                f"a concurrency limit takes no {key}; define a rate limit of its own and list both on the route",
            )
    spec = r.mapping(doc, path, required=("concurrency",), optional=("lease_ttl", "key", "on_store_error"))
    lease_ttl = r.parsed(parse_duration, spec.get("lease_ttl", DEFAULT_LEASE_TTL), f"{path}.lease_ttl")
    if lease_ttl < MIN_LEASE_TTL:
        r.fail(f"{path}.lease_ttl", f"expected at least {MIN_LEASE_TTL:g}s, got {spec['lease_ttl']!r}")
    sources = _key(spec, path, r)
    policy = _choice(FailurePolicy, spec.get("on_store_error", FailurePolicy.OPEN.value), f"{path}.on_store_error", r)
    return ConcurrencyLimit(
        name=name,
        concurrency=r.count(spec["concurrency"], f"{path}.concurrency"),
        lease_ttl=lease_ttl,
        key=sources,
        on_store_error=policy,
    )


def _max_delay(spec: Mapping[str, Any], path: str, r: _Reader) -> float:
    """`mode: delay` with `max_delay`: the longest wait; 0 for `mode: reject` (the default)."""
    mode = spec.get("mode", "reject")
    if mode not in ("reject", "delay"):
        r.fail(f"{path}.mode", f"expected reject or delay, got {mode!r}")
    if mode == "reject":
        if "max_delay" in spec:
            r.fail(f"{path}.max_delay", "only applies with mode: delay")
        return 0.0
    if "max_delay" not in spec:
        r.fail(f"{path}.max_delay", "required with mode: delay (the longest a request waits, such as 500ms)")
    max_delay = r.parsed(parse_duration, spec["max_delay"], f"{path}.max_delay")
    if max_delay > MAX_MAX_DELAY:
        r.fail(f"{path}.max_delay", f"at most {MAX_MAX_DELAY:g}s: a longer wait is better told as Retry-After")
    return max_delay


def _quota(doc: Any, path: str, r: _Reader) -> Quota:
    spec = r.mapping(doc, path, required=("limit", "per"), optional=("reset",))
    per = spec["per"]
    if per not in QUOTA_PERIODS:
        r.fail(f"{path}.per", f"expected {', '.join(QUOTA_PERIODS)}, got {per!r}")
    return Quota(
        limit=r.count(spec["limit"], f"{path}.limit"),
        per=per,
        reset=r.parsed(parse_time_of_day, spec.get("reset", "00:00 UTC"), f"{path}.reset"),
    )


def _key(spec: Mapping[str, Any], path: str, r: _Reader) -> tuple[IdentitySource, ...]:
    """A limit's `key`: its sources in order, the first present wins."""
    keys = spec.get("key", ["ip"])
    if isinstance(keys, str):
        keys = [keys]
    # `key: []`: no source at all, so every client shares the one bucket.
    items = r.sequence(keys, f"{path}.key") or ["global"]
    sources = tuple(_identity(item, f"{path}.key[{i}]", r) for i, item in enumerate(items))
    for i, source in enumerate(sources):
        if source in sources[:i]:
            r.fail(f"{path}.key[{i}]", f"{source} is listed twice")
        if i and all(leaf.kind in ALWAYS_PRESENT for leaf in sources[i - 1].leaves):
            r.fail(f"{path}.key[{i}]", f"never read: every request has {sources[i - 1]}, listed before it")
    return sources


def _rate_and_burst(spec: Mapping[str, Any], path: str, r: _Reader) -> tuple[Any, int]:
    rate = r.parsed(parse_rate, spec["rate"], f"{path}.rate")
    if "burst" in spec:
        return rate, r.count(spec["burst"], f"{path}.burst")
    if rate.tokens != int(rate.tokens) or rate.tokens < 1:
        r.fail(f"{path}.burst", f"required when the rate's count is not a whole number ({rate.text})")
    if rate.tokens > MAX_COUNT:
        r.fail(f"{path}.rate", f"a burst of {rate.tokens:g} is more than the {MAX_COUNT:,} a limit counts exactly")
    return rate, int(rate.tokens)


def _identity(value: Any, path: str, r: _Reader) -> IdentitySource:
    """One entry of a limit's `key`: a source, or a list of sources that together name a bucket."""
    if not isinstance(value, list):
        return _single_source(value, path, r)
    parts = tuple(_single_source(item, f"{path}[{i}]", r) for i, item in enumerate(value))
    if len(parts) < 2:
        r.fail(path, "a composite key entry lists two sources or more (one source needs no list)")
    for i, part in enumerate(parts):
        if part.kind == "global":
            r.fail(f"{path}[{i}]", "global names no client; it cannot be part of a composite key")
        if part in parts[:i]:
            r.fail(f"{path}[{i}]", f"{part} is listed twice")
    return IdentitySource(kind="composite", parts=parts)


def _single_source(value: Any, path: str, r: _Reader) -> IdentitySource:
    expected = (
        "expected ip, ip/PREFIX, ip/PREFIX4,PREFIX6, header:NAME, query:NAME, cookie:NAME, jwt:CLAIM, "
        "path, host, method or global"
    )
    if isinstance(value, int) and not isinstance(value, bool):
        r.fail(path, f"{expected}, got an integer (in a [...] list, quote 'ip/24,64': YAML splits it at the comma)")
    if not isinstance(value, str):
        r.fail(path, f"{expected}, got {_type_name(value)}")
    if value == "ip" or value.startswith("ip/"):
        return _ip_source(value, path, r)
    if value in REQUEST_SOURCES or value == "global":
        return IdentitySource(kind=value)
    kind, sep, name = value.partition(":")
    if not sep or kind not in IDENTITY_KINDS or not name:
        r.fail(path, f"{expected}, got {value!r}")
    if kind == "header":
        if not _HTTP_TOKEN_RE.match(name):
            r.fail(path, f"{name!r} is not a valid header name")
        name = name.lower()
        if name in UNKEYABLE_HEADERS:
            r.fail(path, f"{name} is not forwarded as the client sent it, so it cannot be an identity (use ip with trusted_proxies)")
    if kind == "jwt" and not _HTTP_TOKEN_RE.match(name):
        r.fail(path, f"{name!r} is not a claim name")
    return IdentitySource(kind=kind, name=name)


def _ip_source(value: str, path: str, r: _Reader) -> IdentitySource:
    """`ip`, `ip/V4` (IPv4 clients grouped by their /V4 network, IPv6 ones by address) or
    `ip/V4,V6` (IPv6 clients by their /V6 network too)."""
    if value == "ip":
        return IdentitySource(kind="ip")
    v4_text, comma, v6_text = value[3:].partition(",")
    prefixes = []
    for text, family, bits in ((v4_text, "IPv4", 32), (v6_text if comma else "128", "IPv6", 128)):
        if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= bits:
            r.fail(path, f"expected ip/PREFIX4 or ip/PREFIX4,PREFIX6 with an {family} prefix from 1 to {bits}, got {value!r}")
        prefixes.append(int(text))
    return IdentitySource(kind="ip", ipv4_prefix=prefixes[0], ipv6_prefix=prefixes[1])


def _allow(doc: Any, path: str, sources: tuple[IdentitySource, ...], r: _Reader) -> Allowlist:
    """`allow: [CIDR or address, SOURCE=VALUE, ...]`: an address is matched against the client's
    (as `ip` reads it), an identity against what the limit's key read."""
    networks = []
    identities = set()
    readable = {str(source): source for source in sources}
    for i, item in enumerate(r.sequence(doc, path)):
        where = f"{path}[{i}]"
        text = r.string(item, where)
        source_text, equals, value = text.partition("=")
        if not equals:
            try:
                networks.append(_network(text))
            except ValueError as exc:
                r.fail(where, f"{exc}; or SOURCE=VALUE for an identity")
            continue
        source = _single_source(source_text, where, r)
        if str(source) not in readable or source.kind == "global":
            keyed = ", ".join(readable)
            r.fail(where, f"this limit's key never reads {source} (it reads {keyed}); an address needs no `ip=`")
        if not value:
            r.fail(where, f"expected {source_text}=VALUE, got {text!r}")
        identities.add(f"{source}={value}")
    if not networks and not identities:
        r.fail(path, "expected at least one address, network or SOURCE=VALUE")
    return Allowlist(networks=tuple(networks), identities=frozenset(identities))


def _network(text: str) -> Any:
    """An address or a network. `10.0.0.1/8` is refused, not read as 10.0.0.0/8: it may
    have meant the one host, and would name sixteen million."""
    try:
        return ipaddress.ip_network(text, strict=True)
    except ValueError as exc:
        if "host bits set" in str(exc):
            raise ValueError(f"{text!r} has host bits set; write the network, as in {ipaddress.ip_network(text, strict=False)}") from None
        raise ValueError(f"expected an address or a network such as 10.0.0.0/8, got {text!r}") from None


def _tiers(doc: Any, path: str, base: Limit, trusted: tuple[Any, ...], r: _Reader) -> Tiers:
    """`tiers: {from: {file: F} or {header: H}, TIER: {rate, burst}, ...}`; the limit's own rate
    and burst are the default tier's."""
    if not isinstance(doc, dict):
        r.fail(path, f"expected a mapping, got {_type_name(doc)}")
    spec = r.mapping(doc, path, required=("from",), optional=tuple(k for k in doc if k != "from"))
    limits = {}
    for name, tier_doc in spec.items():
        if name == "from":
            continue
        where = _join(path, str(name))
        if not isinstance(name, str) or not _LIMIT_NAME_RE.match(name):
            r.fail(where, "tier names may use letters, digits, '_', '-' and '.' only")
        if name == "default":
            r.fail(where, "the limit's own rate and burst are the default tier; name this tier otherwise")
        tier_spec = r.mapping(tier_doc, where, required=("rate",), optional=("burst",))
        rate, burst = _rate_and_burst(tier_spec, where, r)
        # `/` is no limit name character, so LIMIT/TIER is no other limit's bucket.
        limits[name] = dataclasses.replace(base, name=f"{base.name}/{name}", rate=rate, burst=burst)
    if not limits:
        r.fail(path, "expected at least one tier beside `from`")
    origin = r.mapping(spec["from"], f"{path}.from", optional=("file", "header"))
    if len(origin) != 1:
        r.fail(f"{path}.from", "expected exactly one of file (API keys by tier) or header (set by a trusted proxy)")
    if "header" in origin:
        header = r.string(origin["header"], f"{path}.from.header")
        if not _HTTP_TOKEN_RE.match(header):
            r.fail(f"{path}.from.header", f"{header!r} is not a valid header name")
        if header.lower() in UNKEYABLE_HEADERS:
            r.fail(f"{path}.from.header", f"{header.lower()} is the gateway's or one hop's own; it names no tier")
        if not trusted:
            r.fail(
                f"{path}.from.header",
                "a tier header is believed only from trusted_proxies, and none are listed, so it would never be read",
            )
        return Tiers(limits=limits, header=header.lower())
    file = r.string(origin["file"], f"{path}.from.file")
    return Tiers(limits=limits, file=file, members=_tier_members(file, f"{path}.from.file", limits, r))


def _tier_members(file: str, path: str, limits: Mapping[str, Limit], r: _Reader) -> dict[str, str]:
    """The key file: `TIER: [KEY, sha256:HEX, ...]`, each key's sha256 hex -> its tier."""
    try:
        with open(file, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as exc:
        r.fail(path, f"cannot read {file!r}: {exc.strerror}")
    except UnicodeDecodeError:
        r.fail(path, f"cannot read {file!r}: not UTF-8 text")
    try:
        document = safe_yaml.load(text)
    except yaml.YAMLError as exc:
        r.fail(path, f"{file}: malformed YAML: {getattr(exc, 'problem', None) or str(exc).splitlines()[0]}")
    inner = _Reader(f"{r.source}: {path}: {file}")
    spec = inner.mapping(document or {}, "", optional=tuple(limits))
    members: dict[str, str] = {}
    for tier, keys in spec.items():
        for i, key in enumerate(inner.sequence(keys, tier)):
            where = f"{tier}[{i}]"
            text = inner.string(key, where)
            hashed = _SHA256_RE.match(text)
            if text.startswith("sha256:") and not hashed:
                inner.fail(where, "expected sha256: and the key's 64 hex digits, as `sha256sum` prints them")
            digest = hashed.group(1).lower() if hashed else hashlib.sha256(text.encode()).hexdigest()
            if digest in members:
                inner.fail(where, f"this key is already in tier {members[digest]!r}")
            members[digest] = tier
    return members


def _client_ip(doc: Any, trusted: tuple[Any, ...], r: _Reader) -> ClientIpStrategy:
    spec = r.mapping(doc, "client_ip", optional=("header", "depth"))
    if not trusted:
        r.fail("client_ip", "the client's address is read from a header only when a trusted proxy sent it; list trusted_proxies")
    text = spec.get("header", ClientIpHeader.X_FORWARDED_FOR.value)
    header = _choice(ClientIpHeader, text.lower() if isinstance(text, str) else text, "client_ip.header", r)
    depth = r.integer(spec["depth"], "client_ip.depth", minimum=1) if "depth" in spec else None
    if depth is not None and header is ClientIpHeader.X_REAL_IP:
        r.fail("client_ip.depth", "X-Real-IP holds one address; depth applies to X-Forwarded-For and Forwarded")
    return ClientIpStrategy(header=header, depth=depth)


def _route(
    doc: Any, path: str, limits: Mapping[str, Limit | ConcurrencyLimit], targets: _SharedTargets, r: _Reader
) -> Route:
    spec = r.mapping(
        doc,
        path,
        required=("match", "upstream"),
        optional=(
            "limits",
            "strip_prefix",
            "preserve_host",
            "allow_path_parameters",
            "timeout",
            "max_body_size",
            "request_headers",
            "response_headers",
        ),
    )
    match = _match(spec["match"], f"{path}.match", r)
    strip_prefix = r.boolean(spec.get("strip_prefix", False), f"{path}.strip_prefix")
    if strip_prefix and match.form is not PathForm.PREFIX:
        r.fail(f"{path}.strip_prefix", f"needs a prefix to strip: match.path, not match.{match.form.value}")
    if isinstance(spec["upstream"], dict):
        upstream: str | UpstreamPool = _pool(spec["upstream"], f"{path}.upstream", targets, r)
    elif isinstance(spec["upstream"], list):
        r.fail(f"{path}.upstream", "expected a URL, or a pool as {targets: [URL, ...]}, got a list")
    else:
        upstream = _upstream_url(spec["upstream"], f"{path}.upstream", r)
    listed = [
        _route_limit(item, f"{path}.limits[{i}]", limits, r)
        for i, item in enumerate(r.sequence(spec.get("limits", []), f"{path}.limits"))
    ]
    route_limits = [entry for entry in listed if isinstance(entry, RouteLimit)]
    concurrency = tuple(entry for entry in listed if isinstance(entry, ConcurrencyLimit))
    names = [entry.name if isinstance(entry, ConcurrencyLimit) else entry.limit.name for entry in listed]
    if len(set(names)) != len(names):
        r.fail(f"{path}.limits", "a limit may appear only once per route")
    preserve_host = r.boolean(spec.get("preserve_host", False), f"{path}.preserve_host")
    for i, entry in enumerate(listed):
        limit = entry if isinstance(entry, ConcurrencyLimit) else entry.limit
        if not preserve_host and any(leaf.kind == "header" and leaf.name == "host" for s in limit.key for leaf in s.leaves):
            # The upstream would be charged one client and see another.
            r.fail(
                f"{path}.limits[{i}]",
                f"limit {limit.name!r} reads header:Host, which this route replaces with the upstream's host; "
                "set preserve_host: true",
            )
    request_headers = _header_rules(
        spec.get("request_headers", {}), f"{path}.request_headers", _UNREWRITABLE_REQUEST_HEADERS, r
    )
    rewritten = set(request_headers.remove) | {name.lower() for name, _ in request_headers.set + request_headers.add}
    for i, rl in enumerate(route_limits):
        for source in rl.limit.key:
            read = {"header": source.name, "cookie": "cookie", "jwt": "authorization"}.get(source.kind)
            if read in rewritten:
                # The limit would charge the client by one value and the upstream see another.
                r.fail(
                    f"{path}.request_headers",
                    f"rewrites {read}, which limit {rl.limit.name!r} (limits[{i}]) reads as its identity",
                )
    timeout_doc = r.mapping(spec.get("timeout", {}), f"{path}.timeout", optional=("connect", "read", "queue", "total"))
    timeout = UpstreamTimeout(
        connect=r.parsed(parse_duration, timeout_doc.get("connect", DEFAULT_CONNECT_TIMEOUT), f"{path}.timeout.connect"),
        read=r.parsed(parse_duration, timeout_doc.get("read", DEFAULT_READ_TIMEOUT), f"{path}.timeout.read"),
        queue=r.parsed(parse_duration, timeout_doc.get("queue", DEFAULT_QUEUE_TIMEOUT), f"{path}.timeout.queue"),
        total=(
            r.parsed(parse_duration, timeout_doc["total"], f"{path}.timeout.total") if "total" in timeout_doc else None
        ),
    )
    max_body_size = spec.get("max_body_size")
    return Route(
        match=match,
        upstream=upstream,
        limits=tuple(route_limits),
        strip_prefix=strip_prefix,
        preserve_host=preserve_host,
        timeout=timeout,
        allow_path_parameters=r.boolean(spec.get("allow_path_parameters", False), f"{path}.allow_path_parameters"),
        max_body_size=r.parsed(parse_size, max_body_size, f"{path}.max_body_size") if max_body_size is not None else None,
        concurrency=concurrency,
        request_headers=request_headers,
        response_headers=_header_rules(
            spec.get("response_headers", {}), f"{path}.response_headers", _UNREWRITABLE_RESPONSE_HEADERS, r
        ),
    )


def _split_url(url: str, path: str, r: _Reader, *, shown: str | None = None) -> SplitResult:
    """urlsplit, with its ValueError (an unclosed `[`, or a bracketed host that is no IPv6
    address) made a config error."""
    try:
        return urlsplit(url)
    except ValueError as exc:
        r.fail(path, f"not a URL ({exc}): {shown or url!r}")


def _upstream_url(value: Any, path: str, r: _Reader) -> str:
    """An upstream base URL, without its trailing slash."""
    url = r.string(value, path)
    shown = redacted_url(url)  # every message below shows this, never the password
    parts = _split_url(url, path, r, shown=shown)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        r.fail(path, f"expected an http:// or https:// URL with a host and no query, got {shown!r}")
    try:
        _ = parts.port  # raises ValueError on a bad port
    except ValueError:
        r.fail(path, f"bad port in {shown!r}")
    return url.rstrip("/")


class _SharedTargets:
    """The targets seen so far in any route's pool. A target's health, ejection and load are
    shared by every route that names it (gateway.proxy.upstream_pool), so a URL has one name,
    one set of health and passive settings, and a name one URL: metrics stay unambiguous."""

    def __init__(self) -> None:
        self._by_url: dict[str, tuple[str, Target, UpstreamPool]] = {}
        self._url_of: dict[str, tuple[str, str]] = {}  # name -> (url, YAML path)

    def add(self, target: Target, pool: UpstreamPool, path: str, r: _Reader) -> None:
        seen = self._by_url.get(target.url)
        if seen is not None:
            where, other, other_pool = seen
            if other.name != target.name:
                r.fail(path, f"{target.url} is named {other.name!r} at {where}; a target has one name")
            if (other_pool.health, other_pool.passive) != (pool.health, pool.passive):
                r.fail(
                    path,
                    f"{target.url} has other health or passive settings at {where}; every route naming a target "
                    "shares its state, so they must match (a YAML anchor, &pool, shares one pool)",
                )
            return
        named = self._url_of.get(target.name)
        if named is not None:
            r.fail(path, f"name {target.name!r} is already {named[0]} at {named[1]}; each target needs its own name")
        self._by_url[target.url] = (path, target, pool)
        self._url_of[target.name] = (target.url, path)


def _pool(doc: Mapping[str, Any], path: str, shared: _SharedTargets, r: _Reader) -> UpstreamPool:
    spec = r.mapping(doc, path, required=("targets",), optional=("balance", "health", "passive", "retries"))
    items = r.sequence(spec["targets"], f"{path}.targets")
    if not items:
        r.fail(f"{path}.targets", "expected at least one target")
    targets = tuple(_target(item, f"{path}.targets[{i}]", r) for i, item in enumerate(items))
    for i, target in enumerate(targets):
        if any(t.url == target.url for t in targets[:i]):
            r.fail(f"{path}.targets[{i}]", f"{target.url} is listed twice; give it a weight instead")
    balance = _choice(Balance, spec.get("balance", Balance.ROUND_ROBIN.value), f"{path}.balance", r)
    passive_doc = spec.get("passive", {})
    pool = UpstreamPool(
        targets=targets,
        balance=balance,
        health=_health(spec["health"], f"{path}.health", r) if "health" in spec else None,
        # YAML 1.1 reads a bare `off` as false: both turn passive ejection off.
        passive=None if passive_doc is False or passive_doc == "off" else _passive(passive_doc, f"{path}.passive", r),
        retries=r.integer(spec.get("retries", DEFAULT_RETRIES), f"{path}.retries", minimum=0),
    )
    for i, target in enumerate(targets):
        shared.add(target, pool, f"{path}.targets[{i}]", r)
    return pool


def _target(item: Any, path: str, r: _Reader) -> Target:
    if not isinstance(item, dict):
        url = _upstream_url(item, path, r)
        return Target(url=url, name=_address(url))
    spec = r.mapping(item, path, required=("url",), optional=("weight", "name"))
    url = _upstream_url(spec["url"], f"{path}.url", r)
    name = spec.get("name", _address(url))
    if not isinstance(name, str) or not _TARGET_NAME_RE.match(name):
        r.fail(f"{path}.name", f"target names may use letters, digits and '_.:-[]' only, got {name!r}")
    return Target(url=url, name=name, weight=r.integer(spec.get("weight", 1), f"{path}.weight", minimum=1))


def _address(url: str) -> str:
    """A target's default name: its host and port, as `10.0.0.5:9000` (the port its scheme implies if none)."""
    parts = urlsplit(url)
    host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
    return f"{host}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


def _health(doc: Any, path: str, r: _Reader) -> HealthCheck:
    spec = r.mapping(
        doc, path, required=("path",), optional=("interval", "timeout", "unhealthy_after", "healthy_after")
    )
    check_path = r.string(spec["path"], f"{path}.path")
    if not _HEALTH_PATH_RE.match(check_path):
        r.fail(
            f"{path}.path", f"expected a path starting with / without spaces or control characters, got {check_path!r}"
        )
    health = HealthCheck(
        path=check_path,
        interval=r.parsed(parse_duration, spec.get("interval", DEFAULT_HEALTH_INTERVAL), f"{path}.interval"),
        timeout=r.parsed(parse_duration, spec.get("timeout", DEFAULT_HEALTH_TIMEOUT), f"{path}.timeout"),
        unhealthy_after=r.integer(
            spec.get("unhealthy_after", DEFAULT_UNHEALTHY_AFTER), f"{path}.unhealthy_after", minimum=1
        ),
        healthy_after=r.integer(spec.get("healthy_after", DEFAULT_HEALTHY_AFTER), f"{path}.healthy_after", minimum=1),
    )
    if health.timeout > health.interval:
        r.fail(
            f"{path}.timeout",
            f"a check's timeout ({health.timeout:g}s) may not exceed its interval ({health.interval:g}s)",
        )
    return health


def _passive(doc: Any, path: str, r: _Reader) -> PassiveEjection:
    spec = r.mapping(doc, path, optional=("eject_after", "eject_for"))
    return PassiveEjection(
        eject_after=r.integer(spec.get("eject_after", DEFAULT_EJECT_AFTER), f"{path}.eject_after", minimum=1),
        eject_for=r.parsed(parse_duration, spec.get("eject_for", DEFAULT_EJECT_FOR), f"{path}.eject_for"),
    )


def _match(doc: Any, path: str, r: _Reader) -> Match:
    spec = r.mapping(
        doc, path, optional=("path", "exact", "regex", "methods", "host", "case_sensitive", "headers", "query")
    )
    forms = [form for form in PathForm if form.value in spec]
    if len(forms) != 1:
        r.fail(path, "expected exactly one of path (a prefix), exact or regex")
    form = forms[0]
    where = f"{path}.{form.value}"
    written = r.string(spec[form.value], where)
    case_sensitive = r.boolean(spec.get("case_sensitive", True), f"{path}.case_sensitive")
    regex = None
    if form is PathForm.REGEX:
        regex = r.parsed(lambda text: Regex.compile(text, case_sensitive=case_sensitive), written, where)
    else:
        error = _route_path_error(written)
        if error is not None:
            r.fail(where, f"{error}, got {written!r}")
        if form is PathForm.PREFIX:
            written = written.rstrip("/") or "/"
    methods = None
    if "methods" in spec:
        items = r.sequence(spec["methods"], f"{path}.methods")
        for i, method in enumerate(items):
            if not isinstance(method, str) or not _HTTP_TOKEN_RE.match(method):
                r.fail(f"{path}.methods[{i}]", f"expected an HTTP method such as GET, got {method!r}")
            if method.upper() == "CONNECT":
                r.fail(f"{path}.methods[{i}]", "CONNECT is never routed: the gateway is a reverse proxy, not a tunnel")
            if method.upper() not in ROUTABLE_METHODS:
                r.fail(f"{path}.methods[{i}]", f"{method!r} is not a registered HTTP method (IANA), such as GET or POST")
        if not items:
            r.fail(f"{path}.methods", "an empty list matches no request; leave methods out to match every method")
        methods = frozenset(m.upper() for m in items)
    host = r.string(spec["host"], f"{path}.host").lower().rstrip(".") if "host" in spec else None
    if host is not None and not _HOST_RE.match(host.removeprefix(_WILDCARD_HOST_PREFIX)):
        r.fail(
            f"{path}.host",
            f"expected a host name without a port, such as api.example.com or *.example.com, got {spec['host']!r}",
        )
    return Match(
        path=written,
        form=form,
        regex=regex,
        methods=methods,
        host=host,
        case_sensitive=case_sensitive,
        headers=_value_matches(spec.get("headers", {}), f"{path}.headers", "header", r),
        query=_value_matches(spec.get("query", {}), f"{path}.query", "query parameter", r),
    )


def _value_matches(doc: Any, path: str, kind: str, r: _Reader) -> tuple[ValueMatch, ...]:
    """`{NAME: "v"}` (exactly v), `{NAME: {present: true|false}}`, `{NAME: {exact: "v"}}` or
    `{NAME: {regex: "..."}}`, for each header (names compared case-insensitively) or query parameter."""
    if not isinstance(doc, dict):
        r.fail(path, f"expected a mapping of {kind} names, got {_type_name(doc)}")
    matches: dict[str, ValueMatch] = {}
    for name, value in doc.items():
        where = _join(path, str(name))
        if not isinstance(name, str) or not name or (kind == "header" and not _HTTP_TOKEN_RE.match(name)):
            r.fail(where, f"{name!r} is not a valid {kind} name")
        key = name.lower() if kind == "header" else name
        if key in matches:
            r.fail(where, f"{kind} {name!r} is given twice (header names ignore case)")
        if isinstance(value, str):
            matches[key] = ValueMatch(name=key, exact=value)
            continue
        if not isinstance(value, dict):
            r.fail(
                where,
                "expected a string (the exact value) or {present: true|false}, {exact: ...} or {regex: ...}, "
                f"got {_type_name(value)}",
            )
        form = r.mapping(value, where, optional=("present", "exact", "regex"))
        if len(form) != 1:
            r.fail(where, "expected exactly one of present, exact or regex")
        if "present" in form:
            matches[key] = ValueMatch(name=key, present=r.boolean(form["present"], f"{where}.present"))
        elif "exact" in form:
            exact = form["exact"]
            if not isinstance(exact, str):
                r.fail(f"{where}.exact", f"expected a string (quote numbers: \"2\"), got {_type_name(exact)}")
            matches[key] = ValueMatch(name=key, exact=exact)
        else:
            pattern = r.string(form["regex"], f"{where}.regex")
            matches[key] = ValueMatch(name=key, regex=r.parsed(Regex.compile, pattern, f"{where}.regex"))
    return tuple(matches.values())


def _header_rules(doc: Any, path: str, unrewritable: frozenset[str], r: _Reader) -> HeaderRules:
    """A route's `request_headers` or `response_headers`: `set` and `add` map names to values,
    `remove` lists names; a name may appear in only one of them."""
    spec = r.mapping(doc, path, optional=("set", "add", "remove"))
    seen: set[str] = set()

    def name_at(name: Any, where: str) -> str:
        if not isinstance(name, str) or not _HTTP_TOKEN_RE.match(name):
            r.fail(where, f"{name!r} is not a valid header name")
        lower = name.lower()
        if lower in unrewritable:
            r.fail(
                where,
                f"{name} is the gateway's to write (hop-by-hop, framing, forwarding, request id or rate-limit fields); "
                "a route may not rewrite it",
            )
        if lower in seen:
            r.fail(where, f"{name} is named more than once in set, add and remove (header names ignore case)")
        seen.add(lower)
        return lower

    def pairs(key: str) -> tuple[tuple[str, str], ...]:
        items = spec.get(key, {})
        if not isinstance(items, dict):
            r.fail(f"{path}.{key}", f"expected a mapping of header names to values, got {_type_name(items)}")
        out = []
        for name, value in items.items():
            where = _join(f"{path}.{key}", str(name))
            name_at(name, where)
            if not isinstance(value, str):
                r.fail(where, f"expected a string (quote numbers: \"2\"), got {_type_name(value)}")
            if not _HEADER_VALUE_RE.fullmatch(value):
                r.fail(where, f"a header value may hold visible ASCII, with spaces and tabs inside only; {_misfit(value)}")
            out.append((name, value))
        return tuple(out)

    rules_set, rules_add = pairs("set"), pairs("add")
    removed = r.sequence(spec.get("remove", []), f"{path}.remove")
    remove = tuple(name_at(name, f"{path}.remove[{i}]") for i, name in enumerate(removed))
    return HeaderRules(set=rules_set, add=rules_add, remove=remove)


def _route_path_error(path: str) -> str | None:
    """Why a route's `match.path` could never match a request path as gateway.proxy.paths
    reads it, or None if it can. It is written decoded, as the upstream's own routes are
    (`/files/my docs`, not `my%20docs`), and none of these survive into a decoded path."""
    if path.startswith(("^", "~")):
        return "a path is a literal prefix; nginx's `~` and a leading `^` are regex syntax: write match.regex"
    if not path.startswith("/"):
        return "expected a path starting with /"
    foreign = _foreign_path_syntax(path)
    if foreign is not None:
        return foreign
    if _NOT_IN_ROUTE_PATH.search(path):
        return "write the path decoded, without %, ;, ?, #, \\ or control characters"
    for segment in path.rstrip("/").split("/")[1:]:
        if segment in ("", ".", ".."):
            return "expected a path without empty, '.' or '..' segments"
        if segment != segment.strip(" "):
            return "a segment may not begin or end with a space"
    return None


def _foreign_path_syntax(path: str) -> str | None:
    """The pattern syntax of other gateways and frameworks, which a literal path would
    match only as written (`/static/*` matches no path but `/static/*` itself)."""
    segments = path.rstrip("/").split("/")[1:]
    # A glob as users write one: `*`, `**`, `api*`, `*.js`; a `*` inside a segment is a sub-delim.
    starred = next((i for i, seg in enumerate(segments) if seg.endswith("*") or seg.startswith("*.")), None)
    if starred is not None:
        prefix = "/" + "/".join(segments[:starred])
        return (
            f"a path is a prefix on whole segments and * is no wildcard: `path: {prefix}` already matches "
            f"{prefix} and everything under it; for a pattern write match.regex"
        )
    if any(segment.startswith(":") or (segment.startswith("{") and segment.endswith("}")) for segment in segments):
        return (
            "a segment such as :id or {id} is a parameter in Express, OpenAPI or Kong, but a literal here: "
            "match the prefix before it, or write match.regex, such as '/users/[^/]+'"
        )
    if path.endswith("$"):
        return "a trailing $ is regex syntax: for this path alone write match.exact, for a pattern match.regex"
    return None


def _route_limit(
    item: Any, path: str, limits: Mapping[str, Limit | ConcurrencyLimit], r: _Reader
) -> RouteLimit | ConcurrencyLimit:
    if isinstance(item, str):
        name, cost, name_path = item, 1, path
    elif not isinstance(item, dict):
        r.fail(path, f"expected a limit name or {{name: NAME, cost: N}}, got {_type_name(item)}")
    else:
        spec = r.mapping(item, path, required=("name",), optional=("cost",))
        name, name_path = r.string(spec["name"], f"{path}.name"), f"{path}.name"
        cost = r.integer(spec.get("cost", 1), f"{path}.cost", minimum=0)
    if name not in limits:
        defined = ", ".join(limits) or "none"
        r.fail(name_path, f"no limit named {name!r} is defined under `limits` (defined: {defined})")
    limit = limits[name]
    if isinstance(limit, ConcurrencyLimit):
        if cost != 1:
            r.fail(f"{path}.cost", f"limit {name!r} counts requests in flight, one each; a cost does not apply")
        return limit
    if cost > limit.burst:
        r.fail(f"{path}.cost", f"cost {cost} is greater than the burst {limit.burst:g} of limit {name!r}; it could never pass")
    for tier in limit.tiers.limits.values() if limit.tiers else ():
        if cost > tier.burst:
            r.fail(
                f"{path}.cost",
                f"cost {cost} is greater than the burst {tier.burst:g} of tier {tier.name!r}; its clients could never pass",
            )
    return RouteLimit(limit=limit, cost=cost)


def _shown_integer(value: int) -> str:
    """`value` for an error line, its digits grouped; past 40 digits not its digits, so the
    line stays readable (and int-to-str's 4300-digit limit is never reached)."""
    return f"{value:,}" if abs(value) < 10**40 else f"{'-' if value < 0 else ''}a number past 10**40"


def _join(path: str, key: str) -> str:
    if not key or key != key.strip() or any(c in key for c in ".:[]'"):
        key = repr(key)  # a key that would read as part of the path, or as none
    return f"{path}.{key}" if path else key


def _type_name(value: Any) -> str:
    names = {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "an integer", float: "a number"}
    if value is None:
        return "nothing (null)"
    return names.get(type(value), type(value).__name__)
