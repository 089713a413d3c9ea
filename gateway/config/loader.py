"""Read the YAML file once and turn it into `GatewayConfig`, or fail with one clear line.

Trusts nothing in the file or the environment: every key is checked against
what it may hold, unknown keys are rejected, and each error names the file and
the YAML path (such as `routes[1].limits[0].name`) and what was expected.
"""

from __future__ import annotations

import enum
import ipaddress
import os
import re
from collections.abc import Callable, Mapping
from typing import Any, NoReturn
from urllib.parse import parse_qsl, urlsplit

import yaml

from gateway.config import jwt_keys, tls
from gateway.config.model import (
    ClientLimits,
    DotSegments,
    EscapedSlashes,
    FailurePolicy,
    ForwardedHeaders,
    GatewayConfig,
    IdentitySource,
    JwtConfig,
    JwtFailure,
    Limit,
    ListenTls,
    Match,
    PathNormalization,
    Route,
    RouteLimit,
    StoreConfig,
    UpstreamTimeout,
)
from gateway.config.units import (
    REDIS_PORT,
    SENTINEL_PORT,
    Address,
    parse_address,
    parse_duration,
    parse_rate,
    parse_size,
    split_hosts,
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
STORE_SCHEMES = ("redis", "rediss", "unix", "redis+sentinel", "redis+cluster")
IDENTITY_KINDS = ("header", "query", "cookie", "jwt")
# Headers an identity may not be read from: hop-by-hop fields never reach the upstream, and
# the forwarding headers are the gateway's to write (`ip` with trusted_proxies reads them).
UNKEYABLE_HEADERS = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"}
    | {"x-forwarded-for", "x-forwarded-proto", "x-forwarded-host", "forwarded"}
)
_INTERPOLATION_RE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_LIMIT_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")
_HOST_RE = re.compile(r"^(?:[a-z0-9](?:[a-z0-9\-]*[a-z0-9])?\.)*[a-z0-9](?:[a-z0-9\-]*[a-z0-9])?$|^\[[0-9a-f:.]+\]$")
_HTTP_TOKEN_RE = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_NOT_IN_ROUTE_PATH = re.compile(r"[%;?#\\\x00-\x1f\x7f]")


def redacted_url(url: str) -> str:
    """`url` with its userinfo's secret replaced by `***`, for error messages and logs.

    The userinfo is everything between `://` and the last `@`, as a person wrote it: a
    password holding an unencoded `#`, `/` or `?` ends urlsplit's netloc early, so
    urlsplit would show the password's tail as a path or fragment. Before a `:`, the user
    name stays; with no `:` the whole userinfo goes, since `redis://password@host` puts a
    password where the user name goes. An `@` in the path or query is redacted too: it is
    rare, and showing too little is the safe side."""
    scheme, sep, rest = url.partition("://")
    at = rest.rfind("@")
    if not sep or at < 0:
        return url if "@" not in url else "***" + url[url.rfind("@"):]
    user, colon, _ = rest[:at].partition(":")
    return f"{scheme}://{user + ':***' if colon else '***'}@{rest[at + 1:]}"


class ConfigError(Exception):
    """An invalid config file; str() is the one line shown to the user. Characters that are
    not printable (a key holding a newline, a value with a control character) are escaped
    as Python writes them, so the message stays one line and writes nothing to a terminal."""

    def __init__(self, message: str) -> None:
        if not message.isprintable():
            message = "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)
        super().__init__(message)


class _SafeLoaderRejectingDuplicates(yaml.SafeLoader):
    """yaml.safe_load's loader, except that a key given twice in one mapping is an
    error: plain YAML keeps the last one silently, so a second `per_client` under
    `limits` would replace the first without a word."""

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *anchor` may be overridden by the keys beside it
                key = self.construct_object(key_node, deep=deep)
                try:
                    duplicate = key in seen
                    seen.add(key)
                except TypeError:
                    continue  # unhashable: the base class reports it
                if duplicate:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark, f"duplicate key {key!r}", key_node.start_mark
                    )
        return super().construct_mapping(node, deep=deep)


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

    def integer(self, value: Any, path: str, *, minimum: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(path, f"expected an integer, got {_type_name(value)}")
        if value < minimum:
            self.fail(path, f"expected an integer >= {minimum}, got {value}")
        return value

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
        # safe_load, plus rejecting duplicate keys: plain data only, never Python objects.
        document = yaml.load(text, Loader=_SafeLoaderRejectingDuplicates)
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
            scalar = yaml.safe_load(result) if result else result
        except yaml.YAMLError:
            return result
        if isinstance(scalar, (int, float, bool)) or scalar is None:
            return scalar
    return result


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
            "admin_raw_identities",
            "client_header_timeout", "client_body_timeout", "keepalive_timeout", "keepalive_requests",
            "max_header_size", "upstream_connections",
        ),
    )
    listen, listen_tls = _listen(top.get("listen", DEFAULT_LISTEN), r)
    admin_listen = r.parsed(parse_address, top.get("admin_listen", DEFAULT_ADMIN_LISTEN), "admin_listen")
    workers = r.integer(top.get("workers", 1), "workers", minimum=1)
    max_in_flight = r.integer(top.get("max_in_flight", DEFAULT_MAX_IN_FLIGHT), "max_in_flight", minimum=1)
    store = _store(top["store"], r) if top.get("store") is not None else None
    if workers > 1 and store is None:
        r.fail(
            "workers",
            f"workers: {workers} needs a shared store; with the in-process store each worker "
            f"would count separately and clients would get {workers} times the limit",
        )
    for key, address in (("listen", listen), ("admin_listen", admin_listen)):
        if workers > 1 and address.port == 0:
            r.fail(key, f"port 0 needs workers: 1; with workers: {workers} each worker would get a different port")
    trusted = tuple(
        r.parsed(lambda v: ipaddress.ip_network(str(v), strict=False), item, f"trusted_proxies[{i}]")
        for i, item in enumerate(r.sequence(top.get("trusted_proxies", []), "trusted_proxies"))
    )
    forwarded_text = top.get("forwarded_headers", ForwardedHeaders.REPLACE.value)
    try:
        forwarded_headers = ForwardedHeaders(forwarded_text)
    except ValueError:
        r.fail("forwarded_headers", f"expected replace or append, got {forwarded_text!r}")
    jwt_config = _jwt(top["jwt"], r, environ) if top.get("jwt") is not None else None
    limits_doc = top.get("limits") or {}
    limits = {
        name: _limit(name, spec, f"limits.{name}", r)
        for name, spec in r.mapping(limits_doc, "limits", optional=tuple(limits_doc) if isinstance(limits_doc, dict) else ()).items()
    }
    jwt_sources = [
        (name, i) for name, limit in limits.items() for i, source in enumerate(limit.key) if source.kind == "jwt"
    ]
    if jwt_sources and jwt_config is None:
        name, i = jwt_sources[0]
        r.fail(f"limits.{name}.key[{i}]", "a jwt:CLAIM source needs a top-level `jwt` block with the keys that verify tokens")
    if jwt_config is not None and not jwt_sources:
        r.fail("jwt", "no limit's `key` has a jwt:CLAIM source, so these keys would verify nothing")
    routes_doc = r.sequence(top["routes"], "routes")
    if not routes_doc:
        r.fail("routes", "expected at least one route")
    routes = tuple(_route(item, f"routes[{i}]", limits, r) for i, item in enumerate(routes_doc))
    return GatewayConfig(
        source=r.source,
        listen=listen,
        admin_listen=admin_listen,
        workers=workers,
        max_in_flight=max_in_flight,
        store=store,
        trusted_proxies=trusted,
        limits=tuple(limits.values()),
        routes=routes,
        shutdown_grace=r.parsed(parse_duration, top.get("shutdown_grace", DEFAULT_SHUTDOWN_GRACE), "shutdown_grace"),
        forwarded_headers=forwarded_headers,
        jwt=jwt_config,
        path_normalization=_path_normalization(top.get("path_normalization", {}), r),
        listen_tls=listen_tls,
        admin_token=_admin_token(top.get("admin_token_env"), r, environ),
        admin_raw_identities=r.boolean(top.get("admin_raw_identities", False), "admin_raw_identities"),
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
    except OSError as exc:
        r.fail("listen.tls", f"cannot load the certificate and key: {exc.strerror or exc}")
    return address, listen_tls


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
        r.fail(path, f"expected {' or '.join(member.value for member in kind)}, got {value!r}")


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
    shown = redacted_url(url)  # every message below shows this, never the password
    userinfo = url.partition("://")[2].rpartition("@")[0]
    if any(c in userinfo for c in "/?#"):
        r.fail(
            "store.url",
            f"the user name or password holds /, ? or #, which end the host part of a URL; "
            f"percent-encode them (%2F, %3F, %23), got {shown!r}",
        )
    parts = urlsplit(url)
    if parts.scheme not in STORE_SCHEMES:
        r.fail("store.url", f"expected a URL with scheme {', '.join(s + '://' for s in STORE_SCHEMES)}, got {shown!r}")
    if parts.scheme == "unix":
        if not parts.path:
            r.fail("store.url", f"expected unix:///path/to/redis.sock, got {shown!r}")
        allowed_query = {"db"}
    elif parts.scheme == "redis+sentinel":
        example = "redis+sentinel://host:26379,host:26380/mymaster"
        try:
            split_hosts(parts.netloc, default_port=SENTINEL_PORT)
        except ValueError as exc:
            r.fail("store.url", f"expected sentinels as in {example}: {exc}")
        service = parts.path.strip("/")
        if not service or "/" in service:
            r.fail("store.url", f"expected the monitored master's name as the path, as in {example}, got {parts.path!r}")
        allowed_query = {"db"}
    elif parts.scheme == "redis+cluster":
        example = "redis+cluster://host:7000,host:7001"
        try:
            split_hosts(parts.netloc, default_port=REDIS_PORT)
        except ValueError as exc:
            r.fail("store.url", f"expected seed nodes as in {example}: {exc}")
        if parts.path.strip("/"):
            r.fail("store.url", f"a Redis Cluster has only database 0; expected no path, as in {example}, got {parts.path!r}")
        allowed_query = set()
    else:
        if not parts.hostname:
            r.fail("store.url", f"expected a host, as in redis://127.0.0.1:6379/0, got {shown!r}")
        try:
            _ = parts.port  # raises ValueError on a bad port
        except ValueError:
            r.fail("store.url", f"bad port in {shown!r}")
        db = parts.path.lstrip("/")
        if db and not db.isdigit():
            r.fail("store.url", f"expected a database number as the path, as in /0, got {parts.path!r}")
        allowed_query = set()
    for option, _ in parse_qsl(parts.query, keep_blank_values=True):
        if option not in allowed_query:
            r.fail("store.url", f"URL option {option!r} is not supported; set it as a key under `store`")
    prefix = spec.get("prefix", DEFAULT_STORE_PREFIX)
    if not isinstance(prefix, str):
        r.fail("store.prefix", f"expected a string, got {_type_name(prefix)}")
    if "{" in prefix or "}" in prefix:
        r.fail("store.prefix", "must not contain { or }, which Redis Cluster reads as a hash tag")
    secret = spec.get("key_secret")
    ca_file = spec.get("tls_ca_file")
    if ca_file is not None:
        ca_file = r.string(ca_file, "store.tls_ca_file")
        if parts.scheme != "rediss":
            r.fail("store.tls_ca_file", "only applies to a rediss:// (TLS) store URL")
        if not os.path.isfile(ca_file):
            r.fail("store.tls_ca_file", f"no such file: {ca_file!r}")
    return StoreConfig(
        url=url,
        timeout=r.parsed(parse_duration, spec.get("timeout", DEFAULT_STORE_TIMEOUT), "store.timeout"),
        prefix=prefix,
        local_divisor=r.integer(spec.get("local_divisor", 1), "store.local_divisor", minimum=1),
        max_pending=r.integer(spec.get("max_pending", DEFAULT_STORE_MAX_PENDING), "store.max_pending", minimum=1),
        key_secret=r.string(secret, "store.key_secret") if secret is not None else None,
        tls_ca_file=ca_file,
        required=r.boolean(spec.get("required", False), "store.required"),
    )


def _limit(name: Any, doc: Any, path: str, r: _Reader) -> Limit:
    if not isinstance(name, str) or not _LIMIT_NAME_RE.match(name):
        r.fail(path, "limit names may use letters, digits, '_', '-' and '.' only")
    spec = r.mapping(doc, path, required=("rate",), optional=("burst", "key", "on_store_error", "shadow"))
    rate = r.parsed(parse_rate, spec["rate"], f"{path}.rate")
    if "burst" in spec:
        burst = r.integer(spec["burst"], f"{path}.burst", minimum=1)
    else:
        if rate.tokens != int(rate.tokens) or rate.tokens < 1:
            r.fail(f"{path}.burst", f"required when the rate's count is not a whole number ({rate.text})")
        burst = int(rate.tokens)
    keys = spec.get("key", ["ip"])
    if isinstance(keys, str):
        keys = [keys]
    sources = tuple(_identity(item, f"{path}.key[{i}]", r) for i, item in enumerate(r.sequence(keys, f"{path}.key")))
    if not sources:
        r.fail(f"{path}.key", "expected at least one identity source")
    policy_text = spec.get("on_store_error", FailurePolicy.OPEN.value)
    try:
        policy = FailurePolicy(policy_text)
    except ValueError:
        r.fail(f"{path}.on_store_error", f"expected open, closed or local, got {policy_text!r}")
    shadow = r.boolean(spec.get("shadow", False), f"{path}.shadow")
    return Limit(name=name, rate=rate, burst=burst, key=sources, on_store_error=policy, shadow=shadow)


def _identity(value: Any, path: str, r: _Reader) -> IdentitySource:
    expected = "expected ip, header:NAME, query:NAME, cookie:NAME or jwt:CLAIM"
    if not isinstance(value, str):
        r.fail(path, f"{expected}, got {_type_name(value)}")
    if value == "ip":
        return IdentitySource(kind="ip")
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


def _route(doc: Any, path: str, limits: Mapping[str, Limit], r: _Reader) -> Route:
    spec = r.mapping(
        doc,
        path,
        required=("match", "upstream"),
        optional=("limits", "strip_prefix", "preserve_host", "allow_path_parameters", "timeout", "max_body_size"),
    )
    match = _match(spec["match"], f"{path}.match", r)
    upstream = r.string(spec["upstream"], f"{path}.upstream")
    parts = urlsplit(upstream)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        r.fail(f"{path}.upstream", f"expected an http:// or https:// URL with a host and no query, got {upstream!r}")
    try:
        _ = parts.port  # raises ValueError on a bad port
    except ValueError:
        r.fail(f"{path}.upstream", f"bad port in {upstream!r}")
    route_limits: list[RouteLimit] = []
    for i, item in enumerate(r.sequence(spec.get("limits", []), f"{path}.limits")):
        route_limits.append(_route_limit(item, f"{path}.limits[{i}]", limits, r))
    names = [rl.limit.name for rl in route_limits]
    if len(set(names)) != len(names):
        r.fail(f"{path}.limits", "a limit may appear only once per route")
    preserve_host = r.boolean(spec.get("preserve_host", False), f"{path}.preserve_host")
    for i, rl in enumerate(route_limits):
        if not preserve_host and any(s.kind == "header" and s.name == "host" for s in rl.limit.key):
            # The upstream would be charged one client and see another.
            r.fail(
                f"{path}.limits[{i}]",
                f"limit {rl.limit.name!r} reads header:Host, which this route replaces with the upstream's host; "
                "set preserve_host: true",
            )
    timeout_doc = r.mapping(spec.get("timeout", {}), f"{path}.timeout", optional=("connect", "read", "queue"))
    timeout = UpstreamTimeout(
        connect=r.parsed(parse_duration, timeout_doc.get("connect", DEFAULT_CONNECT_TIMEOUT), f"{path}.timeout.connect"),
        read=r.parsed(parse_duration, timeout_doc.get("read", DEFAULT_READ_TIMEOUT), f"{path}.timeout.read"),
        queue=r.parsed(parse_duration, timeout_doc.get("queue", DEFAULT_QUEUE_TIMEOUT), f"{path}.timeout.queue"),
    )
    max_body_size = spec.get("max_body_size")
    return Route(
        match=match,
        upstream=upstream.rstrip("/"),
        limits=tuple(route_limits),
        strip_prefix=r.boolean(spec.get("strip_prefix", False), f"{path}.strip_prefix"),
        preserve_host=preserve_host,
        timeout=timeout,
        allow_path_parameters=r.boolean(spec.get("allow_path_parameters", False), f"{path}.allow_path_parameters"),
        max_body_size=r.parsed(parse_size, max_body_size, f"{path}.max_body_size") if max_body_size is not None else None,
    )


def _match(doc: Any, path: str, r: _Reader) -> Match:
    spec = r.mapping(doc, path, required=("path",), optional=("methods", "host", "case_sensitive"))
    prefix = r.string(spec["path"], f"{path}.path")
    error = _route_path_error(prefix)
    if error is not None:
        r.fail(f"{path}.path", f"{error}, got {prefix!r}")
    methods = None
    if "methods" in spec:
        items = r.sequence(spec["methods"], f"{path}.methods")
        for i, method in enumerate(items):
            if not isinstance(method, str) or not _HTTP_TOKEN_RE.match(method):
                r.fail(f"{path}.methods[{i}]", f"expected an HTTP method such as GET, got {method!r}")
        methods = frozenset(m.upper() for m in items)
    host = r.string(spec["host"], f"{path}.host").lower().rstrip(".") if "host" in spec else None
    if host is not None and not _HOST_RE.match(host):
        r.fail(f"{path}.host", f"expected a host name without a port, such as api.example.com, got {spec['host']!r}")
    case_sensitive = r.boolean(spec.get("case_sensitive", True), f"{path}.case_sensitive")
    return Match(path=prefix.rstrip("/") or "/", methods=methods, host=host, case_sensitive=case_sensitive)


def _route_path_error(path: str) -> str | None:
    """Why a route's `match.path` could never match a request path as gateway.proxy.paths
    reads it, or None if it can. It is written decoded, as the upstream's own routes are
    (`/files/my docs`, not `my%20docs`), and none of these survive into a decoded path."""
    if not path.startswith("/"):
        return "expected a path starting with /"
    if _NOT_IN_ROUTE_PATH.search(path):
        return "write the path decoded, without %, ;, ?, #, \\ or control characters"
    for segment in path.rstrip("/").split("/")[1:]:
        if segment in ("", ".", ".."):
            return "expected a path without empty, '.' or '..' segments"
        if segment != segment.strip(" "):
            return "a segment may not begin or end with a space"
    return None


def _route_limit(item: Any, path: str, limits: Mapping[str, Limit], r: _Reader) -> RouteLimit:
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
    if cost > limit.burst:
        r.fail(f"{path}.cost", f"cost {cost} is greater than the burst {limit.burst:g} of limit {name!r}; it could never pass")
    return RouteLimit(limit=limit, cost=cost)


def _join(path: str, key: str) -> str:
    if not key or key != key.strip() or any(c in key for c in ".:[]'"):
        key = repr(key)  # a key that would read as part of the path, or as none
    return f"{path}.{key}" if path else key


def _type_name(value: Any) -> str:
    names = {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "an integer", float: "a number"}
    if value is None:
        return "nothing (null)"
    return names.get(type(value), type(value).__name__)
