"""`gateway demo`: a tiny upstream API and the gateway in front of it, in one process,
so a newcomer sees 200s turn into 429s without any other server."""

from __future__ import annotations

import contextlib

from aiohttp import web

from gateway.config.model import GatewayConfig
from gateway.config.units import Address, parse_address
from gateway.server import StartupError, bound_address, os_reason, run_event_loop, serve


def demo_upstream() -> web.Application:
    async def hello(request: web.Request) -> web.Response:
        return web.json_response({"hello": "world", "path": request.path})

    async def report(request: web.Request) -> web.Response:
        return web.json_response({"report": "queued", "bytes": len(await request.read())}, status=202)

    app = web.Application()
    app.router.add_post("/api/reports", report)
    app.router.add_route("*", "/{tail:.*}", hello)
    return app


async def _demo(config: GatewayConfig, address: Address) -> None:
    runner = web.AppRunner(demo_upstream(), access_log=None)
    await runner.setup()
    try:
        try:
            await web.TCPSite(runner, address.host, address.port).start()
        except OSError as exc:
            raise StartupError(f"cannot start the demo upstream on {address}: {os_reason(exc)}") from None
        await serve(config, demo_upstream=bound_address(runner))
    finally:
        await runner.cleanup()


def run_demo(config: GatewayConfig, upstream_address: str) -> int:
    try:
        address = parse_address(upstream_address)
    except ValueError as exc:
        raise StartupError(f"--upstream: {exc}") from None
    with contextlib.suppress(KeyboardInterrupt):  # SIGINT while starting, before serve() handles it
        run_event_loop(_demo(config, address))
    return 0
