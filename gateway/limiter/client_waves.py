"""One wave of checks per client in flight: concurrent requests of one client
reach the shared store together, once per round trip.

A client that opens a thousand connections would otherwise put a thousand
script calls for one bucket into Redis at once, and the last of them would
wait behind the rest. Here, checks with the same signature (the same limits,
identities and costs) that arrive while a wave of them is in flight wait for
it, then go together as the next wave. By then the first wave's replies are in
the denial cache, so a flooding client's next wave is answered locally, and a
client with tokens left pays at most one extra round trip.

When a wave fails (a store error or timeout), the wave waiting behind it fails
at once with the same error rather than sending: the store just failed, and a
second full timeout would double the latency the failure policy promises.

Only asyncio synchronisation, no I/O: the caller sends and reports back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable

from gateway.limiter.store import StoreError


class Wave:
    """Checks of one signature sent together; `done` resolves when every member has its answer."""

    __slots__ = ("members", "done", "after", "error")

    def __init__(self, after: Wave | None) -> None:
        self.members = 0
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.after = after  # the wave this one waited for
        self.error: StoreError | None = None


class ClientWaves:
    def __init__(self) -> None:
        self._in_flight: dict[Hashable, Wave] = {}

    def __len__(self) -> int:
        return len(self._in_flight)

    async def join(self, signature: Hashable) -> Wave:
        """The wave to send with, after waiting for the one in flight, if any.
        Raises the StoreError of the wave waited for. Pair with `leave`."""
        waited: Wave | None = None
        while True:
            wave = self._in_flight.get(signature)
            if wave is None:
                wave = self._in_flight[signature] = Wave(after=waited)
                break
            if waited is not None and wave.after is waited:
                break  # the first of our group to wake opened it
            waited = wave
            await asyncio.shield(wave.done)
            if wave.error is not None:
                raise wave.error
        wave.members += 1
        return wave

    def leave(self, signature: Hashable, wave: Wave, error: StoreError | None = None) -> None:
        """A member of `wave` has its answer (or `error`)."""
        if error is not None and wave.error is None:
            wave.error = error
        wave.members -= 1
        if wave.members == 0:
            if self._in_flight.get(signature) is wave:
                del self._in_flight[signature]
            wave.done.set_result(None)
