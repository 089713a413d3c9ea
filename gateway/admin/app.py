"""The admin listener's aiohttp app: its routes, the bearer token, and /healthz,
/readyz and /metrics. Never served on the public listener.

Trusts whoever can reach it, unless `admin_token_env` names a bearer token: then
every path but /healthz and the page's files answers 401 without it, and the token
is compared in constant time. Before the token, the Host and Origin check of
gateway.admin.hosts turns away what a rebound page sends.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

from aiohttp import hdrs, web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.admin.buckets import BucketApi
from gateway.admin.config_view import redacted_config
from gateway.admin.hosts import host_guard
from gateway.admin.page import PAGE_FILES, add_page
from gateway.admin.stats import stats
from gateway.config.model import FailurePolicy, GatewayConfig
from gateway.limiter.limiter import Limiter
from gateway.limiter.store import refusal
from gateway.metrics import Metrics
from gateway.proxy.problem import problem


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

    async def stats_endpoint(_: web.Request) -> web.Response:
        return web.json_response(stats(api.config, metrics))

    async def effective_config(_: web.Request) -> web.Response:
        return web.json_response(redacted_config(api.config))

    async def without_banner(_: web.Request, response: web.StreamResponse) -> None:
        response.headers.popall(hdrs.SERVER, None)  # aiohttp's `Python/3.11 aiohttp/X.Y.Z`

    # The Host check comes first: a rebound page must not even learn whether a token is needed.
    middlewares = [host_guard(config.admin_hosts), *([_bearer_token(config.admin_token)] if config.admin_token else [])]
    app = web.Application(middlewares=middlewares)
    app.on_response_prepare.append(without_banner)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_endpoint)
    app.router.add_get("/stats", stats_endpoint)
    api.buckets.add_routes(app.router)
    app.router.add_get("/config", effective_config)
    add_page(app.router, token_required=bool(config.admin_token))
    return app, api


class AdminApi:
    """The config the admin listener answers from, and the parts that keep what they derive from it."""

    def __init__(self, config: GatewayConfig, limiter: Limiter) -> None:
        self.buckets = BucketApi(config, limiter)
        self._use(config)

    def update(self, config: GatewayConfig) -> None:
        """Answer from `config` from now on (a reload)."""
        self.buckets.update(config)
        self._use(config)

    def _use(self, config: GatewayConfig) -> None:
        self.config = config
        # Serving without the store is fine unless some limit rejects everything then.
        self.serves_without_store = all(limit.on_store_error is not FailurePolicy.CLOSED for limit in config.limits)


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
