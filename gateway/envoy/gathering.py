"""Concurrent RPCs held together for a moment, so that their checks reach the store in
one event-loop iteration and share its script calls.

The store gathers the checks taken in one loop iteration into one script call per Redis
node (gateway.redis.check_batches). The proxy's requests come that way on their own: one
poll of the sockets brings many, handled in the same iteration. grpc.aio's do not: its
server asks the completion queue for the next RPC only once it has started the last one,
so RPCs begin one at a time, and each decision cost a script call of its own (0.95 a
decision at the benchmark's 200 calls in flight, with 1 to 3 of them in this code at
once: the rest wait in grpc's queue).

So the RPCs of the service go to the store in groups, at most one group per
`GATHER_SECONDS`: an RPC that comes at least that long after the last group (or lone RPC)
went goes at once, so a service asked less often waits for nothing; one that comes sooner
waits with the others for the window's end, and a full group goes at once. Script calls
are thus at most 1 / GATHER_SECONDS a second, however many decisions; the price is that
a busy service's RPCs wait up to that long, half of it on average. envoyproxy/ratelimit
gathers its Redis commands the same way, by time (REDIS_PIPELINE_WINDOW).

Only asyncio, no I/O.
"""

from __future__ import annotations

import asyncio

# At most 500 script calls a second, each ~0.1 ms of this process's and Redis's CPU (measured
# at the benchmark's load): under a tenth of a core, while a decision waits at most 2 ms, a
# tenth of the 20 ms Envoy's rate-limit filter gives the service by default.
GATHER_SECONDS = 0.002
# A full group goes at once: as many checks as the store puts in one script call.
MOST_GATHERED = 64


class Gathering:
    """`wait()` returns when the caller's group goes on."""

    def __init__(self, seconds: float = GATHER_SECONDS, most: int = MOST_GATHERED) -> None:
        self._seconds = seconds
        self._most = most
        self._group: list[asyncio.Future[None]] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._next = float("-inf")  # when the next group may go

    async def wait(self) -> None:
        loop = asyncio.get_running_loop()
        group = self._group
        if group is None:
            now = loop.time()
            if now >= self._next:
                self._next = now + self._seconds
                return
            group = self._group = []
            self._timer = loop.call_at(self._next, self._release, group)
        # A future each: a cancelled waiter cancels its own, not the group's.
        waiter = loop.create_future()
        group.append(waiter)
        if len(group) >= self._most:
            self._release(group)
        await waiter

    def _release(self, group: list[asyncio.Future[None]]) -> None:
        if group is not self._group:  # went full before its timer
            return
        self._group = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._next = asyncio.get_running_loop().time() + self._seconds
        for waiter in group:
            if not waiter.done():
                waiter.set_result(None)
