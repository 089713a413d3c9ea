"""The in-process store: token buckets in a dict, for one gateway process and no Redis.

It is the embedded default and the fallback for `on_store_error: local`.
Each check runs without awaiting, so within one event loop it is atomic.
A bucket that has refilled completely holds nothing worth keeping and is
dropped, so memory tracks active clients only.
"""

from __future__ import annotations

import heapq
import os
import time
from collections.abc import Callable, Sequence

from gateway.limiter import bucket
from gateway.limiter.keys import bucket_key, identity_digest
from gateway.config.model import Limit
from gateway.limiter.store import BucketReading, LimitCheck, StoreDecision

_BucketId = tuple[str, str]
# Buckets examined for dropping per check: far more than a check can add, so memory
# still follows the active clients, while no single request pays for a long quiet spell.
FORGET_PER_CHECK = 64  # (limit name, identity digest)


class MemoryStore:
    description = "in-process"
    refunds = False

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._secret = os.urandom(32)
        # bucket id -> (state, time it is full again)
        self._buckets: dict[_BucketId, tuple[bucket.BucketState, float]] = {}
        # One (time it may be full, bucket id) entry per bucket, earliest first.
        self._expiry: list[tuple[float, _BucketId]] = []

    async def start(self) -> None:
        pass

    async def ping(self) -> None:
        pass

    async def close(self) -> None:
        self._buckets.clear()
        self._expiry.clear()

    async def check(self, checks: Sequence[LimitCheck]) -> StoreDecision:
        return self.check_now(checks)

    def check_now(self, checks: Sequence[LimitCheck]) -> StoreDecision:
        now = self._clock()
        self._forget_full(now, at_most=FORGET_PER_CHECK)
        ids = [(c.limit.name, identity_digest(self._secret, c.identity)) for c in checks]
        specs = [bucket.BucketSpec(capacity=c.limit.burst, rate=c.limit.rate.per_second, cost=c.cost) for c in checks]
        held = [self._buckets.get(i) for i in ids]
        outcome = bucket.check([h[0] if h else None for h in held], specs, now)
        if outcome.allowed:
            for bucket_id, was_held, state, spec in zip(ids, held, outcome.states, specs):
                if spec.cost:
                    full_at = now + bucket.seconds_until_full(state, spec, now)
                    self._buckets[bucket_id] = (state, full_at)
                    if was_held is None:
                        heapq.heappush(self._expiry, (full_at, bucket_id))
        return StoreDecision(allowed=outcome.allowed, remaining=outcome.remaining, retry_after=outcome.retry_after)

    async def read(self, limit: Limit, identity: str) -> BucketReading:
        now = self._clock()
        bucket_id = (limit.name, identity_digest(self._secret, identity))
        held = self._buckets.get(bucket_id)
        return reading(bucket_key("", limit.name, bucket_id[1]), limit, held[0] if held else None, now)

    async def delete(self, limit: Limit, identity: str) -> bool:
        # Its expiry entry stays, and is skipped when it comes due (`_forget_full`).
        return self._buckets.pop((limit.name, identity_digest(self._secret, identity)), None) is not None

    def __len__(self) -> int:
        """How many buckets are held: the memory the store uses. Full ones are dropped first,
        so an idle store reports (and holds) nothing."""
        self._forget_full(self._clock())
        return len(self._buckets)

    def _forget_full(self, now: float, at_most: float = float("inf")) -> None:
        while self._expiry and self._expiry[0][0] <= now and at_most > 0:
            at_most -= 1
            _, bucket_id = heapq.heappop(self._expiry)
            held = self._buckets.get(bucket_id)
            if held is None:
                continue
            if held[1] <= now:
                del self._buckets[bucket_id]
            else:  # charged again since: look again when it will be full
                heapq.heappush(self._expiry, (held[1], bucket_id))


def reading(key: str, limit: Limit, state: bucket.BucketState | None, now: float) -> BucketReading:
    """A stored bucket state (None: none held) as refilled up to `now`."""
    spec = bucket.BucketSpec(capacity=limit.burst, rate=limit.rate.per_second, cost=0)
    current = bucket.refill(state, spec, now)
    return BucketReading(
        key=key, held=state is not None, tokens=current.tokens, full_in=bucket.seconds_until_full(current, spec, now)
    )
