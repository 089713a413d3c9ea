"""Running the gateway as a process: signals, reloads, graceful drain, and worker processes.

The listeners are opened by gateway.listeners, as for the in-process gateway of the tests.
Trusts the config it is given and the signals the process receives.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from gateway import __version__
from gateway.app import Gateway
from gateway.config import ConfigError, load_config
from gateway.config.model import GatewayConfig
from gateway.config.units import Address
from gateway.limiter.store import StoreError
from gateway.limiter.worker_resets import WorkerResets
from gateway.listeners import StartupError, open_listeners, os_reason
from gateway.log_lines import close_stderr_log, count_stderr_drops, stderr_line
from gateway.metrics import reload_failures_counter
from gateway.proxy.access_log import close_access_log, enable_access_log
from gateway.proxy.protocol import request_parser

log = logging.getLogger("gateway")

# A worker that could not start exits with this, as `gateway run` itself would.
EXIT_STARTUP = 2
# A request allocates a few dozen short-lived objects: CPython's default (700) collects
# every ~20 requests, ~5% of a limited request's CPU. At 20,000, with the startup objects
# frozen, a collection comes every few thousand requests and costs next to nothing.
GC_YOUNG_THRESHOLD = 20_000
# `--watch` looks at the file this often: an edit takes effect within it, for one stat() a period.
WATCH_SECONDS = 0.5
# The supervisor notices a worker's exit at once, and a SIGHUP within this.
SUPERVISOR_POLL_SECONDS = 0.1


async def serve(
    config: GatewayConfig,
    *,
    access_log: str | None = None,
    workers: int = 1,
    watch: bool = False,
    supervisor: int | None = None,
    resets: WorkerResets | None = None,
    demo_upstream: str | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT, then drain in-flight requests within `shutdown_grace`.
    SIGHUP, or with `watch` a change to the config file, reloads the config.
    A worker given its `supervisor`'s pid stops in the same way once that process is gone;
    `resets` is the log of bucket resets it shares with the other workers. `demo_upstream`:
    the address `gateway demo`'s upstream listens on, which the start-up line names."""
    gateway = Gateway(config, multiprocess_metrics=workers > 1, resets=resets)
    try:
        await gateway.start()
    except StoreError as exc:
        await gateway.close()
        raise StartupError(f"store.required is set and the store is not usable: {exc}") from None
    # Everything built so far lives as long as the process: no collection need walk it.
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    count_stderr_drops(gateway.metrics.log_lines_dropped.inc)
    if access_log:
        enable_access_log(dropped=gateway.metrics.access_log_dropped.inc)
    try:
        # Every worker binds the same ports; the kernel spreads connections.
        async with open_listeners(gateway, access_log=access_log, reuse_port=workers > 1) as listeners:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(signum, stop.set)
            loop.add_signal_handler(signal.SIGHUP, gateway.reload)
            watcher = asyncio.create_task(_watch(config.source, gateway.reload)) if watch else None
            orphaned = asyncio.create_task(_watch_parent(supervisor, stop)) if supervisor is not None else None
            parser = request_parser()
            if parser != "llhttp":
                log.warning("aiohttp parses requests in pure Python, not llhttp: install a compiled aiohttp wheel")
            others = f", decisions http://{bound_address(listeners.decision)}" if listeners.decision is not None else ""
            if demo_upstream is not None:
                others += f", demo upstream http://{demo_upstream}"
            log.info(
                "gateway %s (pid %d) listening on %s://%s (admin http://%s)%s, store: %s, event loop: %s, parser: %s",
                __version__,
                os.getpid(),
                "https" if gateway.tls_context else "http",
                bound_address(listeners.public),
                bound_address(listeners.admin),
                others,
                gateway.store.description,
                _loop_name(loop),
                parser,
            )
            if listeners.rls_port is not None and config.rls is not None:
                log.info("Envoy rate-limit service (gRPC) listening on %s:%d", config.rls.listen.host, listeners.rls_port)
            await stop.wait()
            for task in (watcher, orphaned):
                if task is not None:
                    task.cancel()
            grace = gateway.config.shutdown_grace
            log.info("draining in-flight requests (up to %gs)", grace)
            await listeners.drain(grace)
    finally:
        await gateway.close()
        close_access_log()
    log.info("stopped")


async def _watch(path: str, reload: Callable[[], object]) -> None:
    """Call `reload` when the file at `path` changes (its inode, size or mtime): an editor's
    rename-over and a write in place alike. A missing file is a change, which the reload reports."""
    seen = _file_state(path)
    while True:
        await asyncio.sleep(WATCH_SECONDS)
        state = _file_state(path)
        if state != seen:
            seen = state
            reload()


async def _watch_parent(supervisor: int, stop: asyncio.Event) -> None:
    """Set `stop` once `supervisor` is no longer this process's parent: it was killed
    (SIGKILL, the OOM killer) without passing a SIGTERM on. The worker then drains and
    exits as on SIGTERM, rather than serving on, orphaned, on the shared ports that the
    next `gateway run` would find taken."""
    # Nothing signals a parent's death to its children; polling getppid is the portable way.
    while os.getppid() == supervisor:  # noqa: ASYNC110
        await asyncio.sleep(WATCH_SECONDS)
    log.warning("the supervisor (pid %d) is gone: stopping", supervisor)
    stop.set()


def _file_state(path: str) -> tuple[int, int, int] | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def bound_address(runner: web.BaseRunner) -> str:
    """The HOST:PORT `runner` listens on: for port 0, the port the kernel chose."""
    host, port = runner.addresses[0][:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _loop_name(loop: asyncio.AbstractEventLoop) -> str:
    """'uvloop' or 'asyncio': which event loop serves, shown in the startup line."""
    return type(loop).__module__.partition(".")[0]


def run_event_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run `main` on uvloop, or on asyncio's own loop where uvloop is not built."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


def run(config: GatewayConfig, *, access_log: str | None = None, watch: bool = False) -> int:
    if config.workers == 1:
        _run_loop(config, access_log, 1, watch)
        return 0
    return _supervise(config, access_log, watch)


def _run_loop(
    config: GatewayConfig,
    access_log: str | None,
    workers: int,
    watch: bool = False,
    supervisor: int | None = None,
    resets: WorkerResets | None = None,
) -> None:
    # A forked worker must not run the supervisor's handlers before its loop installs its own.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a reload before the loop serves: nothing to reload yet
    with contextlib.suppress(KeyboardInterrupt):  # SIGINT while starting, before serve() handles it: a stop like any other
        run_event_loop(
            serve(config, access_log=access_log, workers=workers, watch=watch, supervisor=supervisor, resets=resets)
        )


def _worker(config: GatewayConfig, access_log: str | None, watch: bool, supervisor: int, resets: WorkerResets) -> None:
    try:
        _run_loop(config, access_log, config.workers, watch, supervisor, resets)
    except StartupError as exc:
        stderr_line(f"gateway: {exc}")
        sys.exit(EXIT_STARTUP)
    finally:
        close_stderr_log()  # multiprocessing ends a worker with os._exit, which logging's shutdown does not see


def check_bindable(address: Address) -> None:
    """Bind `address` once without SO_REUSEPORT, so a port held by another process (even one
    that set SO_REUSEPORT itself) is reported before any worker starts, not shared silently."""
    try:
        infos = socket.getaddrinfo(address.host, address.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise StartupError(f"cannot listen on {address}: {exc.strerror}") from None
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's create_server does
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(sockaddr)
            except OSError as exc:
                raise StartupError(f"cannot listen on {address}: {os_reason(exc)}") from None


def _supervise(config: GatewayConfig, access_log: str | None, watch: bool) -> int:
    """Start `workers` processes on shared ports; pass SIGTERM/SIGINT on; exit when they have.

    A reload (SIGHUP, or with `watch` a change to the file) is checked here first: a bad
    file is refused once, in one log line and one count of gateway_config_reload_failures_total,
    rather than once by each worker, and the workers go on as they are. A good one is
    passed on as SIGHUP, and each worker reloads it."""
    check_bindable(config.listen)
    check_bindable(config.admin_listen)
    if config.decision_listen is not None:
        check_bindable(config.decision_listen)
    context = multiprocessing.get_context("fork")
    resets = WorkerResets()  # mapped before the fork, so every worker shares it
    processes = [
        # The workers do not watch the file themselves: the supervisor does, for all of them.
        context.Process(target=_worker, args=(config, access_log, False, os.getpid(), resets), name=f"gateway-worker-{i}")
        for i in range(config.workers)
    ]
    received: list[int] = []
    reloads: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        received.append(signum)
        for process in processes:
            if process.pid is not None and process.exitcode is None:
                os.kill(process.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGHUP, lambda signum, _frame: reloads.append(signum))
    for process in processes:
        process.start()
    if received:  # a signal that came while some workers were not started yet
        forward(received[-1], None)
    reload = _SupervisorReload(config.source, processes)
    seen = _file_state(config.source)
    next_look = time.monotonic() + WATCH_SECONDS
    status = 0
    while any(p.is_alive() for p in processes):
        multiprocessing.connection.wait([p.sentinel for p in processes if p.is_alive()], timeout=SUPERVISOR_POLL_SECONDS)
        if watch and time.monotonic() >= next_look:
            next_look = time.monotonic() + WATCH_SECONDS
            state = _file_state(config.source)
            if state != seen:
                seen = state
                reloads.append(signal.SIGHUP)
        if reloads and not received:
            reloads.clear()
            reload()
        for process in processes:
            if process.exitcode not in (None, 0) and not received and status == 0:
                if process.exitcode == EXIT_STARTUP:
                    status = EXIT_STARTUP  # the worker has printed why
                else:
                    status = 1
                    message = f"gateway: worker {process.name} exited with {process.exitcode}; stopping"
                    stderr_line(message)
                for other in processes:
                    if other.is_alive():
                        other.terminate()
    for process in processes:
        process.join()
    return status


class _SupervisorReload:
    """Checks the config file for the workers, and passes a good one on to them."""

    def __init__(self, source: str, processes: list[Any]) -> None:
        self._source = source
        self._processes = processes
        self._failures: Counter | None = None

    def __call__(self) -> None:
        try:
            load_config(self._source)
        except ConfigError as exc:
            if self._failures is None:
                # Made now, after the fork: this process's own file in the metrics directory,
                # which /metrics sums with the workers' (their own count stays 0).
                self._failures = reload_failures_counter(CollectorRegistry())
            self._failures.inc()
            # One log line however many mistakes the file has: each is one line already.
            log.error("config reload failed, the old config serves on: %s", "; ".join(exc.lines))
            return
        for process in self._processes:
            if process.pid is not None and process.exitcode is None:
                os.kill(process.pid, signal.SIGHUP)
