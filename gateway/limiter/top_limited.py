"""The most-limited clients of a recent window, in fixed memory: space-saving top-k.

Clients choose their identities, so a flood of distinct keys must not grow what
the gateway holds. Space-saving (Metwally, Agrawal, El Abbadi 2005) keeps at
most `capacity` counters. A key already counted is incremented; a new key,
once the counters are full, takes over the smallest counter and inherits its
count as its `error`. So every key denied more than total/capacity times is
certainly held, and each count overstates the truth by at most its `error`.

The minimum is found through a heap whose entries may lag their counters
(counts only grow, so a lagging entry is a lower bound): evicting pops the
smallest entry, and one that lags is pushed back with its true count. The heap
holds one entry per counter, so it is as bounded as the counters, and counting
a key already held costs one dict update.

"Recent" is two epochs of `window` seconds each: the current one and the one
before. Reports merge both, so they cover between one and two windows of past
denials. A key that one epoch evicted misses at most that epoch's smallest
count there, so a merged count is exact only up to the sum of both epochs'
errors and smallest counts; the ranking of clients far above the crowd is not
in doubt. No I/O and no clock of its own: times are passed in.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from dataclasses import dataclass

from gateway.limiter.keys import listed_identity

# Enough to name every client worth naming; ~200 bytes each, so about 0.4 MB for two epochs.
DEFAULT_CAPACITY = 1000
# Operators ask "who is limited now", not "since the process started".
DEFAULT_WINDOW = 60.0


@dataclass(frozen=True, slots=True)
class HeavyHitter:
    key: Hashable
    count: int  # denials counted, an upper bound on the true number
    error: int  # how much `count` may overstate it: the true number is at least count - error


class SpaceSaving:
    """One epoch's counters: at most `capacity` keys, each with (count, error)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._counts: dict[Hashable, list[int]] = {}  # key -> [count, error]
        self._heap: list[tuple[int, int, Hashable]] = []  # (count as last pushed, tiebreak, key)
        self._pushed = 0
        self.total = 0

    def __len__(self) -> int:
        return len(self._counts)

    def add(self, key: Hashable, amount: int = 1) -> None:
        self.total += amount
        held = self._counts.get(key)
        if held is not None:
            held[0] += amount
            return
        counts = self._counts
        if len(counts) < self.capacity:
            counts[key] = [amount, 0]
            self._push(amount, key)
            return
        heap = self._heap
        while True:
            count, _, smallest = heap[0]
            true_count = counts[smallest][0]
            if true_count == count:
                break
            heapq.heapreplace(heap, (true_count, self._tiebreak(), smallest))
        heapq.heappop(heap)
        del counts[smallest]
        counts[key] = [count + amount, count]
        self._push(count + amount, key)

    def items(self) -> list[HeavyHitter]:
        return [HeavyHitter(key, count, error) for key, (count, error) in self._counts.items()]

    def _push(self, count: int, key: Hashable) -> None:
        heapq.heappush(self._heap, (count, self._tiebreak(), key))

    def _tiebreak(self) -> int:
        # Keys need not be orderable; ties between equal counts go to the older entry.
        self._pushed += 1
        return self._pushed


class TopLimited:
    """Denials per key over the current and the previous epoch of `window` seconds."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, window: float = DEFAULT_WINDOW, *, now: float = 0.0) -> None:
        if window <= 0:
            raise ValueError(f"window must be positive, got {window}")
        self.capacity = capacity
        self.window = window
        self._current = SpaceSaving(capacity)
        self._previous = SpaceSaving(capacity)
        self._epoch_ends = now + window

    def __len__(self) -> int:
        """Counters held: never more than twice the capacity."""
        return len(self._current) + len(self._previous)

    def add(self, key: Hashable, now: float) -> None:
        if now >= self._epoch_ends:
            self._rotate(now)
        self._current.add(key)

    def denied(self, limit_name: str, identity: str, now: float) -> None:
        """Count a denial of `identity` under a limit: keyed (limit name, identity as
        listed_identity keeps it), so a long identity costs no more than a short one."""
        self.add((limit_name, listed_identity(identity)), now)

    def top(self, n: int, now: float) -> list[HeavyHitter]:
        """The `n` keys with the most denials over the last one to two windows, most first."""
        if now >= self._epoch_ends:
            self._rotate(now)
        merged: dict[Hashable, HeavyHitter] = {}
        for epoch in (self._previous, self._current):
            for hit in epoch.items():
                before = merged.get(hit.key)
                if before is not None:
                    hit = HeavyHitter(hit.key, before.count + hit.count, before.error + hit.error)
                merged[hit.key] = hit
        return sorted(merged.values(), key=lambda h: (-h.count, h.error))[:n]

    def _rotate(self, now: float) -> None:
        # After a quiet spell longer than a window, nothing counted is recent any more.
        recent = now < self._epoch_ends + self.window
        self._previous = self._current if recent else SpaceSaving(self.capacity)
        self._current = SpaceSaving(self.capacity)
        self._epoch_ends += ((now - self._epoch_ends) // self.window + 1) * self.window
