"""The in-process store (gateway/limiter/memory_store.py) on a clock the test turns by hand.

The store takes its clock as an argument; `ManualClock` is a real clock that
only moves when told to, so refill and forgetting are checked to the exact
token without waiting.
"""

from __future__ import annotations

import gc
import math
import random
import time
import tracemalloc

import pytest

from gateway.config.model import ConcurrencyLimit, FailurePolicy, IdentitySource, Limit, Quota
from gateway.config.units import parse_rate
from gateway.limiter import bucket
from gateway.limiter.memory_store import ENTRY_BYTES, MemoryStore, StoreFull
from gateway.limiter.store import LeaseCheck, LimitCheck


class ManualClock:
    """A monotonic clock in seconds that moves only when the test advances it."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        assert seconds >= 0, "a monotonic clock never runs backwards"
        self.now += seconds


def limit(name: str, rate: str, burst: float) -> Limit:
    return Limit(
        name=name,
        rate=parse_rate(rate),
        burst=burst,
        key=(IdentitySource(kind="ip"),),
        on_store_error=FailurePolicy.OPEN,
    )


def one(lim: Limit, identity: str = "ip=192.0.2.1", cost: int = 1) -> LimitCheck:
    return LimitCheck(limit=lim, identity=identity, cost=cost)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def store(clock: ManualClock) -> MemoryStore:
    return MemoryStore(clock=clock)


def test_a_new_bucket_starts_full_and_each_request_takes_its_cost(store):
    per_ip = limit("per-ip", "10/second", 5)
    remaining = [store.check_now([one(per_ip, cost=2)]).remaining[0] for _ in range(2)]
    assert remaining == [3.0, 1.0]
    denied = store.check_now([one(per_ip, cost=2)])
    assert not denied.allowed
    assert denied.remaining == (1.0,)
    assert denied.retry_after == pytest.approx(0.1)


def test_refill_follows_the_injected_clock_to_the_token(store, clock):
    per_ip = limit("per-ip", "2/second", 10)
    assert store.check_now([one(per_ip, cost=10)]).remaining == (0.0,)
    clock.advance(1.25)
    assert store.check_now([one(per_ip, cost=0)]).remaining == pytest.approx((2.5,))
    clock.advance(0.25)
    assert store.check_now([one(per_ip, cost=3)]).remaining == pytest.approx((0.0,))
    # Never beyond capacity, however long the client stays away (as long as the bucket is still held).
    clock.advance(3.0)
    assert store.check_now([one(per_ip, cost=1)]).remaining == pytest.approx((5.0,))
    clock.advance(3600.0)
    assert store.check_now([one(per_ip, cost=1)]).remaining == pytest.approx((9.0,))


def test_a_denied_client_waits_exactly_retry_after(store, clock):
    per_key = limit("per-key", "1/minute", 3)
    for _ in range(3):
        assert store.check_now([one(per_key)]).allowed
    denied = store.check_now([one(per_key)])
    assert not denied.allowed
    assert denied.retry_after == pytest.approx(60.0)
    clock.advance(59.9)
    assert not store.check_now([one(per_key)]).allowed
    clock.advance(0.1)
    assert store.check_now([one(per_key)]).allowed


def test_a_denied_request_charges_nothing(store, clock):
    per_ip = limit("per-ip", "1/second", 4)
    store.check_now([one(per_ip, cost=3)])
    for _ in range(5):
        assert not store.check_now([one(per_ip, cost=2)]).allowed
    # Had any denied request been charged, this would not fit.
    assert store.check_now([one(per_ip, cost=1)]).remaining == (0.0,)


def test_a_denied_bucket_is_kept_until_full_at_the_rate_it_was_checked_at(store, clock):
    """As in Redis: after a reload lowered 10/second to 1/hour, a denied bucket was dropped
    when it would have been full at the old rate, and the client came back with a full burst."""
    fast, slow = limit("per_ip", "10/second", 20), limit("per_ip", "1/hour", 20)
    for _ in range(20):
        assert store.check_now([one(fast)]).allowed
    assert not store.check_now([one(slow)]).allowed
    clock.advance(60)  # long past the 2 s the old rate needed
    assert len(store) == 1
    decision = store.check_now([one(slow)])
    assert not decision.allowed and decision.remaining[0] == pytest.approx(60 / 3600)


def test_cost_zero_is_allowed_on_an_empty_bucket_and_creates_nothing(store):
    per_ip = limit("per-ip", "1/hour", 1)
    fresh = store.check_now([one(per_ip, identity="ip=198.51.100.9", cost=0)])
    assert (fresh.allowed, fresh.remaining, fresh.retry_after) == (True, (1.0,), 0.0)
    assert len(store) == 0
    store.check_now([one(per_ip)])
    drained = store.check_now([one(per_ip, cost=0)])
    assert (drained.allowed, drained.remaining, drained.retry_after) == (True, (0.0,), 0.0)


def test_cost_above_capacity_is_denied_for_ever_and_charges_nothing(store):
    small = limit("small", "100/second", 5)
    denied = store.check_now([one(small, cost=6)])
    assert (denied.allowed, denied.remaining, denied.retry_after) == (False, (5.0,), math.inf)
    assert len(store) == 0
    assert store.check_now([one(small, cost=5)]).remaining == (0.0,)


def test_several_limits_are_all_or_nothing_across_identities(store, clock):
    per_ip = limit("per-ip", "1/hour", 10)
    per_key = limit("per-key", "1/hour", 2)
    request = [one(per_ip, "ip=203.0.113.5"), one(per_key, "header:x-api-key=alpha")]
    assert store.check_now(request).remaining == (9.0, 1.0)
    assert store.check_now(request).remaining == (8.0, 0.0)
    for _ in range(3):
        denied = store.check_now(request)
        assert not denied.allowed
        assert denied.remaining == (8.0, 0.0)
        assert denied.retry_after == pytest.approx(3600.0)
    # The address still holds the 8 tokens the denied requests did not take...
    assert store.check_now([one(per_ip, "ip=203.0.113.5")]).remaining == (7.0,)
    # ...and another key from the same address has its own per-key bucket.
    other = store.check_now([one(per_ip, "ip=203.0.113.5"), one(per_key, "header:x-api-key=beta")])
    assert other.remaining == (6.0, 1.0)


def test_the_same_identity_has_a_separate_bucket_per_limit(store):
    a = limit("a", "1/hour", 1)
    b = limit("b", "1/hour", 1)
    assert store.check_now([one(a, "ip=192.0.2.7")]).allowed
    assert store.check_now([one(b, "ip=192.0.2.7")]).allowed
    assert not store.check_now([one(a, "ip=192.0.2.7")]).allowed
    assert store.check_now([one(a, "ip=192.0.2.8")]).allowed


def test_a_bucket_that_refilled_completely_is_dropped_and_a_partly_drained_one_is_kept(store, clock):
    per_ip = limit("per-ip", "10/second", 10)  # an empty bucket is full again after 1 s
    store.check_now([one(per_ip, "ip=192.0.2.1", cost=10)])
    clock.advance(0.5)
    store.check_now([one(per_ip, "ip=192.0.2.2", cost=4)])  # full again 0.4 s from now
    assert len(store) == 2

    clock.advance(0.399)
    assert len(store) == 2, "a bucket was dropped before it was full again"
    clock.advance(0.001)
    assert len(store) == 1
    # The partly drained bucket kept its count: 0.9 s at 10/s since it was emptied.
    assert store.check_now([one(per_ip, "ip=192.0.2.1", cost=0)]).remaining == pytest.approx((9.0,))
    clock.advance(0.1)
    assert len(store) == 0
    assert store.check_now([one(per_ip, "ip=192.0.2.1", cost=0)]).remaining == (10.0,)


def test_a_bucket_charged_again_is_kept_until_its_new_full_time(store, clock):
    per_ip = limit("per-ip", "10/second", 10)
    store.check_now([one(per_ip, cost=1)])  # full again at +0.1 s
    clock.advance(0.05)
    store.check_now([one(per_ip, cost=5)])  # 4.5 left: full again at +0.55 s from now
    clock.advance(0.1)
    assert len(store) == 1
    assert store.check_now([one(per_ip, cost=0)]).remaining == pytest.approx((5.5,))
    clock.advance(0.45)
    assert len(store) == 0


def test_memory_goes_back_to_zero_once_every_client_is_full_again(store, clock):
    per_ip = limit("per-ip", "5/second", 5)
    per_key = limit("per-key", "1/second", 3)
    for n in range(500):
        store.check_now([one(per_ip, f"ip=10.0.{n // 256}.{n % 256}", cost=1 + n % 5), one(per_key, f"header:k=c{n}")])
    assert len(store) == 1000
    # Half a second on: per-ip buckets that paid 1 or 2 (full after 0.2 s and 0.4 s) are gone;
    # those that paid 3 to 5, and every per-key bucket (full after 1 s), are still held.
    clock.advance(0.5)
    assert len(store) == 300 + 500
    clock.advance(2.5)
    assert len(store) == 0
    # Forgotten clients come back to full buckets.
    assert store.check_now([one(per_key, "header:k=c0")]).remaining == (2.0,)


def test_a_denied_request_stores_no_bucket_for_the_limits_that_had_room(store):
    roomy = limit("roomy", "1/hour", 100)
    tight = limit("tight", "1/hour", 1)
    store.check_now([one(tight, "ip=192.0.2.1")])
    assert len(store) == 1
    assert not store.check_now([one(roomy, "ip=192.0.2.1"), one(tight, "ip=192.0.2.1")]).allowed
    assert len(store) == 1


async def test_the_async_check_and_close_use_the_same_buckets(store):
    per_ip = limit("per-ip", "1/hour", 2)
    assert (await store.check([one(per_ip)])).remaining == (1.0,)
    assert store.check_now([one(per_ip)]).remaining == (0.0,)
    await store.close()
    assert len(store) == 0
    assert (await store.check([one(per_ip)])).remaining == (1.0,)


def test_the_default_clock_is_monotonic_and_refills():
    store = MemoryStore()
    per_ip = limit("per-ip", "1000/second", 5)
    assert store.check_now([one(per_ip, cost=5)]).remaining == (0.0,)
    start = time.monotonic()
    while store.check_now([one(per_ip, cost=0)]).remaining[0] < 1.0:
        assert time.monotonic() - start < 5.0, "the store never refilled"
    assert store.check_now([one(per_ip)]).allowed


def test_random_traffic_matches_the_bucket_model_exactly(store, clock):
    """The store carries bucket.check: same decisions, same counts, on the same clock."""
    rng = random.Random(1234)
    limits = [limit("a", "3/second", 5), limit("b", "1/minute", 2), limit("c", "50/second", 20)]
    identities = ["ip=192.0.2.1", "ip=192.0.2.2", "header:k=x"]
    model: dict[tuple[str, str], bucket.BucketState] = {}
    for _ in range(3000):
        clock.advance(rng.choice([0.0, rng.uniform(0, 0.2), rng.uniform(0, 3)]))
        chosen = rng.sample(limits, rng.randint(1, 3))
        checks = [LimitCheck(limit=lim, identity=rng.choice(identities), cost=rng.choice([0, 1, 1, 2, 6])) for lim in chosen]
        specs = [bucket.BucketSpec(capacity=c.limit.burst, rate=c.limit.rate.per_second, cost=c.cost) for c in checks]
        ids = [(c.limit.name, c.identity) for c in checks]
        expected = bucket.check([model.get(i) for i in ids], specs, clock.now)
        if expected.allowed:
            for i, new, s in zip(ids, expected.states, specs):
                if s.cost:
                    model[i] = new

        got = store.check_now(checks)

        assert got.allowed is expected.allowed
        assert got.remaining == pytest.approx(expected.remaining, abs=1e-9)
        assert got.retry_after == pytest.approx(expected.retry_after, abs=1e-9)
    assert len(store) <= len(limits) * len(identities)


def quota_limit(name: str, limit: int, per: str, reset: float = 0.0) -> Limit:
    return Limit(
        name=name, rate=parse_rate(f"{limit}/day"), burst=limit, key=(IdentitySource(kind="ip"),),
        on_store_error=FailurePolicy.OPEN, quota=Quota(limit=limit, per=per, reset=reset),
    )


async def test_a_quota_counts_by_the_wall_clock_and_is_forgotten_when_its_window_ends(clock):
    """Buckets follow the monotonic clock, quota windows the wall clock: 2 a day from
    09:00 UTC, checked at 08:59:59 on 2026-11-30, then a second later."""
    wall = ManualClock(start=1_764_493_199.0)  # 2026-11-30 08:59:59 UTC
    store = MemoryStore(clock=clock, wall_clock=wall)
    daily = quota_limit("daily", 2, "day", reset=9 * 3600)
    tokens = limit("tokens", "1/day", 5)
    pair = [one(tokens), one(daily)]
    first, second, third = (store.check_now(pair) for _ in range(3))
    assert (first.allowed, second.allowed, third.allowed) == (True, True, False)
    assert third.remaining == (3, 0) and third.retry_after == 1.0 and third.resets == (None, 1.0)
    reading = await store.read(daily, "ip=192.0.2.1")
    assert (reading.held, reading.tokens, reading.full_in) == (True, 0, 1.0)
    clock.advance(1.0)
    wall.advance(1.0)
    assert len(store) == 1  # the quota's counter is gone with its window; the bucket stays
    fourth = store.check_now(pair)
    assert fourth.allowed and fourth.remaining == pytest.approx((2 + 1 / 86400, 1)) and fourth.resets == (None, 86400.0)


def test_a_shaping_bucket_in_process_queues_and_rejects_past_its_debt(store, clock):
    shaped = limit("shaped", "10/second", 1)
    waits = [store.check_now([LimitCheck(shaped, "ip=192.0.2.1", 1, max_delay=0.5)]) for _ in range(7)]
    assert [d.allowed for d in waits] == [True] * 6 + [False]
    assert [d.wait for d in waits[:6]] == pytest.approx([0, 0.1, 0.2, 0.3, 0.4, 0.5])
    # A check that may not wait (the worker holds max_delayed already) is rejected outright.
    clock.advance(0.1)
    assert not store.check_now([one(shaped)]).allowed
    assert store.check_now([LimitCheck(shaped, "ip=192.0.2.1", 1, max_delay=0.5)]).wait == pytest.approx(0.5)


# The memory budget (nginx's limit_req zone rule): a fixed number of entries, refilled
# buckets dropped first, then the least recently checked; 503 (StoreFull) only when what
# is left cannot be evicted.

def capped(clock: ManualClock, entries: int, evicted: list[int] | None = None) -> MemoryStore:
    return MemoryStore(
        clock=clock, max_bytes=entries * ENTRY_BYTES, on_evict=None if evicted is None else lambda: evicted.append(1)
    )


def test_a_flood_of_new_clients_stays_within_the_budget_in_bytes_as_measured(clock):
    budget = 2 * 1024 * 1024
    slow = limit("per_key", "1/hour", 10)
    daily = quota_limit("daily", 1000, "day")
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        store = MemoryStore(clock=clock, max_bytes=budget)
        peak = 0
        # Four times what fits, each client with a bucket and a quota, with identities
        # long enough that a raw copy of each would show.
        for n in range(4 * budget // ENTRY_BYTES // 2):
            identity = f"header:x-api-key={n:0120d}"
            assert store.check_now([one(slow, identity), one(daily, identity)]).allowed
            if n % 500 == 0:
                clock.advance(0.001)
                gc.collect()
                peak = max(peak, tracemalloc.get_traced_memory()[0] - base)
    finally:
        tracemalloc.stop()
    assert len(store._buckets) <= store.max_entries
    assert peak <= budget, f"{peak / 2**20:.2f} MiB held for a budget of {budget / 2**20:.0f} MiB"


def test_buckets_that_have_refilled_make_room_before_any_other_is_evicted(clock):
    evicted: list[int] = []
    store = capped(clock, 3, evicted)
    slow, fast = limit("slow", "1/hour", 2), limit("fast", "10/second", 2)
    store.check_now([one(slow, "ip=192.0.2.1")])  # the oldest: far from full
    store.check_now([one(fast, "ip=192.0.2.2")])  # full again after 0.1 s
    store.check_now([one(slow, "ip=192.0.2.3")])
    clock.advance(1)
    assert store.check_now([one(slow, "ip=192.0.2.4")]).allowed
    assert evicted == []
    # The oldest drained bucket was kept: its client is still one token short of full.
    assert store.check_now([one(slow, "ip=192.0.2.1")]).remaining == (pytest.approx(0.0, abs=0.01),)


def test_the_least_recently_checked_bucket_is_evicted_and_its_client_starts_again_full(clock):
    evicted: list[int] = []
    store = capped(clock, 2, evicted)
    slow = limit("slow", "1/hour", 2)
    for ip in ("192.0.2.1", "192.0.2.2"):
        store.check_now([one(slow, f"ip={ip}")])
    store.check_now([one(slow, "ip=192.0.2.1")])  # checked again: now .2 is the least recent
    assert store.check_now([one(slow, "ip=192.0.2.1")]).allowed is False
    assert store.check_now([one(slow, "ip=192.0.2.3")]).allowed
    assert evicted == [1]
    # .1 was denied just now, so it is recent, and still limited; .2 lost its bucket.
    assert store.check_now([one(slow, "ip=192.0.2.1")]).allowed is False
    assert store.check_now([one(slow, "ip=192.0.2.2")]).remaining == (1.0,)


def test_a_denied_request_and_a_free_one_evict_nothing(clock):
    evicted: list[int] = []
    store = capped(clock, 1, evicted)
    slow = limit("slow", "1/hour", 1)
    store.check_now([one(slow, "ip=192.0.2.1")])
    assert store.check_now([one(slow, "ip=192.0.2.1")]).allowed is False
    assert store.check_now([one(slow, "ip=192.0.2.2", cost=0)]).allowed
    assert evicted == [] and len(store) == 1


def test_with_the_budget_held_by_live_leases_a_check_is_refused_whole_and_charges_nothing(clock):
    store = capped(clock, 2)
    conns = ConcurrencyLimit(name="conns", concurrency=5, lease_ttl=60.0, key=(), on_store_error=FailurePolicy.OPEN)
    held = [LeaseCheck(limit=conns, identity=f"ip=192.0.2.{n}", lease=f"lease-{n}") for n in (1, 2)]
    assert all(store.acquire_now(lease).admitted for lease in held)
    slow = limit("slow", "1/hour", 5)
    with pytest.raises(StoreFull):
        store.check_now([one(slow, "ip=192.0.2.9")])
    with pytest.raises(StoreFull):  # leases are requests in flight: never evicted for another
        store.acquire_now(LeaseCheck(limit=conns, identity="ip=192.0.2.3", lease="lease-3"))
    store.release_now(held[0])
    assert store.check_now([one(slow, "ip=192.0.2.9")]).remaining == (4.0,)  # nothing was charged before


def test_a_request_whose_limits_need_more_entries_than_the_budget_is_refused(clock):
    store = capped(clock, 1)
    a, b = limit("a", "1/hour", 5), limit("b", "1/hour", 5)
    with pytest.raises(StoreFull):
        store.check_now([one(a), one(b)])
    assert len(store) == 0
    assert store.check_now([one(a)]).remaining == (4.0,)


def test_evicted_buckets_leave_no_expiry_entries_behind(clock):
    store = capped(clock, 100, [])
    slow = limit("slow", "1/day", 5)
    for n in range(20_000):
        store.check_now([one(slow, f"ip=10.0.{n // 256}.{n % 256}")])
    assert len(store._buckets) == 100
    assert len(store._expiry) <= 2 * 100 + 64
