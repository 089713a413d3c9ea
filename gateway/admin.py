"""The admin listener: /metrics, /healthz, /readyz and the admin API. Never served on the public listener.

Trusts whoever can reach it, unless `admin_token_env` names a bearer token: then
every path but /healthz answers 401 without it, and the token is compared in
constant time. /healthz says only that the process is alive and stays open to
probes. Bind it to a private address (the default is 127.0.0.1:9090).

The admin API (JSON; errors as problem+json):
- `GET /buckets/{limit}?value=V[&source=S]`: the bucket of one client, named by its
  raw identity value, which is hashed as on a request. `source` picks which of the
  limit's key sources the value came from; it may be left out when there is one.
- `DELETE /buckets/{limit}?value=V[&source=S]`: reset that bucket to full, in the
  store and in this process's denial cache.
- `GET /top-limited?n=N`: the clients this process denied most over the last one to
  two minutes (`gateway.limiter.top_limited`), hashed unless `admin_raw_identities`.
- `GET /config`: the effective config, every secret replaced by "***".
"""

from __future__ import annotations

import dataclasses
import enum
import hmac
import ipaddress
import os
import time
from collections.abc import Callable
from typing import Any

from aiohttp import hdrs, web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.config.loader import redacted_url
from gateway.config.model import FailurePolicy, GatewayConfig, IdentitySource, JwtKey, Limit, StoreConfig
from gateway.config.units import Address, Rate
from gateway.limiter.keys import identity_digest
from gateway.limiter.limiter import Limiter
from gateway.limiter.store import StoreError, refusal
from gateway.metrics import Metrics
from gateway.proxy.client_identity import parse_ip
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

    async def without_banner(_: web.Request, response: web.StreamResponse) -> None:
        response.headers.popall(hdrs.SERVER, None)  # aiohttp's `Python/3.11 aiohttp/X.Y.Z`

    middlewares = [_bearer_token(config.admin_token)] if config.admin_token else []
    app = web.Application(middlewares=middlewares)
    app.on_response_prepare.append(without_banner)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_endpoint)
    api.add_routes(app.router)
    return app, api


DEFAULT_TOP = 10
REDACTED = "***"


class AdminApi:
    def __init__(self, config: GatewayConfig, limiter: Limiter) -> None:
        self._limiter = limiter
        self.update(config)
        # Hashes shown by this process: stable while it runs, so an operator can match a
        # client's inspect answer to its line in the top list, but never a bucket's key.
        self._secret = os.urandom(32)

    def update(self, config: GatewayConfig) -> None:
        """Answer from `config` from now on (a reload)."""
        self._config = config
        self._limits = {limit.name: limit for limit in config.limits}
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
            reading = await self._limiter.read_bucket(limit, identity)
        except StoreError as exc:
            raise _store_unavailable(exc) from None
        return web.json_response(
            {
                **self._describe(limit, identity),
                "key": reading.key,
                "held": reading.held,
                "tokens": reading.tokens,
                "capacity": limit.burst,
                "rate": limit.rate.text,
                "full_in_seconds": reading.full_in,
                "denied_here_for_seconds": self._limiter.denied_here_for(limit, identity),
                "store": self._limiter.store.description,
            }
        )

    async def reset(self, request: web.Request) -> web.Response:
        limit, identity = self._bucket_of(request)
        try:
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

    def _bucket_of(self, request: web.Request) -> tuple[Limit, str]:
        """The limit and identity ("source=value") a request names, or a 400 or 404."""
        name = request.match_info["limit"]
        limit = self._limits.get(name)
        if limit is None:
            raise _problem(web.HTTPNotFound, "Not Found", f"No limit is named {name!r}.", limits=sorted(self._limits))
        value = request.query.get("value", "")
        if not value:
            raise _bad_request("Give the client's identity value as ?value=, as the client sends it.")
        # A client with none of the key's sources is limited by address (client_identity).
        sources = {str(s): s for s in (*limit.key, IdentitySource(kind="ip"))}
        given = request.query.get("source")
        if given is None:
            if len(limit.key) > 1:
                raise _bad_request(
                    f"Limit {name!r} is keyed on several sources; name one with ?source=.", sources=list(sources)
                )
            source = limit.key[0]
        else:
            # Header names are matched as the loader keeps them, in lower case.
            source = sources.get(given) or sources.get(given.lower() if given.lower().startswith("header:") else given)
            if source is None:
                raise _bad_request(f"Limit {name!r} is not keyed on {given!r}.", sources=list(sources))
        if source.kind == "ip":
            value = _address(value)
        return limit, f"{source}={value}"

    def _describe(self, limit: Limit, identity: str) -> dict[str, Any]:
        source = identity.partition("=")[0]
        return {"limit": limit.name, "source": source, "identity": self._shown(identity)}

    def _shown(self, identity: str) -> str:
        if self._config.admin_raw_identities:
            return identity
        source, _, _ = identity.partition("=")
        return f"{source}#{identity_digest(self._secret, identity)}"


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
_SECRET_FIELDS = {(StoreConfig, "key_secret"), (JwtKey, "key"), (GatewayConfig, "admin_token")}


def redacted_config(config: GatewayConfig) -> Any:
    """The config as JSON data, with the store URL's password, key_secret, the JWT keys and
    the admin token replaced by "***". A value of a type not known here is redacted too, so a
    secret added later cannot leak through this view by default."""
    return _plain(config)


def _plain(value: Any, owner: type | None = None, field: str = "") -> Any:
    if (owner, field) in _SECRET_FIELDS:
        return None if value is None else REDACTED
    if owner is StoreConfig and field == "url":
        return redacted_url(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (Address, IdentitySource)):
        return str(value)
    if isinstance(value, Rate):
        return value.text
    if isinstance(value, (ipaddress.IPv4Network, ipaddress.IPv6Network)):
        return str(value)
    if isinstance(value, (tuple, list)):
        return [_plain(item) for item in value]
    if isinstance(value, frozenset):
        return sorted(_plain(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        kind = type(value)
        return {f.name: _plain(getattr(value, f.name), kind, f.name) for f in dataclasses.fields(value)}
    return REDACTED


OPEN_PATHS = frozenset({"/healthz"})


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
