"""Settling a cost the response said (gateway.limiter.settlement), on both stores.

On the in-process store the limiter runs on an injected clock, so refunds, debt and the
refill past zero are asserted exactly. On a real redis-server (whose clock is its own) the
limit refills one token a year, so what a test reads is what was charged, to within a
millionth of a token; there the key's TTL is read too. A settlement the store fails is
retried and counted, or counted lost."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import AsyncIterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config.model import FailurePolicy, Limit
from gateway.limiter import bucket, settlement
from gateway.limiter.limiter import Limiter
from gateway.limiter.memory_store import MemoryStore
from gateway.limiter.outcomes import ALLOW, FAIL_LOCAL, FAIL_OPEN
from gateway.limiter.store import LimitCheck, StoreError, StoreNotConnected
from gateway.redis.scripts import load_script
from gateway.redis.store import RedisStore
from gateway.testing import config_from_yaml
from tests.helpers import store_config
from tests.lua_bridge import FakeRedis, LuaScript
from tests.processes import RedisServer, eventually

RESERVE = 10
BURST = 100


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def a_limit(rate: str) -> Limit:
    config = config_from_yaml(
        f"""
limits:
  tokens:
    rate: {rate}
    burst: {BURST}
    key: header:X-API-Key
    cost: {{from: "header:X-Usage-Units", reserve: {RESERVE}}}
routes:
  - match: {{path: /}}
    upstream: http://127.0.0.1:1
    limits: [tokens]
"""
    )
    assert config.routes[0].limits[0].cost == RESERVE
    return config.limits[0]


def reservation(limit: Limit, who: str) -> LimitCheck:
    return LimitCheck(limit=limit, identity=f"header:x-api-key={who}", cost=RESERVE)


async def reserve(limiter: Limiter, check: LimitCheck) -> str:
    decision = await limiter.check([check])
    return decision.statuses[0].outcome


async def tokens(limiter: Limiter, check: LimitCheck) -> float:
    return (await limiter.read_bucket(check.limit, check.identity)).tokens


async def test_less_than_reserved_goes_back_exactly_never_past_the_burst():
    clock = Clock()
    limiter = Limiter(MemoryStore(clock=clock), clock=clock)
    check = reservation(a_limit("1/second"), "k")
    assert await reserve(limiter, check) == ALLOW
    assert await tokens(limiter, check) == BURST - RESERVE
    assert await limiter.settlements.settle(check, ALLOW, 3) == 3
    assert await tokens(limiter, check) == BURST - 3
    # Given back as of the bucket's own stamp: 5 s of refill later, it is full, not over.
    other = reservation(check.limit, "other")
    await reserve(limiter, other)
    clock.now += 5
    await limiter.settlements.settle(other, ALLOW, 0)
    assert await tokens(limiter, other) == BURST


async def test_more_than_reserved_is_debt_refused_until_refilled_past_zero():
    clock = Clock()
    limiter = Limiter(MemoryStore(clock=clock), clock=clock)
    check = reservation(a_limit("1/second"), "k")
    await reserve(limiter, check)
    assert await limiter.settlements.settle(check, ALLOW, 150) == 150
    reading = await limiter.read_bucket(check.limit, check.identity)
    assert reading.tokens == BURST - 150  # 50 below zero
    assert reading.full_in == 150.0  # refilled from the debt at 1 a second
    refused = await limiter.check([check])
    assert not refused.allowed
    assert refused.retry_after == 60.0  # the 50 owed and the 10 to reserve
    clock.now += 59.999
    assert not (await limiter.check([check])).allowed
    clock.now += 0.001
    assert (await limiter.check([check])).allowed
    assert await tokens(limiter, check) == 0


async def test_a_reservation_that_charged_nothing_settles_nothing():
    clock = Clock()
    limiter = Limiter(MemoryStore(clock=clock), clock=clock)
    check = reservation(a_limit("1/second"), "k")
    assert await limiter.settlements.settle(check, FAIL_OPEN, 500) == 0
    assert not (await limiter.read_bucket(check.limit, check.identity)).held


async def not_connected(store: RedisStore) -> bool:
    """Whether the store knows it has no connection: a call sends nothing, and says so."""
    try:
        await store.check([LimitCheck(limit=a_limit("1/year"), identity="header:x-api-key=probe", cost=0)])
    except StoreNotConnected:
        return True
    except StoreError:
        return False
    return False


@pytest.fixture
async def redis_store() -> AsyncIterator[tuple[RedisServer, RedisStore]]:
    with RedisServer() as server:
        store = RedisStore(store_config(server.url, key_secret=None))
        await store.start()
        try:
            yield server, store
        finally:
            await store.close()


async def test_redis_refunds_and_debts_as_the_model_does(redis_store):
    server, store = redis_store
    limiter = Limiter(store, shared_store=True)
    check = reservation(a_limit("1/year"), "k")
    assert await reserve(limiter, check) == ALLOW
    await limiter.settlements.settle(check, ALLOW, 3)
    assert await tokens(limiter, check) == pytest.approx(BURST - 3, abs=1e-6)

    debtor = reservation(check.limit, "debtor")
    await reserve(limiter, debtor)
    await limiter.settlements.settle(debtor, ALLOW, 150)
    reading = await limiter.read_bucket(debtor.limit, debtor.identity)
    assert reading.tokens == pytest.approx(-50, abs=1e-6)
    # The key outlives the refill from its debt: 150 tokens at one a year.
    ttl_ms = server.client().pttl(reading.key)
    assert ttl_ms >= 150 * 365 * 86400 * 1000 - 1000
    refused = await limiter.check([debtor])
    assert not refused.allowed and refused.retry_after == pytest.approx(60 * 365 * 86400, rel=1e-6)


async def test_a_settlement_never_sent_is_retried_once_redis_is_back(redis_store):
    server, store = redis_store
    outcomes: list[str] = []
    limiter = Limiter(store, shared_store=True, on_settlement=outcomes.append)
    check = reservation(a_limit("1/year"), "k")
    await reserve(limiter, check)
    server.stop()  # down: once the store knows its connection is gone, nothing is sent
    try:
        await eventually(lambda: not_connected(store), what="the store to see Redis gone")
        assert await limiter.settlements.settle(check, ALLOW, 70) == RESERVE  # only the reservation, for now
        assert outcomes == [] and limiter.settlements.pending == 1
    finally:
        server.start()  # on the same port, empty: a restarted Redis without persistence
    await eventually(lambda: outcomes, what="the retried settlement")
    assert outcomes == [settlement.RETRIED]
    # Applied once, to the bucket the restart emptied: full, less the 60 more than reserved.
    assert await tokens(limiter, check) == pytest.approx(BURST - 60, abs=1e-6)


async def test_a_settlement_sent_and_not_answered_is_not_sent_again(redis_store):
    server, store = redis_store
    outcomes: list[str] = []
    limiter = Limiter(store, shared_store=True, on_settlement=outcomes.append)
    check = reservation(a_limit("1/year"), "k")
    await reserve(limiter, check)
    server.pause()  # slow, as an overloaded Redis is: the call times out, and Redis applies it later
    try:
        assert await limiter.settlements.settle(check, ALLOW, 70) == RESERVE
    finally:
        server.resume()
    assert outcomes == [settlement.UNCONFIRMED] and limiter.settlements.pending == 0
    # Applied once, by the Redis that woke up: a retry would have charged the 60 twice.
    await eventually(
        lambda: limiter.read_bucket(check.limit, check.identity), what="redis answering"
    )
    assert await tokens(limiter, check) == pytest.approx(BURST - 70, abs=1e-6)


async def test_a_settlement_not_made_within_the_bound_is_lost(redis_store, monkeypatch):
    monkeypatch.setattr(settlement, "RETRY_FOR", 0.3)  # the bound, shortened: 10 s in production
    server, store = redis_store
    outcomes: list[str] = []
    limiter = Limiter(store, shared_store=True, on_settlement=outcomes.append)
    check = reservation(a_limit("1/year"), "k")
    await reserve(limiter, check)
    server.stop()
    try:
        await eventually(lambda: not_connected(store), what="the store to see Redis gone")
        await limiter.settlements.settle(check, ALLOW, 70)
        await eventually(lambda: outcomes, what="the settlement given up")
    finally:
        server.start()
    assert outcomes == [settlement.LOST]
    readings = []

    async def read() -> bool:
        try:
            readings.append(await limiter.read_bucket(check.limit, check.identity))
        except StoreError:
            return False
        return True

    await eventually(read, what="redis back")
    assert not readings[0].held  # nothing reached the restarted Redis


def test_the_retry_bound_is_what_the_docs_say():
    pauses, pause, waited = 0, settlement.RETRY_FIRST, 0.0
    while waited + pause <= settlement.RETRY_FOR:
        waited, pauses, pause = waited + pause, pauses + 1, min(pause * 2, settlement.RETRY_MAX)
    assert math.isclose(settlement.RETRY_FOR, 10.0) and pauses >= 10 and waited <= 10.0


async def test_a_reservation_the_local_stand_in_took_settles_there():
    """`on_store_error: local`: Redis never answered, so the stand-in's share of the limit
    took the reservation, and the settlement goes to it, exactly, on the limiter's clock."""
    clock = Clock()
    dead = RedisServer()  # a free port, and nothing listening on it
    store = RedisStore(store_config(dead.url, key_secret=None))
    try:
        limiter = Limiter(store, shared_store=True, clock=clock)
        limit = dataclasses.replace(a_limit("1/second"), on_store_error=FailurePolicy.LOCAL)
        check = reservation(limit, "k")
        assert await reserve(limiter, check) == FAIL_LOCAL
        assert await limiter.settlements.settle(check, FAIL_LOCAL, 150) == 150
        refused = await limiter.check([check])
        assert refused.statuses[0].outcome == FAIL_LOCAL and not refused.allowed
        assert refused.retry_after == 60.0  # the 50 owed and the 10 to reserve, at 1 a second
        clock.now += 60
        assert (await limiter.check([check])).allowed
    finally:
        await store.close()


@settings(max_examples=150, derandomize=True, database=None, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.integers(0, 60_000), st.integers(0, 3 * BURST)),  # ms before the request; its actual cost
        min_size=1,
        max_size=25,
    )
)
def test_the_scripts_settle_as_the_model_does(steps):
    """Requests that reserve, then settle what they cost: `lua/token_bucket.lua` (a reservation,
    and an owed charge of more) and `lua/token_refund.lua` (less), run in Lua 5.1 on a clock
    the test sets, against gateway/limiter/bucket.py."""
    capacity, rate = float(BURST), 2.5  # tokens a second
    fake = FakeRedis()
    check_script, refund_script = LuaScript(load_script(), fake), LuaScript(load_script("token_refund.lua"), fake)
    args = (str(capacity), str(rate))
    state: bucket.BucketState | None = None
    now_ms = 10_000_000
    for wait_ms, actual in steps:
        now_ms += wait_ms
        fake.set_clock(now_ms * 1000)
        now = now_ms / 1000
        spec = bucket.BucketSpec(capacity=capacity, rate=rate, cost=RESERVE)
        outcome = bucket.check([state], [spec], now)
        reply = check_script(["k"], ["b", *args, str(RESERVE), "0"])
        assert bool(reply[0]) == outcome.allowed
        if not outcome.allowed:
            continue
        state = outcome.states[0]  # type: ignore[assignment]
        delta = actual - RESERVE
        if delta > 0:
            owed = bucket.BucketSpec(capacity=capacity, rate=rate, cost=delta, owed=True)
            state = bucket.check([state], [owed], now).states[0]  # type: ignore[assignment]
            check_script(["k"], ["B", *args, str(delta), "0"])
        elif delta < 0:
            assert state is not None
            state = bucket.refunded(state, capacity, -delta)
            refund_script(["k"], [str(capacity), str(-delta)])
        assert state is not None
        held = fake.hashes["k"]
        assert float(held["tokens"]) == pytest.approx(state.tokens, abs=1e-9 * capacity)
        assert float(held["ts"]) == pytest.approx(state.stamp * 1000, abs=1e-6)
        # The key outlives the refill from wherever the bucket stands, its debt included.
        assert fake.deadlines["k"] >= now_ms + (capacity - min(state.tokens, 0.0)) / rate * 1000 - 1
