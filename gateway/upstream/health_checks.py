"""Active health checks of pool targets, in the background.

One task per checked target GETs its `health.path` every `interval`, on a
session of its own so checks never queue behind client requests. A 2xx within
`timeout` passes; any other status, a timeout or a failed connection fails,
and the target's TargetState (gateway.upstream.balancing) decides when it
leaves or rejoins the rotation. Trusts nothing of the answer but its status,
which it reads without the body.

Started with the gateway (ProxyHandler.start), adjusted on each reload (a
target whose state and name were kept keeps its task; a renamed one's task starts
again under its new name, from the state it had; the others start anew or stop)
and stopped by close(). Each worker process checks for itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import Protocol

import aiohttp
from prometheus_client import Gauge
from yarl import URL

from gateway.upstream.balancing import TargetState

log = logging.getLogger(__name__)


class CheckedTarget(Protocol):
    """What a health check reads of a pool target: its base URL, its name in metrics and
    logs, and the state it reports to (the proxy's plan of the target is one)."""

    @property
    def url(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def state(self) -> TargetState: ...


class HealthChecks:
    def __init__(self, healthy: Gauge, show: Callable[[frozenset[str]], None]) -> None:
        self._healthy = healthy  # gateway_upstream_target_healthy
        self._show = show  # told the names checked now, which /metrics shows (Metrics.show_targets)
        self._tasks: dict[str, tuple[CheckedTarget, asyncio.Task[None]]] = {}  # by target URL
        self._session: aiohttp.ClientSession | None = None

    def update(self, targets: Iterable[CheckedTarget]) -> None:
        """Check each of `targets` that has a health check, from now on; stop the rest.
        Runs in the event loop (at start, and on a reload)."""
        checked = {t.url: t for t in targets if t.state.health is not None}
        for url, (target, task) in list(self._tasks.items()):
            kept = checked.get(url)
            if kept is None or kept.state is not target.state or kept.name != target.name:
                task.cancel()
                del self._tasks[url]
                if kept is None or kept.name != target.name:
                    # Its gauge goes with its name: a renamed target's task starts again under the new one.
                    with contextlib.suppress(KeyError):  # it never got as far as setting it
                        self._healthy.remove(target.name)
        self._show(frozenset(t.name for t in checked.values()))
        if checked and self._session is None:
            self._session = aiohttp.ClientSession(
                cookie_jar=aiohttp.DummyCookieJar(), trust_env=False, auto_decompress=False
            )
        for url, target in checked.items():
            if url not in self._tasks:
                self._tasks[url] = (target, asyncio.get_running_loop().create_task(self._run(target)))

    async def close(self) -> None:
        tasks = [task for _, task in self._tasks.values()]
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _run(self, target: CheckedTarget) -> None:
        state, health = target.state, target.state.health
        assert health is not None and self._session is not None
        url = URL(target.url + health.path)
        timeout = aiohttp.ClientTimeout(total=health.timeout)
        gauge = self._healthy.labels(target=target.name)
        gauge.set(1 if state.healthy else 0)
        while True:
            failure = await self._probe(self._session, url, timeout)
            if state.checked(failure is None):
                gauge.set(1 if state.healthy else 0)
                if state.healthy:
                    log.warning("upstream target %s is back in rotation: health checks pass", target.name)
                else:
                    log.warning(
                        "upstream target %s is out of rotation: health checks fail (the last: %s)", target.name, failure
                    )
            await asyncio.sleep(health.interval)

    @staticmethod
    async def _probe(session: aiohttp.ClientSession, url: URL, timeout: aiohttp.ClientTimeout) -> str | None:
        """None if the check passed, else why not: an operator told only that checks fail
        cannot tell a 503 from a refused connection or an untrusted certificate."""
        try:
            async with session.get(url, timeout=timeout, allow_redirects=False) as response:
                return None if 200 <= response.status < 300 else f"status {response.status}"
        except TimeoutError:
            return f"no answer within {timeout.total:g}s"
        except aiohttp.ClientConnectorError as exc:
            return f"cannot connect: {exc.os_error.strerror or exc}"
        except aiohttp.ClientError as exc:
            return f"{type(exc).__name__}: {exc}"
