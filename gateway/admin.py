"""The admin listener: /metrics, /healthz, /readyz and the admin API. Never served on the public listener.

Trusts whoever can reach it, unless `admin_token_env` names a bearer token: then
every path but /healthz answers 401 without it, and the token is compared in
constant time. /healthz says only that the process is alive and stays open to
probes. Bind it to a private address (the default is 127.0.0.1:9090). Against DNS
rebinding, only a Host that names the listener by address, `localhost` or a name in
`admin_hosts` is answered, and a foreign Origin cannot change state (gateway.admin_hosts).

The admin API (JSON; errors as problem+json):
- `GET /buckets/{limit}?value=V[&source=S][&tier=T]`: the bucket of one client, named
  by its raw identity value, which is hashed as on a request. `source` picks which of
  the limit's key sources the value came from; it may be left out when there is one.
  A composite source (`header:X-API-Key+path`) takes one `value` per part, in order; a
  global one none. `tier` picks a tier's bucket; by default, the tier a key file gives
  the value, else the default tier.
- `DELETE /buckets/{limit}?value=V[&source=S]`: reset that bucket to full, in the
  store and in the denial cache of this process and of its sibling workers
  (`gateway.limiter.worker_resets`).
- Both for a concurrency limit: the client's live leases (`in_flight`, counted by the
  store's clock, so a dead gateway's expired leases count for nothing) and their
  expiries; DELETE drops them, so the client is admitted again while the requests that
  held them go on (`Concurrency.reset` says what their renewals do then).
- `GET /top-limited?n=N`: the clients this process denied most over the last one to
  two minutes (`gateway.limiter.top_limited`), hashed unless `admin_raw_identities`.
- `GET /config`: the effective config, every secret replaced by "***".
- `GET /stats`: the routes and limits served now, the pool targets with their routes,
  and the gateway's counter totals (summed over the workers; a target's health gauge
  counts the workers that see it healthy), for the page, which computes rates from the
  change between polls.

The page (`/`, with `/admin.js` and `/admin.css`, from gateway/admin_page) holds no data:
it is served without the token, and its script asks for the token and sends it on
every fetch of the data paths above, which still answer 401 without it.
"""

from __future__ import annotations

import dataclasses
import enum
import hmac
import importlib.resources
import ipaddress
import os
import time
from collections.abc import Callable
from typing import Any

from aiohttp import hdrs, web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway import __version__
from gateway.admin_hosts import host_guard
from gateway.config.body_template import BodyTemplate
from gateway.config.redaction import redacted_url
from gateway.config.model import (
    Allowlist,
    ConcurrencyLimit,
    FailurePolicy,
    GatewayConfig,
    HeaderRules,
    IdentitySource,
    JwtKey,
    Limit,
    Route,
    StoreConfig,
    Target,
    Tiers,
    UpstreamPool,
)
from gateway.config.regex import Regex
from gateway.config.units import Address, Rate
from gateway.limiter.keys import identity_digest
from gateway.limiter.limiter import Limiter
from gateway.limiter.store import StoreError, refusal
from gateway.metrics import Metrics, method_label, sample_totals
from gateway.proxy.client_identity import GLOBAL_VALUE, composite_value, ip_group, parse_ip
from gateway.proxy.routing import request_host
from gateway.proxy.tiers import tier_of
from gateway.proxy.problem import PROBLEM_CONTENT_TYPE, problem, problem_body


def admin_app(
    config: GatewayConfig, limiter: Limiter, metrics: Metrics, *, draining: Callable[[], bool] = lambda: False
) -> tuple[web.Application, AdminApi]:
    """The admin listener's app, and its API, which a reload hands the new config."""
    api = AdminApi(config, limiter)

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "alive"})

    async def readyz(_: web.Request) -> web.Response:
        if draining():
            # Shutting down: load balancers must stop sending, whatever the store says.
            return web.json_response({"ready": False, "draining": True}, status=503)
        reachable, detail = await limiter.store_reachable()
        refused = not reachable and refusal(detail)
        # A store that refuses us stays refused until the deployment is fixed: never ready.
        ready = reachable or (api.serves_without_store and not refused)
        body = {
            "ready": ready,
            "store": limiter.store.description,
            "store_state": "ok" if reachable else "refused" if refused else "unreachable",
            "detail": detail,
            "breaker": limiter.breaker.state.value,
        }
        return web.json_response(body, status=200 if ready else 503)

    async def metrics_endpoint(_: web.Request) -> web.Response:
        body = generate_latest(metrics.exposition_registry())
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def stats(_: web.Request) -> web.Response:
        return web.json_response(api.stats(sample_totals(metrics.exposition_registry())))

    async def without_banner(_: web.Request, response: web.StreamResponse) -> None:
        response.headers.popall(hdrs.SERVER, None)  # aiohttp's `Python/3.11 aiohttp/X.Y.Z`

    # The Host check comes first: a rebound page must not even learn whether a token is needed.
    middlewares = [host_guard(config.admin_hosts), *([_bearer_token(config.admin_token)] if config.admin_token else [])]
    app = web.Application(middlewares=middlewares)
    app.on_response_prepare.append(without_banner)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_endpoint)
    app.router.add_get("/stats", stats)
    api.add_routes(app.router)
    _add_page(app.router, token_required=bool(config.admin_token))
    return app, api


# The page's files (gateway/admin_page), by path: served to anyone who reaches the
# listener, since they hold no data; the data comes from the paths the token guards.
PAGE_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/admin.js": ("admin.js", "text/javascript; charset=utf-8"),
    "/admin.css": ("admin.css", "text/css; charset=utf-8"),
}
# No inline script or style and nothing from elsewhere: data the page shows can never run.
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
# The page's script reads this from <html> to know whether to ask for the token first.
AUTH_MARK = 'data-auth="none"'


def page_file(name: str) -> bytes:
    return importlib.resources.files("gateway.admin_page").joinpath(name).read_bytes()


def _add_page(router: web.UrlDispatcher, *, token_required: bool) -> None:
    for path, (name, content_type) in PAGE_FILES.items():
        body = page_file(name)
        if name == "index.html" and token_required:
            body = body.replace(AUTH_MARK.encode(), b'data-auth="bearer"', 1)

        async def serve(_: web.Request, body: bytes = body, content_type: str = content_type) -> web.Response:
            return web.Response(body=body, headers={**PAGE_HEADERS, "Content-Type": content_type})

        router.add_get(path, serve)


DEFAULT_TOP = 10
# Keys the identity hashes the admin API shows. Made at import, so the worker processes,
# forked after `gateway run` imported this module, share it: /buckets and /top-limited
# answer from whichever worker a connection reaches, and a client's hash must be the same
# in each. Stable while the gateway runs; never a bucket's key.
SHOWN_IDENTITY_SECRET = os.urandom(32)
REDACTED = "***"


class AdminApi:
    def __init__(self, config: GatewayConfig, limiter: Limiter) -> None:
        self._limiter = limiter
        self.update(config)
        # Stable while the gateway runs, and alike in every worker, so an operator can match
        # a client's inspect answer to its line in the top list.
        self._secret = SHOWN_IDENTITY_SECRET

    def update(self, config: GatewayConfig) -> None:
        """Answer from `config` from now on (a reload)."""
        self._config = config
        self._limits: dict[str, Limit | ConcurrencyLimit] = {
            limit.name: limit for limit in (*config.limits, *config.concurrency_limits)
        }
        # Serving without the store is fine unless some limit rejects everything then.
        self.serves_without_store = all(limit.on_store_error is not FailurePolicy.CLOSED for limit in config.limits)

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_get("/buckets/{limit}", self.inspect)
        router.add_delete("/buckets/{limit}", self.reset)
        router.add_get("/top-limited", self.top_limited)
        router.add_get("/config", self.effective_config)

    async def inspect(self, request: web.Request) -> web.Response:
        limit, identity = self._bucket_of(request)
        try:
            if isinstance(limit, ConcurrencyLimit):
                found = await self._leases_of(limit, identity)
            else:
                found = await self._bucket_state(limit, identity)
        except StoreError as exc:
            raise _store_unavailable(exc) from None
        return web.json_response(
            {**self._describe(limit, identity), **found, "store": self._limiter.store.description}
        )

    async def _bucket_state(self, limit: Limit, identity: str) -> dict[str, Any]:
        reading = await self._limiter.read_bucket(limit, identity)
        return {
            "key": reading.key,
            "held": reading.held,
            "tokens": reading.tokens,
            "capacity": limit.burst,
            "rate": limit.rate.text,
            "full_in_seconds": reading.full_in,
            "denied_here_for_seconds": self._limiter.denied_here_for(limit, identity),
        }

    async def _leases_of(self, limit: ConcurrencyLimit, identity: str) -> dict[str, Any]:
        reading = await self._limiter.concurrency.read(limit, identity)
        return {
            "key": reading.key,
            "in_flight": reading.in_flight,
            "concurrency": limit.concurrency,
            "lease_ttl_seconds": limit.lease_ttl,
            # Were no lease renewed (their gateway died): when the first is freed, and the last.
            "next_lease_expires_in_seconds": reading.next_expiry_in,
            "last_lease_expires_in_seconds": reading.last_expiry_in,
        }

    async def reset(self, request: web.Request) -> web.Response:
        limit, identity = self._bucket_of(request)
        try:
            if isinstance(limit, ConcurrencyLimit):
                held = await self._limiter.concurrency.reset(limit, identity)
            else:
                held = await self._limiter.reset_bucket(limit, identity)
        except StoreError as exc:
            raise _store_unavailable(exc) from None
        return web.json_response({**self._describe(limit, identity), "reset": True, "held": held})

    async def top_limited(self, request: web.Request) -> web.Response:
        sketch = self._limiter.top_limited
        text = request.query.get("n", str(DEFAULT_TOP))
        # isdigit alone takes "²", and int() refuses digit strings past 4300 characters.
        if not (text.isascii() and text.isdigit() and len(text) <= 9) or not 1 <= int(text) <= sketch.capacity:
            raise _bad_request(f"n must be a whole number from 1 to {sketch.capacity}.")
        clients = []
        for hit in sketch.top(int(text), time.monotonic()):
            name, identity = hit.key
            clients.append({"limit": name, "identity": self._shown(identity), "denials": hit.count, "error": hit.error})
        return web.json_response(
            {
                "window_seconds": sketch.window,
                "identities": "raw" if self._config.admin_raw_identities else "hashed",
                "clients": clients,
            }
        )

    async def effective_config(self, _: web.Request) -> web.Response:
        return web.json_response(redacted_config(self._config))

    def stats(self, samples: dict[str, list[tuple[dict[str, str], float]]]) -> dict[str, Any]:
        """What /stats answers: the routes and limits served now, and the counters' totals."""

        def rows(name: str, *labels: str) -> list[dict[str, Any]]:
            return [
                {**{label: found.get(label, "") for label in labels}, "total": _number(total)}
                for found, total in samples.get(name, [])
            ]

        def single(name: str) -> float | int:
            return _number(sum(total for _, total in samples.get(name, [])))

        config = self._config
        return {
            "time": time.time(),
            "version": __version__,
            "routes": [
                {
                    "route": route.label,
                    "upstream": _upstream_text(route.upstream),
                    "limits": [{"name": rl.limit.name, "cost": rl.cost} for rl in route.limits]
                    + [{"name": limit.name, "cost": 1} for limit in route.concurrency],  # one lease a request
                }
                for route in config.routes
            ],
            "limits": [
                {
                    "name": limit.name,
                    "rate": limit.rate.text,
                    "burst": _number(limit.burst),
                    "key": [str(source) for source in limit.key],
                    "on_store_error": limit.on_store_error.value,
                    "shadow": limit.shadow,
                }
                for limit in config.limits
            ]
            + [
                {
                    "name": limit.name,
                    "concurrency": limit.concurrency,
                    "key": [str(source) for source in limit.key],
                    "on_store_error": limit.on_store_error.value,
                }
                for limit in config.concurrency_limits
            ],
            "targets": _pool_targets(config.routes, samples),
            "workers": config.workers,
            "requests": rows("gateway_requests_total", "route", "method", "status_class"),
            "decisions": rows("gateway_limiter_decisions_total", "route", "limit", "decision"),
            "in_flight": single("gateway_requests_in_flight"),
            "shed": single("gateway_requests_shed_total"),
            # 503s for want of a target in rotation or of a free upstream connection.
            "unavailable": rows("gateway_upstream_unavailable_total", "route", "reason"),
            # Worker processes in each state: one, with one worker.
            "breaker": {found["state"]: _number(count) for found, count in samples.get("gateway_store_breaker", [])},
            "reload": {
                "failures": single("gateway_config_reload_failures_total"),
                "last_success": single("gateway_config_last_reload_success_timestamp") or None,
            },
        }

    def _bucket_of(self, request: web.Request) -> tuple[Limit | ConcurrencyLimit, str]:
        """The limit (a bucket's, with its tier, or a concurrency limit) and identity
        ("source=value") a request names, or a 400 or 404."""
        name = request.match_info["limit"]
        limit = self._limits.get(name)
        if limit is None:
            raise _problem(web.HTTPNotFound, "Not Found", f"No limit is named {name!r}.", limits=sorted(self._limits))
        # A client with none of the key's sources is limited by address (client_identity); a
        # key with a source every request has (ip/24, path) never is.
        fallback = () if any(s.always_present for s in limit.key) else (IdentitySource(kind="ip"),)
        sources = {str(s): s for s in (*limit.key, *fallback)}
        given = request.query.get("source")
        if given is None:
            if len(limit.key) > 1:
                raise _bad_request(
                    f"Limit {name!r} is keyed on several sources; name one with ?source=.", sources=list(sources)
                )
            source = limit.key[0]
        else:
            # Header names are matched as the loader keeps them, in lower case.
            normal = "+".join(p.lower() if p.lower().startswith("header:") else p for p in given.split("+"))
            source = sources.get(normal)
            if source is None:
                raise _bad_request(f"Limit {name!r} is not keyed on {given!r}.", sources=list(sources))
        value = _identity_value(source, request.query.getall("value", []))
        identity = f"{source}={value}"
        tier = request.query.get("tier")
        if tier is None:
            return (limit if isinstance(limit, ConcurrencyLimit) else tier_of(limit, value)), identity
        tiers = limit.tiers.limits if isinstance(limit, Limit) and limit.tiers else {}
        if tier != "default" and tier not in tiers:
            raise _bad_request(f"Limit {name!r} has no tier {tier!r}.", tiers=["default", *tiers])
        return tiers.get(tier, limit), identity

    def _describe(self, limit: Limit | ConcurrencyLimit, identity: str) -> dict[str, Any]:
        source = identity.partition("=")[0]
        return {"limit": limit.name, "source": source, "identity": self._shown(identity)}

    def _shown(self, identity: str) -> str:
        if self._config.admin_raw_identities:
            return identity
        source, _, _ = identity.partition("=")
        return f"{source}#{identity_digest(self._secret, identity)}"


def _number(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


def _pool_targets(
    routes: tuple[Route, ...], samples: dict[str, list[tuple[dict[str, str], float]]]
) -> list[dict[str, Any]]:
    """Each pool target of `routes`, once however many routes name it (a target has one name),
    with its counters. `healthy` is the workers whose health checks see it healthy: null for a
    target no pool checks, or before its first check."""

    def by_target(name: str) -> dict[str, list[tuple[dict[str, str], float]]]:
        found: dict[str, list[tuple[dict[str, str], float]]] = {}
        for labels, total in samples.get(name, []):
            found.setdefault(labels.get("target", ""), []).append((labels, total))
        return found

    healthy = by_target("gateway_upstream_target_healthy")
    requests = by_target("gateway_upstream_target_requests_total")
    errors = by_target("gateway_upstream_target_errors_total")
    ejections = by_target("gateway_upstream_target_ejections_total")
    targets: dict[str, dict[str, Any]] = {}
    for route in routes:
        if not isinstance(route.upstream, UpstreamPool):
            continue
        for target in route.upstream.targets:
            name = target.name
            shown = targets.get(name)
            if shown is None:
                shown = targets[name] = {
                    "target": name,
                    "url": redacted_url(target.url),
                    "routes": [],
                    "checked": False,
                    "requests": _number(sum(total for _, total in requests.get(name, []))),
                    "errors": {labels["kind"]: _number(total) for labels, total in errors.get(name, [])},
                    "ejections": _number(sum(total for _, total in ejections.get(name, []))),
                }
            if route.label not in shown["routes"]:
                shown["routes"].append(route.label)
            shown["checked"] = shown["checked"] or route.upstream.health is not None
    for name, shown in targets.items():
        seen = healthy.get(name) if shown["checked"] else None
        shown["healthy"] = None if seen is None else _number(sum(total for _, total in seen))
    return list(targets.values())


def _identity_value(source: IdentitySource, values: list[str]) -> str:
    """The value a request would have given `source`, from the `value`s the operator gave."""
    if source.kind == "global":
        return GLOBAL_VALUE
    parts = source.leaves
    if len(values) != len(parts) or not all(values):
        shown = " and ".join(str(part) for part in parts)
        raise _bad_request(f"Give the client's value of {shown} as ?value=, once per part in that order, as sent.")
    if source.kind == "ip" and source.ipv4_prefix == 32 and source.ipv6_prefix == 128:
        # A whole address is keyed as itself, not as its /32 or /128 (client_identity's common case).
        return _address(values[0])
    read = [_part_value(part, value) for part, value in zip(parts, values)]
    return composite_value(read) if source.kind == "composite" else read[0]


def _part_value(source: IdentitySource, value: str) -> str:
    """One single source's value, read by the gateway's own rules."""
    if source.kind == "ip":
        return ip_group(_address(value), source.ipv4_prefix, source.ipv6_prefix)
    if source.kind == "method":
        return method_label(value.upper())
    if source.kind == "host":
        return request_host(value)
    return value


def _address(text: str) -> str:
    """An address as the gateway keys a client's (`client_identity.parse_ip`)."""
    address = parse_ip(text)
    if address is None:
        raise _bad_request("The value of an ip source must be an IP address.")
    return str(address)


def _problem(kind: type[web.HTTPException], title: str, detail: str, **extra: object) -> web.HTTPException:
    return kind(text=problem_body(kind.status_code, title, detail, **extra).decode(), content_type=PROBLEM_CONTENT_TYPE)


def _bad_request(detail: str, **extra: object) -> web.HTTPException:
    return _problem(web.HTTPBadRequest, "Bad Request", detail, **extra)


def _store_unavailable(exc: StoreError) -> web.HTTPException:
    return _problem(web.HTTPServiceUnavailable, "Service Unavailable", f"The store did not answer: {exc}")


# What the effective config shows in place of each secret, by (class, field).
# A tier file's members and an allowlist's identities are API keys, or hashes of them.
_SECRET_FIELDS = {
    (StoreConfig, "key_secret"), (JwtKey, "key"), (GatewayConfig, "admin_token"), (Tiers, "members"),
    (Allowlist, "identities"),
}


_URL_FIELDS = {(StoreConfig, "url"), (Route, "upstream"), (Target, "url")}
_HEADER_VALUE_FIELDS = {(HeaderRules, "set"), (HeaderRules, "add")}


def _upstream_text(upstream: str | UpstreamPool) -> str:
    """A route's upstream as the admin page shows it: the URL, or a pool's target URLs."""
    if isinstance(upstream, UpstreamPool):
        return ", ".join(redacted_url(target.url) for target in upstream.targets)
    return redacted_url(upstream)


def redacted_config(config: GatewayConfig) -> Any:
    """The config as JSON data, with the store URL's password, key_secret, the JWT keys and
    the admin token replaced by "***". A value of a type not known here is redacted too, so a
    secret added later cannot leak through this view by default."""
    return _plain(config)


def _plain(value: Any, owner: type | None = None, field: str = "") -> Any:
    if (owner, field) in _SECRET_FIELDS:
        return None if value is None else REDACTED
    if (owner, field) in _URL_FIELDS and isinstance(value, str):  # a pool's URLs are its targets'
        return redacted_url(value)  # an upstream's userinfo is a credential as much as Redis's
    if (owner, field) in _HEADER_VALUE_FIELDS:
        # A header a route writes often carries a credential (`Authorization: ${TOKEN}`):
        # its name is shown, its value never.
        return [[name, REDACTED] for name, _ in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (Address, IdentitySource, Regex)):
        return str(value)
    if isinstance(value, Rate):
        return value.text
    if isinstance(value, BodyTemplate):
        return value.text
    if isinstance(value, (ipaddress.IPv4Network, ipaddress.IPv6Network)):
        return str(value)
    if isinstance(value, (tuple, list)):
        return [_plain(item) for item in value]
    if isinstance(value, frozenset):
        return sorted(_plain(item) for item in value)
    if owner is Tiers and field == "limits":
        return {tier: _plain(limit) for tier, limit in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        kind = type(value)
        return {f.name: _plain(getattr(value, f.name), kind, f.name) for f in dataclasses.fields(value)}
    return REDACTED


OPEN_PATHS = frozenset({"/healthz", *PAGE_FILES})


def _bearer_token(token: str) -> Any:
    expected = b"Bearer " + token.encode()

    @web.middleware
    async def require_token(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path not in OPEN_PATHS:
            given = request.headers.get(hdrs.AUTHORIZATION, "").encode("utf-8", "surrogateescape")
            # compare_digest takes time that depends on the length only, never on where they differ.
            if not hmac.compare_digest(given, expected):
                return problem(
                    401, "Unauthorized", "This path needs the admin bearer token.",
                    headers={"WWW-Authenticate": 'Bearer realm="gateway-admin"'},
                )
        return await handler(request)

    return require_token
