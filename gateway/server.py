"""Running the gateway as a process: listeners, signals, graceful drain, and worker processes."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import sys

from aiohttp import web

from gateway import __version__
from gateway.access_log import ACCESS_LOG_FORMATS, access_logger
from gateway.app import Gateway
from gateway.config.model import GatewayConfig

log = logging.getLogger("gateway")


async def serve(config: GatewayConfig, *, access_log: str | None = None, workers: int = 1) -> None:
    """Serve until SIGTERM or SIGINT, then drain in-flight requests within `shutdown_grace`."""
    gateway = Gateway(config, multiprocess_metrics=workers > 1)
    await gateway.start()
    public = web.AppRunner(
        gateway.public_app,
        shutdown_timeout=config.shutdown_grace,
        access_log=access_logger if access_log else None,
        access_log_class=ACCESS_LOG_FORMATS[access_log or "text"],
    )
    admin = web.AppRunner(gateway.admin_app, access_log=None)
    await public.setup()
    await admin.setup()
    reuse = workers > 1  # every worker binds the same ports; the kernel spreads connections
    sites = [
        web.TCPSite(public, config.listen.host, config.listen.port, reuse_port=reuse),
        web.TCPSite(admin, config.admin_listen.host, config.admin_listen.port, reuse_port=reuse),
    ]
    try:
        for site in sites:
            await site.start()
    except OSError as exc:
        await public.cleanup()
        await admin.cleanup()
        await gateway.close()
        raise SystemExit(f"gateway: cannot listen: {exc.strerror or exc}") from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    log.info(
        "gateway %s listening on http://%s (admin http://%s), store: %s",
        __version__,
        _bound(public),
        _bound(admin),
        gateway.store.description,
    )
    await stop.wait()
    log.info("draining in-flight requests (up to %gs)", config.shutdown_grace)
    await public.cleanup()
    await admin.cleanup()
    await gateway.close()
    log.info("stopped")


def _bound(runner: web.AppRunner) -> str:
    host, port = runner.addresses[0][:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def run(config: GatewayConfig, *, access_log: str | None = None) -> int:
    if config.workers == 1:
        _run_loop(config, access_log, 1)
        return 0
    return _supervise(config, access_log)


def _run_loop(config: GatewayConfig, access_log: str | None, workers: int) -> None:
    # A forked worker must not run the supervisor's handlers before its loop installs its own.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        import uvloop
    except ImportError:  # not built for this platform; asyncio's own loop works too
        asyncio.run(serve(config, access_log=access_log, workers=workers))
    else:
        uvloop.run(serve(config, access_log=access_log, workers=workers))


def _supervise(config: GatewayConfig, access_log: str | None) -> int:
    """Start `workers` processes on shared ports; pass SIGTERM/SIGINT on; exit when they have."""
    context = multiprocessing.get_context("fork")
    processes = [
        context.Process(target=_run_loop, args=(config, access_log, config.workers), name=f"gateway-worker-{i}")
        for i in range(config.workers)
    ]
    stopping = False

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for process in processes:
            if process.is_alive() and process.pid is not None:
                os.kill(process.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    for process in processes:
        process.start()
    status = 0
    while any(p.is_alive() for p in processes):
        for process in processes:
            process.join(timeout=0.2)
            if process.exitcode not in (None, 0) and not stopping:
                print(f"gateway: worker {process.name} exited with {process.exitcode}; stopping", file=sys.stderr)
                stopping = True
                status = 1
                for other in processes:
                    if other.is_alive():
                        other.terminate()
    return status
