"""`gateway demo`: a tiny upstream API and the gateway in front of it, in one process,
so a newcomer sees 200s turn into 429s without any other server."""

from __future__ import annotations

import asyncio

from aiohttp import web

from gateway.config.model import GatewayConfig
from gateway.config.units import parse_address
from gateway.server import serve


def demo_upstream() -> web.Application:
    async def hello(request: web.Request) -> web.Response:
        return web.json_response({"hello": "world", "path": request.path})

    async def report(request: web.Request) -> web.Response:
        return web.json_response({"report": "queued", "bytes": len(await request.read())}, status=202)

    app = web.Application()
    app.router.add_post("/api/reports", report)
    app.router.add_route("*", "/{tail:.*}", hello)
    return app


async def _demo(config: GatewayConfig, upstream_address: str) -> None:
    address = parse_address(upstream_address)
    runner = web.AppRunner(demo_upstream(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, address.host, address.port).start()
    try:
        await serve(config)
    finally:
        await runner.cleanup()


def run_demo(config: GatewayConfig, upstream_address: str) -> int:
    try:
        asyncio.run(_demo(config, upstream_address))
    except OSError as exc:
        raise SystemExit(f"gateway: cannot start the demo upstream on {upstream_address}: {exc.strerror or exc}")
    return 0
