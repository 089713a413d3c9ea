"""A bounded wait for a connection to an upstream.

aiohttp's connector queues a request for a pooled connection without end, so
slow clients holding every connection to one upstream would stop every other
route on it. Here a request takes one of the upstream's `upstream_connections` slots at once when
one is free (no await, no allocation), and otherwise waits in line at most its
route's `timeout.queue`, after which the proxy answers 503. A slot is held from
sending the request until the upstream's response has been passed on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque


class UpstreamSlots:
    __slots__ = ("_free", "_waiters")

    def __init__(self, limit: int) -> None:
        self._free = limit
        self._waiters: deque[asyncio.Future[None]] = deque()

    def try_take(self) -> bool:
        if self._free and not self._waiters:
            self._free -= 1
            return True
        return False

    async def take(self, timeout: float) -> bool:
        """Wait in line for a slot, up to `timeout` seconds; False when none came in time."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout):
                await waiter
        except TimeoutError:
            if waiter.done() and not waiter.cancelled():
                return True  # handed over just as the wait ended: it is ours
            self._remove(waiter)
            return False
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.give_back()  # handed over, but this request is gone
            else:
                self._remove(waiter)
            raise
        return True

    def give_back(self) -> None:
        """Hand the slot to the first request still waiting, or free it."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._free += 1

    def _remove(self, waiter: asyncio.Future[None]) -> None:
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)
