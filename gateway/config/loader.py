"""Read the YAML file once and turn it into `GatewayConfig`, or fail with one clear line.

The entry point of config parsing: `load_config` and `parse_config` read the document,
interpolate the environment (gateway.config.reader) and assemble the top-level keys,
the store, and what gateway.config.settings, .limits and .routes build. Trusts nothing
in the file or the environment: every key is checked against what it may hold, unknown
keys are rejected, and each error names the file and the YAML path (such as
`routes[1].limits[0].name`) and what was expected.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from typing import Any

import yaml

from gateway.config import safe_yaml
from gateway.config.limits import _concurrency_limit, _limit, _network, _response
from gateway.config.model import (
    DEFAULT_IDENTITY_MAX_LENGTH,
    DEFAULT_UPSTREAM_MAX_HEADER_LINES,
    DEFAULT_UPSTREAM_MAX_HEADER_SIZE,
    ClientIpStrategy,
    ClientLimits,
    ConcurrencyLimit,
    ForwardedHeaders,
    GatewayConfig,
    Limit,
    ResponseStyle,
    RlsConfig,
    Route,
    StoreConfig,
)
from gateway.config.reader import ConfigError, _choice, _interpolate, _Reader, _type_name
from gateway.config.rls import rls_config
from gateway.config.routes import _route
from gateway.config.settings import (
    _access_log,
    _admin_hosts,
    _admin_token,
    _client_ip,
    _jwt,
    _listen,
    _path_normalization,
)
from gateway.config.store_url import SingleTarget, parse_store_url
from gateway.config.units import parse_address, parse_duration, parse_size
from gateway.config.upstreams import _SharedTargets

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
DEFAULT_MAX_IN_FLIGHT = 1024  # per process: throughput holds to ~2000 in flight and falls by 4000; 1024 is ~0.5 s of queue
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
# Requests one worker holds waiting out a `mode: delay` wait. Each keeps its connection and
# counts toward max_in_flight; a quarter of the default leaves the rest to requests that
# go straight through.
DEFAULT_MAX_DELAYED = 256
DEFAULT_LOCAL_STORE_MEMORY = "32MiB"


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
    """The config `text` means, or one ConfigError naming every mistake in it (up to
    MAX_REPORTED). YAML that does not parse, a top level that is no mapping and unset
    environment variables stop the reading at once: nothing after them would be meaningful."""
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
        reader.raise_errors()
        config = reader.attempt("", None, _build, document, reader, environ)
    except RecursionError:
        # Only reachable through aliases that nest a document into itself many times over.
        raise ConfigError(f"{source}: nested too deeply") from None
    reader.raise_errors()
    assert config is not None  # None only with an error noted
    return config


def _build(document: Any, r: _Reader, environ: Mapping[str, str]) -> GatewayConfig | None:
    """The config, or None when a mistake was noted in `r.errors`. Each top-level part is
    read on its own (`r.attempt`), so a mistake in one still lets the others be checked;
    the checks across parts skip a part that is broken."""
    if document is None:
        r.fail("", "the file is empty; it needs at least `routes`")
    top = r.mapping(
        document,
        "",
        required=("routes",),
        optional=(
            "listen", "admin_listen", "workers", "max_in_flight", "store", "trusted_proxies", "limits",
            "shutdown_grace", "forwarded_headers", "jwt", "path_normalization", "admin_token_env",
            "admin_raw_identities", "admin_hosts", "identity_max_length",
            "client_header_timeout", "client_body_timeout", "keepalive_timeout", "keepalive_requests",
            "max_header_size", "upstream_connections", "upstream_max_header_size", "upstream_max_header_lines",
            "access_log", "response", "max_delayed", "client_ip",
            "local_store_memory", "rls_listen", "rls_config", "rls_merge_domains", "decision_listen",
        ),
    )
    default_address = parse_address(DEFAULT_LISTEN)
    listen, listen_backlog, listen_tls = r.attempt("listen", (default_address, 0, None), _listen, top.get("listen", DEFAULT_LISTEN), r)
    admin_listen = r.attempt(
        "admin_listen", default_address, r.parsed, parse_address, top.get("admin_listen", DEFAULT_ADMIN_LISTEN), "admin_listen"
    )
    decision_listen = (
        r.attempt("decision_listen", None, r.parsed, parse_address, top["decision_listen"], "decision_listen")
        if top.get("decision_listen") is not None
        else None
    )
    workers = r.attempt("workers", 1, r.integer, top.get("workers", 1), "workers", minimum=1, maximum=MAX_WORKERS)
    max_in_flight = r.attempt(
        "max_in_flight", 1, r.integer, top.get("max_in_flight", DEFAULT_MAX_IN_FLIGHT), "max_in_flight", minimum=1
    )
    store = r.attempt("store", None, _store, top["store"], r) if top.get("store") is not None else None
    if workers > 1 and store is None and "store" not in r.broken:
        r.note(
            "workers",
            f"{workers} needs a shared `store:`; with the in-process store each worker "
            f"would count separately and clients would get {workers} times the limit",
        )
    addresses = [("listen", listen), ("admin_listen", admin_listen)]
    if decision_listen is not None:
        addresses.append(("decision_listen", decision_listen))
    for key, address in addresses:
        if workers > 1 and address.port == 0:
            r.note(key, f"port 0 needs workers: 1; with workers: {workers} each worker would get a different port")
    trusted = r.attempt("trusted_proxies", (), _trusted_proxies, top.get("trusted_proxies", []), r)
    if decision_listen is not None and not trusted and "trusted_proxies" not in r.broken:
        r.note(
            "decision_listen",
            "needs trusted_proxies: only the proxies listed there may ask for decisions, so every question would get 400",
        )
    forwarded_headers = r.attempt(
        "forwarded_headers",
        ForwardedHeaders.REPLACE,
        _choice,
        ForwardedHeaders,
        top.get("forwarded_headers", ForwardedHeaders.REPLACE.value),
        "forwarded_headers",
        r,
    )
    client_ip = ClientIpStrategy()
    if "client_ip" in top and "trusted_proxies" not in r.broken:  # it is read only from trusted proxies
        client_ip = r.attempt("client_ip", client_ip, _client_ip, top["client_ip"], trusted, r)
    jwt_config = r.attempt("jwt", None, _jwt, top["jwt"], r, environ) if top.get("jwt") is not None else None
    limits_doc = top.get("limits") or {}
    response = r.attempt("response", ResponseStyle(), _response, top.get("response", {}), "response", ResponseStyle(), r)
    # A limit that is broken stays in as None: a route naming it is not told it is undefined.
    limits: dict[str, Limit | ConcurrencyLimit | None] = {}
    named: Mapping[str, Any] = r.attempt(
        "limits", {}, lambda: r.mapping(limits_doc, "limits", optional=tuple(limits_doc) if isinstance(limits_doc, dict) else ())
    )
    for name, spec in named.items():
        path = f"limits.{name}"
        limit: Limit | ConcurrencyLimit | None
        if isinstance(spec, dict) and "concurrency" in spec:
            limit = r.attempt(path, None, _concurrency_limit, name, spec, path, r)
        else:
            limit = r.attempt(path, None, _limit, name, spec, path, response, trusted, r)
        if isinstance(name, str):  # a name of another type is refused, and no route can name it
            limits[name] = limit
    every_limit_read = not any(part == "limits" or part.startswith("limits.") for part in r.broken)
    leased = next((name for name, limit in limits.items() if isinstance(limit, Limit) and limit.lease), None)
    if leased is not None and store is None and "store" not in r.broken:
        r.note(
            f"limits.{leased}.lease",
            "a lease takes tokens from a shared store; without `store` the in-process buckets are local already",
        )
    jwt_sources = [
        (name, i)
        for name, limit in limits.items()
        if limit is not None
        for i, source in enumerate(limit.key)
        if any(leaf.kind == "jwt" for leaf in source.leaves)
    ]
    if jwt_sources and jwt_config is None and "jwt" not in r.broken:
        name, i = jwt_sources[0]
        r.note(f"limits.{name}.key[{i}]", "a jwt:CLAIM source needs a top-level `jwt` block with the keys that verify tokens")
    if jwt_config is not None and not jwt_sources and every_limit_read:
        r.note("jwt", "no limit's `key` has a jwt:CLAIM source, so these keys would verify nothing")
    rls = None
    if ("rls_listen" in top) != ("rls_config" in top):
        r.note("rls_listen" if "rls_config" in top else "rls_config", "Envoy's rate-limit service needs both rls_listen and rls_config")
    elif "rls_listen" in top:
        rls = r.attempt("rls_listen", None, _rls, top, workers, r)
    elif "rls_merge_domains" in top:
        r.note("rls_merge_domains", "applies to the files of rls_config, which this config does not have")
    routes = r.attempt("routes", (), _routes, top["routes"], limits, r)
    scalars = _scalars(top, r, environ)
    if r.errors:
        return None
    return GatewayConfig(
        source=r.source,
        listen=listen,
        admin_listen=admin_listen,
        decision_listen=decision_listen,
        workers=workers,
        max_in_flight=max_in_flight,
        store=store,
        trusted_proxies=trusted,
        limits=tuple(limit for limit in limits.values() if isinstance(limit, Limit)),
        routes=routes,
        forwarded_headers=forwarded_headers,
        jwt=jwt_config,
        listen_tls=listen_tls,
        listen_backlog=listen_backlog,
        admin_token_env=top.get("admin_token_env"),
        concurrency_limits=tuple(limit for limit in limits.values() if isinstance(limit, ConcurrencyLimit)),
        client_ip=client_ip,
        rls=rls,
        **scalars,
    )


def _trusted_proxies(doc: Any, r: _Reader) -> tuple[Any, ...]:
    return tuple(
        r.parsed(lambda v: _network(str(v)), item, f"trusted_proxies[{i}]")
        for i, item in enumerate(r.sequence(doc, "trusted_proxies"))
    )


def _rls(top: Mapping[str, Any], workers: int, r: _Reader) -> RlsConfig:
    if importlib.util.find_spec("grpc") is None:
        r.fail("rls_listen", "needs grpcio and protobuf: pip install 'ratelimit-gateway[envoy]'")
    rls_listen = r.parsed(parse_address, top["rls_listen"], "rls_listen")
    if workers > 1 and rls_listen.port == 0:
        r.fail("rls_listen", f"port 0 needs workers: 1; with workers: {workers} each worker would get a different port")
    merge = r.boolean(top.get("rls_merge_domains", False), "rls_merge_domains")
    return rls_config(rls_listen, top["rls_config"], r, merge_domains=merge)


def _routes(doc: Any, limits: Mapping[str, Limit | ConcurrencyLimit | None], r: _Reader) -> tuple[Route, ...]:
    """Every route, each read on its own: a broken one is noted and the next is read."""
    routes_doc = r.sequence(doc, "routes")
    if not routes_doc:
        r.fail("routes", "expected at least one route")
    targets = _SharedTargets()
    routes = (r.attempt(f"routes[{i}]", None, _route, item, f"routes[{i}]", limits, targets, r) for i, item in enumerate(routes_doc))
    return tuple(route for route in routes if route is not None)


def _scalars(top: Mapping[str, Any], r: _Reader, environ: Mapping[str, str]) -> dict[str, Any]:
    """The top-level settings no other part depends on, by GatewayConfig's field names; each
    mistake among them is noted and the rest read."""
    read = r.attempt
    return {
        "shutdown_grace": read(
            "shutdown_grace", 0.0, r.parsed, parse_duration, top.get("shutdown_grace", DEFAULT_SHUTDOWN_GRACE), "shutdown_grace"
        ),
        "path_normalization": read("path_normalization", None, _path_normalization, top.get("path_normalization", {}), r),
        "admin_token": read("admin_token_env", None, _admin_token, top.get("admin_token_env"), r, environ),
        "admin_raw_identities": read(
            "admin_raw_identities", False, r.boolean, top.get("admin_raw_identities", False), "admin_raw_identities"
        ),
        "admin_hosts": read("admin_hosts", (), _admin_hosts, top.get("admin_hosts", []), r),
        "access_log": read("access_log", None, _access_log, top.get("access_log", False), r),
        "clients": ClientLimits(
            header_timeout=read(
                "client_header_timeout", 0.0, r.parsed, parse_duration,
                top.get("client_header_timeout", DEFAULT_CLIENT_HEADER_TIMEOUT), "client_header_timeout",
            ),
            body_timeout=read(
                "client_body_timeout", 0.0, r.parsed, parse_duration,
                top.get("client_body_timeout", DEFAULT_CLIENT_BODY_TIMEOUT), "client_body_timeout",
            ),
            keepalive_timeout=read(
                "keepalive_timeout", 0.0, r.parsed, parse_duration,
                top.get("keepalive_timeout", DEFAULT_KEEPALIVE_TIMEOUT), "keepalive_timeout",
            ),
            keepalive_requests=read(
                "keepalive_requests", 1, r.integer, top.get("keepalive_requests", DEFAULT_KEEPALIVE_REQUESTS),
                "keepalive_requests", minimum=1,
            ),
            max_header_size=read(
                "max_header_size", 0, r.parsed, parse_size, top.get("max_header_size", DEFAULT_MAX_HEADER_SIZE), "max_header_size"
            ),
        ),
        "upstream_connections": read(
            "upstream_connections", 1, r.integer, top.get("upstream_connections", DEFAULT_UPSTREAM_CONNECTIONS),
            "upstream_connections", minimum=1,
        ),
        "upstream_max_header_size": read(
            "upstream_max_header_size", 0, r.parsed, parse_size,
            top.get("upstream_max_header_size", DEFAULT_UPSTREAM_MAX_HEADER_SIZE), "upstream_max_header_size",
        ),
        "upstream_max_header_lines": read(
            "upstream_max_header_lines", 1, r.integer,
            top.get("upstream_max_header_lines", DEFAULT_UPSTREAM_MAX_HEADER_LINES), "upstream_max_header_lines", minimum=1,
        ),
        "max_delayed": read("max_delayed", 1, r.integer, top.get("max_delayed", DEFAULT_MAX_DELAYED), "max_delayed", minimum=1),
        "identity_max_length": read(
            "identity_max_length", 0, r.parsed, parse_size,
            top.get("identity_max_length", DEFAULT_IDENTITY_MAX_LENGTH), "identity_max_length",
        ),
        "local_store_memory": read(
            "local_store_memory", 0, r.parsed, parse_size,
            top.get("local_store_memory", DEFAULT_LOCAL_STORE_MEMORY), "local_store_memory",
        ),
    }


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

