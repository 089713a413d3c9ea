"""Leases (`lease: N`): the model (`bucket.lease`), the exact text of
lua/token_lease.lua held to it in Lua 5.1 (lupa) and run once on a real Redis,
the per-process lease book (`gateway.limiter.token_leases`), and the limiter against
a real redis-server: one script call per N requests, concurrent requests
sharing one refill, a leased limit that another limit denies getting its
token back locally, and what a lease cannot keep going back to Redis without
the denial waiting for it. The fleet of gateway processes is tests/load/test_token_leases_fleet.py."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config import ConfigError
from gateway.config.model import FailurePolicy, IdentitySource, Limit
from gateway.config.units import Rate
from gateway.limiter import bucket
from gateway.limiter.limiter import Limiter
from gateway.limiter.outcomes import ALLOW, DENY, SKIPPED
from gateway.limiter.store import LimitCheck
from gateway.limiter.token_leases import Leases
from gateway.redis.scripts import TOKEN_LEASE_SCRIPT_NAME, load_script
from gateway.testing import config_from_yaml
from tests.chaos_proxy import ChaosProxy
from tests.helpers import redis_store, script_calls
from tests.lua_bridge import FakeRedis, LuaScript
from tests.model_check import TOLERANCE
from tests.processes import eventually

pytestmark = pytest.mark.timing  # measures time, load or memory: one such module runs at a time

LEASE_SCRIPT = load_script(TOKEN_LEASE_SCRIPT_NAME)


def limit(name: str = "hot", *, per_second: float = 1.0, burst: float = 100, lease: int = 0, lapse: float = 1.0) -> Limit:
    return Limit(
        name=name,
        rate=Rate(tokens=per_second, period_seconds=1.0, text=f"{per_second}/second"),
        burst=burst,
        key=(IdentitySource(kind="ip"),),
        on_store_error=FailurePolicy.OPEN,
        lease=lease,
        lease_lapse=lapse,
    )


# --- the model ---------------------------------------------------------------------------

states = st.one_of(
    st.none(),
    st.builds(bucket.BucketState, tokens=st.floats(0, 50), stamp=st.floats(0, 100)),
)
specs = st.builds(
    bucket.BucketSpec,
    capacity=st.integers(1, 50).map(float),
    rate=st.sampled_from([0.01, 0.5, 1.0, 7.0, 1000.0]),
    cost=st.integers(0, 51).map(float),
)


@settings(max_examples=300, derandomize=True, database=None)
@given(state=states, spec=specs, now=st.floats(0, 200))
def test_a_lease_of_the_cost_alone_is_a_check_of_that_bucket(state, spec, now):
    leased = bucket.lease(state, spec, int(spec.cost), now)
    checked = bucket.check([state], [spec], now)
    assert (leased.allowed, leased.remaining, leased.retry_after) == (checked.allowed, checked.remaining[0], checked.retry_after)
    assert leased.state == checked.states[0]
    assert leased.granted == (spec.cost if checked.allowed else 0)


@settings(max_examples=300, derandomize=True, database=None)
@given(state=states, spec=specs, want=st.integers(0, 60), now=st.floats(0, 200))
def test_a_lease_takes_the_whole_tokens_wanted_or_held_and_never_less_than_the_cost(state, spec, want, now):
    found = bucket.refill(state, spec, now).tokens
    leased = bucket.lease(state, spec, want, now)
    assert leased.allowed == (found >= spec.cost)
    if leased.allowed:
        assert leased.granted == max(spec.cost, min(want, math.floor(found)))
        assert leased.remaining == found - leased.granted >= 0
    else:
        assert leased.granted == 0 and leased.remaining == found


# --- the script against the model --------------------------------------------------------


@settings(max_examples=200, derandomize=True, database=None, deadline=None)
@given(
    capacity=st.integers(1, 1000),
    rate=st.sampled_from([1e-3, 0.5, 1.0, 3.0, 50.0, 1e4]),
    steps=st.lists(
        st.tuples(st.integers(-2_000_000, 5_000_000), st.integers(0, 30), st.integers(0, 40)), min_size=1, max_size=25
    ),
)
def test_the_lease_script_makes_the_models_decision_from_every_state(capacity, rate, steps):
    """Each call is held to the model run on the state the script had stored, in the
    script's units (ms, and the rate per ms, as tests/model_check.py does)."""
    redis = FakeRedis()
    script = LuaScript(LEASE_SCRIPT, redis)
    clock = 1_700_000_000 * 1_000_000
    ties = 0
    for step, cost, extra in steps:
        clock = max(0, clock + step)
        redis.set_clock(clock)
        now = float(redis.seconds) * 1000 + float(redis.microseconds) / 1000
        held = redis._live("k")
        state = bucket.BucketState(float(held["tokens"]), float(held["ts"])) if held else None
        spec = bucket.BucketSpec(capacity=float(capacity), rate=rate / 1000, cost=float(cost))
        want = cost + extra
        model = bucket.lease(state, spec, want, now)
        allowed, granted, remaining, retry_ms = script(["k"], [repr(float(capacity)), repr(rate), str(cost), str(want)])
        found = bucket.refill(state, spec, now).tokens
        bound = TOLERANCE * max(1.0, capacity)
        near_whole = abs(found - round(found)) <= bound
        if near_whole and (bool(allowed) != model.allowed or granted != model.granted):
            ties += 1  # the cost, or the whole tokens, sit on a rounding tie
            continue
        assert bool(allowed) == model.allowed
        assert granted == model.granted
        assert abs(float(remaining) - model.remaining) <= bound
        if allowed and granted:
            stored = redis.hashes["k"]
            assert float(stored["tokens"]) == float(remaining)
            assert float(stored["ts"]) == model.state.stamp
            # The TTL covers a full refill, as token_bucket.lua's does.
            assert redis.deadlines["k"] - redis.milliseconds >= (capacity - model.remaining) / spec.rate
        elif not allowed:
            expected = -1 if cost > capacity else model.retry_after
            assert retry_ms == expected or abs(retry_ms - math.ceil(expected)) <= 1
    assert ties <= 1


async def test_the_lease_script_runs_on_a_real_redis_with_its_time_and_a_ttl(redis_server):
    client = redis_server.client()
    allowed, granted, remaining, retry_ms = client.eval(LEASE_SCRIPT, 1, "rl:hot:{x}", "10.0", "1.0", "1", "4")
    assert (allowed, granted, float(remaining), retry_ms) == (1, 4, 6.0, 0)
    assert 0 < client.pttl("rl:hot:{x}") <= 11_000
    allowed, granted, remaining, _ = client.eval(LEASE_SCRIPT, 1, "rl:hot:{x}", "10.0", "1.0", "1", "40")
    assert (allowed, granted) == (1, 6) and 0 <= float(remaining) < 1
    allowed, granted, _, retry_ms = client.eval(LEASE_SCRIPT, 1, "rl:hot:{x}", "10.0", "1.0", "1", "40")
    assert (allowed, granted) == (0, 0) and 0 < retry_ms <= 1000



def test_a_denied_lease_keeps_its_bucket_until_full_at_the_rate_it_was_checked_at():
    """As lua/token_bucket.lua does: after a reload lowered 10/second to 1/hour, a denied
    key must not expire at the 3 s its last grant set and come back full."""
    redis = FakeRedis()
    script = LuaScript(LEASE_SCRIPT, redis)
    redis.set_clock(1_700_000_000 * 1_000_000)
    assert script(["k"], ["20.0", "10.0", "1", "20"])[:2] == [1, 20]
    assert redis.deadlines["k"] == redis.milliseconds + 3000
    held = dict(redis.hashes["k"])
    allowed, _, remaining, _ = script(["k"], ["20.0", str(1 / 3600), "1", "20"])
    assert allowed == 0 and float(remaining) == 0
    assert redis.deadlines["k"] == redis.milliseconds + 20 * 3600 * 1000 + 1000
    assert redis.hashes["k"] == held  # no token written

# --- the lease book ----------------------------------------------------------------------


def test_a_lease_is_spent_then_lapses_and_a_denied_requests_cost_comes_back():
    leases = Leases()
    hot = limit(lease=5, lapse=1.0)
    check = LimitCheck(limit=hot, identity="ip=1", cost=2)
    assert leases.take(check, now=0.0) is None
    leases.grant(check, tokens=4, remaining=50.0, now=0.0)
    assert leases.take(check, now=0.5) == 52.0
    assert leases.take(check, now=0.5) == 50.0
    assert leases.take(check, now=0.5) is None  # empty: the store is asked
    leases.give_back(check, now=0.6)
    assert leases.unspent(check) == 2
    assert leases.take(check, now=1.0) is None  # lapsed at 1.0
    assert leases.unspent(check) == 0
    leases.give_back(check, now=1.1)  # nothing to give back to
    assert leases.take(check, now=1.1) is None


def test_a_lease_keeps_at_most_n_of_the_tokens_given_back_and_returns_the_rest():
    """Three requests took the lease's tokens, and a fourth, finding it empty, refilled it;
    the other limit then denies all four. The lease keeps 5 (its N); 2 go back to the store."""
    leases = Leases()
    hot = limit(lease=5, lapse=1.0)
    check = LimitCheck(limit=hot, identity="ip=1", cost=1)
    leases.grant(check, tokens=3, remaining=50.0, now=0.0)
    for _ in range(3):
        assert leases.take(check, now=0.1) is not None
    leases.grant(check, tokens=4, remaining=45.0, now=0.2)  # 5 leased, 1 for the fourth request
    assert [leases.give_back(check, now=0.3) for _ in range(4)] == [0, 1, 1, 1]
    assert leases.unspent(check) == 5


def test_a_lease_of_a_changed_limit_is_never_spent_and_one_of_an_unchanged_limit_is():
    leases = Leases()
    old, changed = limit(lease=5), limit(lease=5, burst=50)
    leases.grant(LimitCheck(limit=old, identity="ip=1", cost=1), tokens=4, remaining=0.0, now=0.0)
    assert leases.take(LimitCheck(limit=changed, identity="ip=1", cost=1), now=0.1) is None
    assert leases.unspent(LimitCheck(limit=old, identity="ip=1", cost=1)) == 0  # dropped
    leases.grant(LimitCheck(limit=old, identity="ip=2", cost=1), tokens=4, remaining=0.0, now=0.0)
    reloaded = limit(lease=5)  # equal, but another object: what a reload that left it alone makes
    assert reloaded is not old
    assert leases.take(LimitCheck(limit=reloaded, identity="ip=2", cost=1), now=0.1) == 3
    assert leases.unspent(LimitCheck(limit=reloaded, identity="ip=2", cost=1)) == 3


def test_unspent_tokens_carry_into_the_next_grant_and_the_book_is_bounded():
    leases = Leases(max_entries=3)
    hot = limit(lease=5)
    check = LimitCheck(limit=hot, identity="ip=1", cost=1)
    leases.grant(check, tokens=1, remaining=9.0, now=0.0)
    leases.grant(check, tokens=4, remaining=5.0, now=0.5)
    assert leases.unspent(check) == 5
    for i in range(2, 6):
        leases.grant(LimitCheck(limit=hot, identity=f"ip={i}", cost=1), tokens=1, remaining=0.0, now=0.6)
    assert len(leases) == 3 and leases.unspent(check) == 0  # the oldest went first
    later = LimitCheck(limit=hot, identity="ip=9", cost=1)
    leases.grant(later, tokens=1, remaining=0.0, now=5.0)  # the lapsed ones are dropped
    assert len(leases) == 1


# --- the config --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("store", "spec", "message"),
    [
        ("", "lease: 5", "<test>: limits.hot.lease: a lease takes tokens from a shared store"),
        ("store: {url: 'redis://127.0.0.1:1'}", "lease: 11", "<test>: limits.hot.lease: a lease of 11 is more than the burst 10"),
        ("store: {url: 'redis://127.0.0.1:1'}", "lease: 0", "<test>: limits.hot.lease: expected an integer >= 1"),
        ("store: {url: 'redis://127.0.0.1:1'}", "lease_lapse: 1s", "<test>: limits.hot.lease_lapse: applies to a `lease`"),
        ("store: {url: 'redis://127.0.0.1:1'}", "lease: 5, lease_lapse: 0s", "<test>: limits.hot.lease_lapse: expected a duration greater than zero"),
    ],
)
def test_a_bad_lease_is_one_line_naming_its_yaml_path(store, spec, message):
    with pytest.raises(ConfigError) as raised:
        config_from_yaml(f"{store}\nlimits:\n  hot: {{rate: 1/second, burst: 10, {spec}}}\nroutes:\n  - {{match: {{path: /}}, upstream: 'http://x', limits: [hot]}}\n")
    assert str(raised.value).startswith(message)


# --- the limiter against a real Redis ----------------------------------------------------


@pytest.fixture
async def redis_limiter(redis_server):
    async with redis_store(redis_server.url) as store:
        yield Limiter(store, shared_store=True), redis_server.client()


async def test_one_script_call_per_lease_and_the_store_denies_when_it_runs_dry(redis_limiter):
    limiter, client = redis_limiter
    hot = limit(burst=10, per_second=1e-3, lease=5)
    check = [LimitCheck(limit=hot, identity="ip=1", cost=1)]
    decisions = [await limiter.check(check) for _ in range(12)]
    assert [d.allowed for d in decisions] == [True] * 10 + [False] * 2
    assert [d.statuses[0].remaining for d in decisions[:6]] == pytest.approx([9, 8, 7, 6, 5, 4], abs=0.01)
    # Two leases of 5; the second left the bucket empty, so the denials are the store's, cached.
    assert script_calls(client) == 2
    assert decisions[10].statuses[0].outcome == DENY


async def test_concurrent_requests_share_one_refill_at_a_time(redis_limiter):
    limiter, client = redis_limiter
    hot = limit(burst=1000, per_second=1e-3, lease=20)
    check = [LimitCheck(limit=hot, identity="ip=1", cost=1)]
    decisions = await asyncio.gather(*(limiter.check(check) for _ in range(200)))
    assert all(d.allowed for d in decisions)
    assert script_calls(client) == 10
    assert float(client.hget(next(client.scan_iter("rl:hot:*")), "tokens")) == pytest.approx(800, abs=0.01)


async def test_a_leased_limit_that_another_denies_gets_its_token_back_locally(redis_limiter):
    limiter, client = redis_limiter
    hot = limit(burst=100, per_second=1e-3, lease=10)
    tight = limit("tight", burst=1, per_second=1e-3)
    checks = [LimitCheck(limit=hot, identity="ip=1", cost=1), LimitCheck(limit=tight, identity="ip=1", cost=1)]
    first = await limiter.check(checks)
    assert first.allowed and [s.outcome for s in first.statuses] == [ALLOW, ALLOW]
    for _ in range(5):
        denied = await limiter.check(checks)
        assert not denied.allowed
        assert [s.outcome for s in denied.statuses] == [SKIPPED, DENY]
    assert limiter.leases.unspent(checks[0]) == 9  # 10 leased, 1 spent by the one request allowed
    # The store holds what the one lease took, and nothing more was charged.
    assert float(client.hget(next(client.scan_iter("rl:hot:*")), "tokens")) == pytest.approx(90, abs=0.01)
    alone = await limiter.check(checks[:1])
    assert alone.allowed and alone.statuses[0].remaining == pytest.approx(98, abs=0.01)
    assert limiter.leases.unspent(checks[0]) == 8


async def test_a_reset_drops_the_lease(redis_limiter):
    limiter, _ = redis_limiter
    hot = limit(burst=10, per_second=1e-3, lease=5)
    check = LimitCheck(limit=hot, identity="ip=1", cost=1)
    assert (await limiter.check([check])).allowed
    assert limiter.leases.unspent(check) == 4
    assert await limiter.reset_bucket(hot, "ip=1")
    assert limiter.leases.unspent(check) == 0
    assert (await limiter.check([dataclasses.replace(check)])).statuses[0].remaining == pytest.approx(9, abs=0.01)


async def test_requests_waiting_on_a_refill_the_store_failed_take_their_policy_at_once(redis_server):
    """A hung Redis: twenty concurrent requests share one refill, and its timeout, instead
    of each sending a refill of its own and queueing twenty timeouts one after another."""
    async with redis_store(redis_server.url, timeout=0.1) as store:
        limiter = Limiter(store, shared_store=True)
        hot = limit(burst=100, per_second=1e-3, lease=5)
        check = [LimitCheck(limit=hot, identity="ip=1", cost=1)]
        refills = []
        lease = store.lease

        async def counted_lease(*args, **kwargs):  # the real store's call, counted
            refills.append(args)
            return await lease(*args, **kwargs)

        store.lease = counted_lease  # type: ignore[method-assign]
        redis_server.pause()
        try:
            decisions = await asyncio.gather(*(limiter.check(check) for _ in range(20)))
        finally:
            redis_server.resume()
    assert [d.statuses[0].outcome for d in decisions] == ["fail_open"] * 20
    assert len(refills) == 1, f"{len(refills)} refills sent: the waiters each waited out a timeout"


async def test_a_denial_never_waits_for_the_tokens_its_lease_gives_back_to_the_store(redis_server):
    """Ten requests take a leased limit's tokens, one of them refilling the lease while the
    others hold theirs, and another limit denies them all: the lease gives what it cannot
    keep back to Redis. With every round trip 100 ms long, every denial is answered while
    that refund is still on its way; they used to wait for it, a round trip more (and with
    Redis slow or gone, a store timeout on top of each such 429).
    The refund still reaches Redis: its bucket and the lease add up to all but the one
    token spent."""
    with ChaosProxy(redis_server.port) as proxy:
        async with redis_store(proxy.url) as store:
            limiter = Limiter(store, shared_store=True)
            hot = limit(burst=1000, per_second=1e-3, lease=5)
            tight = limit("tight", burst=1, per_second=1e-3)
            leased, denying = LimitCheck(limit=hot, identity="ip=1", cost=1), LimitCheck(limit=tight, identity="ip=2", cost=1)
            assert (await limiter.check([leased])).allowed  # the lease holds 4
            # Emptied behind the limiter's back, so its denial comes from Redis, one round trip away.
            assert (await store.check([denying])).allowed
            await asyncio.to_thread(proxy.set_mode, "delay", 100)
            answers = await asyncio.gather(*(limiter.check([leased, denying]) for _ in range(10)))
            # Every denial is answered while the refund is still on its way: none waited for it.
            refunds_in_flight = len(limiter._refunds)
            await asyncio.to_thread(proxy.set_mode, "pass")
            assert not any(answer.allowed for answer in answers)
            assert refunds_in_flight >= 1
            assert limiter.leases.unspent(leased) == 5
            client = redis_server.client()
            key = next(client.scan_iter("rl:hot:*"))
            await eventually(
                lambda: abs(float(client.hget(key, "tokens")) + 5 - 999) < 0.05, what="the excess to be given back to Redis"
            )
