"""One wave of checks per client in flight: concurrent requests of one client
reach the shared store together, once per round trip.

A client that opens a thousand connections would otherwise put a thousand
script calls for one bucket into Redis at once, and the last of them would
wait behind the rest. Here, checks with the same signature (the same limits,
identities and costs) that arrive while a wave of them is in flight wait for
it, then go together as the next wave. By then the first wave's replies are in
the denial cache, so a flooding client's next wave is answered locally, and a
client with tokens left pays at most one extra round trip.

A wave has seats for no more checks than could pass: the caller counts them
from what the wave before it learned (`Wave.learn`: the fewest tokens it saw
left, and when it sent). The checks it has no seat for wait for the next wave
instead of sending, so a flooding client whose bucket still holds a few tokens
sends a few script calls, not hundreds that would push the last of them past
the store timeout and into the failure policy. Seats never decide anything; a
check without one only asks one round trip later, when the denial cache most
likely answers it.

When a wave fails (a store error or timeout), the wave waiting behind it fails
at once with the same error rather than sending: the store just failed, and a
second full timeout would double the latency the failure policy promises.

Only asyncio synchronisation, no I/O: the caller sends and reports back, and counts a
wave's seats with `check_seats`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from gateway.limiter.store import LimitCheck, StoreError

# A wave's seats when nothing limits them: every check that waited goes.
UNLIMITED_SEATS = 1 << 62


class Wave:
    """Checks of one signature sent together; `done` resolves when every member has its answer."""

    __slots__ = ("after", "done", "error", "fewest_left", "joined", "members", "resets", "seats", "sent_at")

    def __init__(self, after: Wave | None, seats: int = UNLIMITED_SEATS) -> None:
        self.members = 0  # still waiting for their answers
        self.joined = 0
        self.seats = seats
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.after = after  # the wave this one waited for
        self.error: StoreError | None = None
        # What the store's answers to this wave showed: the earliest send, and per check
        # the fewest tokens left (None: not asked) with its quota's reset. None: no answer.
        self.sent_at: float | None = None
        self.fewest_left: Sequence[float | None] = ()
        self.resets: Sequence[float | None] = ()

    def learn(self, sent_at: float, remaining: Sequence[float | None], resets: Sequence[float | None]) -> None:
        """A member's answer from the store, for counting the next wave's seats."""
        if self.sent_at is None:
            self.sent_at, self.fewest_left, self.resets = sent_at, remaining, resets
            return
        self.sent_at = min(self.sent_at, sent_at)
        if any(left is not None and (fewest is None or left < fewest) for left, fewest in zip(remaining, self.fewest_left)):
            pairs = [
                (left, reset) if left is not None and (fewest is None or left < fewest) else (fewest, kept)
                for left, reset, fewest, kept in zip(remaining, resets, self.fewest_left, self.resets)
            ]
            self.fewest_left = [left for left, _ in pairs]
            self.resets = [reset for _, reset in pairs]


class ClientWaves:
    """`seats(checks, waited)` counts a new wave's seats from the wave it waited for (at
    least 1 is given); `checks` is what the joining caller passed."""

    def __init__(self, seats: Callable[[Any, Wave], int] | None = None) -> None:
        self._in_flight: dict[Hashable, Wave] = {}
        self._seats = seats

    def __len__(self) -> int:
        return len(self._in_flight)

    async def join(self, signature: Hashable, checks: Any = None) -> Wave:
        """The wave to send with, after waiting for the one in flight, if any (and for the
        next, when it has no seat left). `checks`: for counting seats; None, no limit.
        Raises the StoreError of the wave waited for. Pair with `leave`."""
        waited: Wave | None = None
        while True:
            wave = self._in_flight.get(signature)
            if wave is None:
                if waited is None or checks is None or self._seats is None:  # noqa: SIM108 - the else needs them narrowed
                    count = UNLIMITED_SEATS
                else:
                    count = max(1, self._seats(checks, waited))
                wave = self._in_flight[signature] = Wave(after=waited, seats=count)
                break
            if waited is not None and wave.after is waited and wave.joined < wave.seats:
                break  # the first of our group to wake opened it, and a seat is left
            waited = wave
            await asyncio.shield(wave.done)
            if wave.error is not None:
                raise wave.error
        wave.members += 1
        wave.joined += 1
        return wave

    def leave(self, signature: Hashable, wave: Wave, error: StoreError | None = None) -> None:
        """A member of `wave` has its answer (or `error`)."""
        if error is not None and wave.error is None:
            wave.error = error
        wave.members -= 1
        if wave.members == 0:
            if self._in_flight.get(signature) is wave:
                del self._in_flight[signature]
            # Only joiners compare `after`, and a finished wave has none: kept, each wave
            # would hold the one before it, back to the first of a flood that never paused.
            wave.after = None
            wave.done.set_result(None)


def check_seats(checks: Sequence[LimitCheck], waited: Wave, now: float) -> int:
    """How many of these checks could pass now, at most, by what the store told the wave
    waited for: its fewest tokens left, refilled at each limit's rate since that wave was
    sent (a quota: none until its window ends), plus what shaping may borrow. Other
    gateways only take tokens away, so more would be denied; a store that gives tokens
    back (a refund) only makes a check wait one round trip longer than it had to. `now`:
    the clock `sent_at` was read from."""
    if waited.sent_at is None:
        return UNLIMITED_SEATS
    elapsed = now - waited.sent_at
    seats = UNLIMITED_SEATS
    for check, left, reset in zip(checks, waited.fewest_left, waited.resets):
        if left is None or check.cost == 0:  # a cost of 0 always passes
            continue
        limit = check.limit
        if limit.quota is not None:
            if reset is None or elapsed >= reset:
                continue
            tokens = left
        else:
            tokens = left + (elapsed + limit.max_delay) * limit.rate.per_second
        seats = min(seats, int(tokens // check.cost))
    return seats
