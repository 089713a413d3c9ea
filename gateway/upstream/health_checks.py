"""Active health checks of pool targets, in the background.

One task per checked target GETs its `health.path` every `interval`, with an
`UpstreamClient` of its own (gateway.upstream.client: the same HTTP/1.1, URL
credentials and TLS as the proxy's requests) so checks never wait on client
requests' connections. A 2xx head within `timeout` passes; any other status, a
timeout or a failed connection fails, and the target's TargetState
(gateway.upstream.balancing) decides when it leaves or rejoins the rotation.
Trusts nothing of the answer but its status: the body is read only so that its
connection can serve the next check, and one that does not end soon closes it.

Started with the gateway (ProxyHandler.start), adjusted on each reload (a
target whose state and name were kept keeps its task; a renamed one's task starts
again under its new name, from the state it had; the others start anew or stop)
and stopped by close(). Each worker process checks for itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable, Iterable
from typing import Protocol

from multidict import CIMultiDict
from prometheus_client import Gauge

from gateway.config.pool_model import HealthCheck
from gateway.upstream.balancing import TargetState
from gateway.upstream.client import UpstreamClient
from gateway.upstream.errors import ConnectFailed, UpstreamError, UpstreamTimeout

log = logging.getLogger(__name__)

# A check sends no header lines of its own: Host, and the URL's credentials, are the client's.
_NO_HEADERS: CIMultiDict[str] = CIMultiDict()
# A passed check's body is read up to this, so that its connection serves the next check;
# past it the connection is closed instead. Health answers are a few bytes of JSON or text.
DRAIN_BYTES = 64 * 1024


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
    def __init__(
        self,
        healthy: Gauge,
        show: Callable[[frozenset[str]], None],
        tls: Callable[[str], ssl.SSLContext | None],
    ) -> None:
        self._healthy = healthy  # gateway_upstream_target_healthy
        self._show = show  # told the names checked now, which /metrics shows (Metrics.show_targets)
        self._tls = tls  # the TLS context of a target's URL, as the proxy's requests use it (None for http)
        self._tasks: dict[str, tuple[CheckedTarget, asyncio.Task[None]]] = {}  # by target URL

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

    async def _run(self, target: CheckedTarget) -> None:
        state, health = target.state, target.state.health
        assert health is not None
        client = UpstreamClient(target.url, self._tls(target.url))
        gauge = self._healthy.labels(target=target.name)
        gauge.set(1 if state.healthy else 0)
        try:
            while True:
                failure = await probe(client, health)
                if state.checked(failure is None):
                    gauge.set(1 if state.healthy else 0)
                    if state.healthy:
                        log.warning("upstream target %s is back in rotation: health checks pass", target.name)
                    else:
                        log.warning(
                            "upstream target %s is out of rotation: health checks fail (the last: %s)", target.name, failure
                        )
                await asyncio.sleep(health.interval)
        finally:
            client.close()


async def probe(client: UpstreamClient, health: HealthCheck) -> str | None:
    """One check: None if it passed, else why not, as the log gives it. An operator told
    only that checks fail cannot tell a 503 from a refused connection or an untrusted
    certificate."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + health.timeout
    try:
        async with asyncio.timeout_at(deadline):
            response = await client.request(
                "GET", health.path, _NO_HEADERS, None, length=None, host=None,
                connect_timeout=health.timeout, read_timeout=health.timeout,
            )
    except (TimeoutError, UpstreamTimeout):
        return f"no answer within {health.timeout:g}s"
    except ConnectFailed as exc:
        return f"no answer within {health.timeout:g}s" if exc.timed_out else f"cannot connect: {exc}"
    except UpstreamError as exc:
        return str(exc) or type(exc).__name__
    try:
        # The status decided; what is left of the timeout goes to reading the body, whose
        # failure only costs its connection (released unfinished, it is closed).
        with contextlib.suppress(TimeoutError, UpstreamError):
            async with asyncio.timeout_at(deadline):
                drained = 0
                while drained <= DRAIN_BYTES and (chunk := await response.read()):
                    drained += len(chunk)
    finally:
        client.release(response)
    return None if 200 <= response.status < 300 else f"status {response.status}"
