"""Runs a handler behind aiohttp's low-level `web.Server` (no Application, no
router, no middlewares) as a process of its own, on uvloop as the gateway runs,
until SIGTERM or SIGINT. The probes (g) and (h) are built on it, so what they
measure is aiohttp's HTTP server and the handler, and nothing else.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable

import uvloop
from aiohttp import web

Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


def serve(make_handler: Callable[[], Handler], port: int) -> None:
    """Serve on 127.0.0.1:`port` the handler `make_handler` builds inside the running loop."""

    async def main() -> None:
        # No access log, as the naive proxy runs: its cost is not what these probes measure.
        runner = web.ServerRunner(web.Server(make_handler(), access_log=None), handle_signals=False)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        stop = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(signum, stop.set)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()

    uvloop.run(main())
