"""The admin listener: /metrics, /healthz and /readyz. Never served on the public listener.

Trusts whoever can reach it; bind it to a private address (the default is 127.0.0.1:9090).
"""

from __future__ import annotations

from aiohttp import hdrs, web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.config.model import FailurePolicy, GatewayConfig
from gateway.limiter.limiter import Limiter
from gateway.metrics import Metrics


def admin_app(config: GatewayConfig, limiter: Limiter, metrics: Metrics) -> web.Application:
    # Serving without the store is fine unless some limit rejects everything then.
    serves_without_store = all(limit.on_store_error is not FailurePolicy.CLOSED for limit in config.limits)

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "alive"})

    async def readyz(_: web.Request) -> web.Response:
        reachable, detail = await limiter.store_reachable()
        ready = reachable or serves_without_store
        body = {
            "ready": ready,
            "store": limiter.store.description,
            "store_state": "ok" if reachable else "unreachable",
            "detail": detail,
            "breaker": limiter.breaker.state.value,
        }
        return web.json_response(body, status=200 if ready else 503)

    async def metrics_endpoint(_: web.Request) -> web.Response:
        body = generate_latest(metrics.exposition_registry())
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def without_banner(_: web.Request, response: web.StreamResponse) -> None:
        response.headers.popall(hdrs.SERVER, None)  # aiohttp's `Python/3.11 aiohttp/X.Y.Z`

    app = web.Application()
    app.on_response_prepare.append(without_banner)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_endpoint)
    return app
