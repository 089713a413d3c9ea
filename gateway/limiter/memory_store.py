"""The in-process store: token buckets in a dict, for one gateway process and no Redis.

It is the embedded default and the fallback for `on_store_error: local`.
Each check runs without awaiting, so within one event loop it is atomic.
A bucket that has refilled completely holds nothing worth keeping and is
dropped, so memory tracks active clients only; so is a quota's counter once its
window has ended. Buckets are timed by the monotonic clock; quota windows, which
follow the calendar, by the wall clock. Concurrency leases live here too
(gateway.limiter.leases), with the Redis script's semantics; an identity whose
last lease is released or found expired is dropped. The admin API reads and
forgets buckets and leases here as it does in Redis.

Memory is capped as nginx's `limit_req` zone is: a budget of `max_bytes` holds
a fixed number of entries (a bucket, or an identity's live leases). A check
that needs a new bucket when the budget is spent drops buckets that have
refilled, then evicts the least recently checked bucket; a client whose bucket
was evicted starts again from a full one, which is the cap's price in
exactness. Live leases are never evicted: they are requests in flight, and
dropping them would admit more than the limit. When no room can be made, the
check raises `StoreFull` and nothing is charged.
"""

from __future__ import annotations

import dataclasses
import heapq
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from gateway.config.model import ConcurrencyLimit, Limit
from gateway.limiter import bucket, leases, quota
from gateway.limiter.keys import bucket_key, identity_digest, lease_key
from gateway.limiter.store import (
    BucketReading,
    LeaseCheck,
    LeaseDecision,
    LeaseReading,
    LimitCheck,
    Prepared,
    PreparedLease,
    StoreDecision,
)

_BucketId = tuple[str, str]
# Buckets examined for dropping per check: far more than a check can add, so memory
# still follows the active clients, while no single request pays for a long quiet spell.
FORGET_PER_CHECK = 64  # (limit name, identity digest)
DEFAULT_MAX_BYTES = 32 * 1024 * 1024
# What one entry costs, measured with tracemalloc (tests/unit/test_memory_store.py holds
# the store to it): its key, its state, its place in the LRU order and in the expiry heap.
ENTRY_BYTES = 768


class StoreFull(Exception):
    """The in-process store's memory budget is spent on what it cannot evict: nothing was
    charged, and the proxy answers 503. Not a `StoreError`: no failure policy applies,
    since no other store could answer better."""


class MemoryStore:
    description = "in-process"
    refunds = False

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        on_evict: Callable[[], None] | None = None,
    ) -> None:
        """`on_evict` is told of each bucket evicted before it had refilled."""
        self._clock = clock
        self._wall_clock = wall_clock
        self._secret = os.urandom(32)
        self.max_entries = max(1, max_bytes // ENTRY_BYTES)
        self._on_evict = on_evict
        # bucket id -> (state, time it is full again: for a quota, when its window ends),
        # least recently checked first
        self._buckets: OrderedDict[_BucketId, tuple[bucket.State, float]] = OrderedDict()
        # (time it may be full, bucket id) entries, earliest first: one per bucket held, and
        # stale ones of buckets evicted or deleted, until `_compact_expiry` drops them.
        self._expiry: list[tuple[float, _BucketId]] = []
        # (limit name, identity digest) -> lease id -> time it expires
        self._leases: dict[_BucketId, dict[str, float]] = {}

    def prepare(self, limit: Limit, cost: int, *, max_delay: float = 0.0, owed: bool = False) -> Prepared:
        """The check's spec in the model (`gateway.limiter.bucket.spec_of`)."""
        spec = bucket.spec_of(LimitCheck(limit=limit, identity="", cost=cost, max_delay=max_delay, owed=owed))
        return Prepared(limit=limit, cost=cost, max_delay=max_delay, owed=owed, args=spec)

    def prepare_lease(self, limit: ConcurrencyLimit) -> PreparedLease:
        """Nothing but the limit: a lease here reads it as it is."""
        return PreparedLease(limit=limit, args=None)

    async def start(self) -> None:
        pass

    async def ping(self) -> None:
        pass

    async def close(self) -> None:
        self._buckets.clear()
        self._expiry.clear()
        self._leases.clear()

    async def acquire(self, lease: LeaseCheck) -> LeaseDecision:
        return self.acquire_now(lease)

    def acquire_now(self, lease: LeaseCheck) -> LeaseDecision:
        limit = lease.limit
        owner = (limit.name, identity_digest(self._secret, lease.identity))
        if owner not in self._leases:
            self._make_room(1, self._clock())
        outcome, held = leases.acquire(
            self._leases.get(owner, {}), lease.lease, capacity=limit.concurrency, ttl=limit.lease_ttl, now=self._clock()
        )
        self._keep_leases(owner, held)
        return LeaseDecision(admitted=outcome.admitted, in_flight=outcome.in_flight)

    async def release(self, lease: LeaseCheck) -> None:
        self.release_now(lease)

    def release_now(self, lease: LeaseCheck) -> None:
        owner = (lease.limit.name, identity_digest(self._secret, lease.identity))
        held = self._leases.get(owner)
        if held is not None:
            self._keep_leases(owner, leases.release(held, lease.lease, self._clock()))

    async def read_leases(self, limit: ConcurrencyLimit, identity: str) -> LeaseReading:
        digest = identity_digest(self._secret, identity)
        return leases.lease_reading(lease_key("", limit.name, digest), self._leases.get((limit.name, digest), {}), self._clock())

    async def delete_leases(self, limit: ConcurrencyLimit, identity: str) -> bool:
        held = self._leases.pop((limit.name, identity_digest(self._secret, identity)), {})
        return bool(leases.live(held, self._clock()))

    def _keep_leases(self, owner: _BucketId, held: dict[str, float]) -> None:
        if held:
            self._leases[owner] = held
        else:
            self._leases.pop(owner, None)

    async def check(self, checks: Sequence[LimitCheck]) -> StoreDecision:
        return self.check_now(checks)

    def check_now(self, checks: Sequence[LimitCheck]) -> StoreDecision:
        now = self._clock()
        self._forget_full(now, at_most=FORGET_PER_CHECK)
        ids = [(c.limit.name, identity_digest(self._secret, c.identity)) for c in checks]
        specs = [c.prepared.args if c.prepared is not None and c.prepared.fits(c) else bucket.spec_of(c) for c in checks]
        held = [self._buckets.get(i) for i in ids]
        for bucket_id, was_held in zip(ids, held):
            if was_held is not None:  # checked now, so the last to be evicted
                self._buckets.move_to_end(bucket_id)
        outcome = bucket.check(
            [h[0] if h else None for h in held], specs, now, quota_now=self._wall_clock() * 1000, quota_unit=1000
        )
        allowed = outcome.allowed  # charged: every limit when allowed, else only the owed ones
        new = {i for i, h, spec in zip(ids, held, specs) if h is None and spec.cost and (allowed or spec.owed)}
        if new:
            self._make_room(len(new), now, keep=len(set(ids)) - len(new))
        for bucket_id, was_held, state, spec, reset in zip(ids, held, outcome.states, specs, outcome.resets):
            # When it is full again (a quota: its window ends), by its limit as checked now.
            full_at = now + (bucket.seconds_until_full(state, spec, now) if reset is None else reset)  # type: ignore[arg-type]
            if spec.cost and (allowed or spec.owed):
                if bucket_id not in self._buckets:  # new, or forgotten as full while room was made
                    self._push_expiry(full_at, bucket_id)
                self._buckets[bucket_id] = (state, full_at)
            elif not allowed and was_held is not None and full_at > was_held[1]:
                # Nothing is charged, but a bucket is kept until it is full by its limit now:
                # a reload that lowered the rate (or raised the burst or lengthened the window)
                # makes that later than its last charge said, and dropped early it would come
                # back full (or the quota empty) too soon. The expiry heap finds the new time.
                self._buckets[bucket_id] = (was_held[0], full_at)
        return StoreDecision(
            allowed=outcome.allowed,
            remaining=outcome.remaining,
            retry_after=outcome.retry_after,
            wait=outcome.wait,
            resets=outcome.resets,
        )

    async def settle(self, check: LimitCheck, delta: int) -> None:
        self.settle_now(check, delta)

    def settle_now(self, check: LimitCheck, delta: int) -> None:
        """`settle`, for callers that cannot await (the limiter's stand-in). A bucket no longer
        held is full, and a refund leaves it so; its time to be full again stays as its last
        charge set it, which a refund only brings closer."""
        if delta > 0:
            self.check_now((dataclasses.replace(check, cost=delta, owed=True, max_delay=0.0, prepared=None),))
            return
        bucket_id = (check.limit.name, identity_digest(self._secret, check.identity))
        held = self._buckets.get(bucket_id)
        if delta < 0 and held is not None and isinstance(held[0], bucket.BucketState):
            self._buckets[bucket_id] = (bucket.refunded(held[0], check.limit.burst, -delta), held[1])

    async def read(self, limit: Limit, identity: str) -> BucketReading:
        now = self._clock()
        bucket_id = (limit.name, identity_digest(self._secret, identity))
        held = self._buckets.get(bucket_id)
        key = bucket_key("", limit.name, bucket_id[1])
        if held is not None and isinstance(held[0], quota.QuotaState):
            if held[1] > now:  # its window has not ended
                return BucketReading(key=key, held=True, tokens=limit.burst - held[0].count, full_in=held[1] - now)
            held = None
        return bucket.reading(key, limit, held[0] if held else None, now)  # type: ignore[arg-type]

    async def delete(self, limit: Limit, identity: str) -> bool:
        return self.delete_now(limit.name, identity)

    def delete_now(self, limit_name: str, identity: str) -> bool:
        """`delete`, for callers on the event loop that cannot await (the limiter's stand-in)."""
        # Its expiry entry stays, and is skipped when it comes due (`_forget_full`).
        return self._buckets.pop((limit_name, identity_digest(self._secret, identity)), None) is not None

    def forget_full(self) -> None:
        """Drop some buckets that are full by now, as a check does: for a store no check reaches
        any more (the stand-in of `on_store_error: local` once the store answers again)."""
        if self._expiry:
            self._forget_full(self._clock(), at_most=FORGET_PER_CHECK)

    def __len__(self) -> int:
        """How many buckets are held: the memory the store uses. Full ones are dropped first,
        so an idle store reports (and holds) nothing."""
        self._forget_full(self._clock())
        return len(self._buckets)

    def _make_room(self, needed: int, now: float, keep: int = 0) -> None:
        """Room for `needed` new entries within the budget: buckets that have refilled go
        first, then the least recently checked ones. Raises `StoreFull`, evicting nothing,
        when even every bucket would not make room (the rest are live leases, or the budget
        is smaller than one request's limits). `keep`: buckets of the check under way, at
        the end of the order, which are never evicted for it."""
        excess = len(self._buckets) + len(self._leases) + needed - self.max_entries
        if excess <= 0:
            return
        self._forget_full(now)
        excess = len(self._buckets) + len(self._leases) + needed - self.max_entries
        if excess > len(self._buckets) - keep:
            raise StoreFull(f"the in-process store holds {self.max_entries} entries and none can be evicted")
        for _ in range(excess):
            self._buckets.popitem(last=False)
            if self._on_evict is not None:
                self._on_evict()

    def _push_expiry(self, full_at: float, bucket_id: _BucketId) -> None:
        heapq.heappush(self._expiry, (full_at, bucket_id))
        if len(self._expiry) > 2 * len(self._buckets) + FORGET_PER_CHECK:
            self._compact_expiry()

    def _compact_expiry(self) -> None:
        """The heap again with one entry per bucket held: evicted and deleted buckets leave
        theirs behind, and a flood of new clients would otherwise grow it past the budget."""
        self._expiry = [(full_at, bucket_id) for bucket_id, (_, full_at) in self._buckets.items()]
        heapq.heapify(self._expiry)

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

