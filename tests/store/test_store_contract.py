"""One contract, two stores: the in-process MemoryStore and the RedisStore on a real
redis-server answer the same checks the same way through the Store interface.

Both run on real clocks here (time.monotonic and Redis's TIME), so limits that
should not refill during a test use slow rates, and refill is observed by
polling with cost-0 checks, which read a bucket without charging it.
"""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from gateway.limiter.store import LimitCheck, Store, StoreDecision
from gateway.testing import config_from_yaml
from tests.helpers import open_store
from tests.processes import RedisServer

LIMITS_YAML = """
limits:
  per-ip:     {rate: 1/hour, burst: 10, key: ip}
  per-key:    {rate: 1/hour, burst: 2, key: "header:x-api-key"}
  per-minute: {rate: 6/minute, burst: 3}
  tiny:       {rate: 1/hour, burst: 1}
  fast:       {rate: 10/second, burst: 2}
  one-a-hour: {rate: 1/hour, burst: 5}
  shaped:     {rate: 6/minute, burst: 1, mode: delay, max_delay: 30s}
  daily:      {quota: {limit: 2, per: day}}
routes:
  - match: {path: /}
    upstream: http://127.0.0.1:1
"""
LIMITS = {limit.name: limit for limit in config_from_yaml(LIMITS_YAML).limits}
# How far a slow limit can refill while a test runs: 1/hour for a few seconds.
DRIFT = 0.01
# Between polls of a refilling bucket, so the in-process store's loop does not spin a core.
POLL_INTERVAL = 0.002


def check(name: str, identity: str = "ip=192.0.2.1", cost: int = 1) -> LimitCheck:
    return LimitCheck(limit=LIMITS[name], identity=identity, cost=cost, max_delay=LIMITS[name].max_delay)


@pytest.fixture(scope="module")
def redis_for_contract():
    with RedisServer() as server:
        yield server


@pytest.fixture(params=["memory", "redis"])
async def store(request):
    url = None
    if request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis_for_contract")
        with server.client() as client:
            client.flushall()
        url = server.url
    async with open_store(url, key_secret=None) as opened:
        yield opened


def approx(*values: float):
    return pytest.approx(values, abs=DRIFT)


async def test_a_burst_is_served_then_denied(store: Store):
    remaining = [(await store.check([check("per-ip")])).remaining[0] for _ in range(10)]
    assert remaining == pytest.approx([9, 8, 7, 6, 5, 4, 3, 2, 1, 0], abs=DRIFT)
    for _ in range(3):
        denied = await store.check([check("per-ip")])
        assert not denied.allowed
        assert denied.remaining == approx(0)


async def test_a_denied_client_is_told_how_long_to_wait(store: Store):
    for _ in range(3):
        assert (await store.check([check("per-minute")])).allowed  # 6/minute: a token every 10 s
    denied = await store.check([check("per-minute", cost=2)])
    assert not denied.allowed
    # 2 tokens at 0.1 a second, less the little that refilled while the test ran.
    assert denied.retry_after == pytest.approx(20.0, abs=0.5)
    assert (await store.check([check("per-minute")])).retry_after > 0
    assert (await store.check([check("per-minute", cost=0)])).retry_after == 0


async def test_retry_after_is_the_wait_for_the_slowest_of_several_limits(store: Store):
    request = [check("per-minute", cost=3), check("tiny")]
    assert (await store.check(request)).allowed
    denied = await store.check(request)
    assert not denied.allowed
    # per-minute needs 30 s for 3 tokens; tiny needs an hour for 1.
    assert denied.retry_after == pytest.approx(3600.0, abs=0.5)


async def test_allowed_decisions_say_retry_after_zero(store: Store):
    decision = await store.check([check("per-ip"), check("per-minute")])
    assert isinstance(decision, StoreDecision)
    assert decision.allowed and decision.retry_after == 0


async def test_buckets_refill_over_time_at_the_limit_rate(store: Store):
    # Read before the bucket is emptied: the refill runs from a moment no earlier than this.
    emptied_at = time.monotonic()
    assert (await store.check([check("fast", cost=2)])).allowed  # 10/second: a token every 100 ms
    first = await store.check([check("fast", cost=0)])
    assert first.remaining[0] < 1
    # Poll without charging until one token is back.
    while (await store.check([check("fast", cost=0)])).remaining[0] < 1:
        assert time.monotonic() - emptied_at < 5, "the bucket never refilled"
        await asyncio.sleep(POLL_INTERVAL)
    # Not sooner than the rate allows (the deficit at the first read, at 10 tokens a second,
    # which came after `emptied_at`).
    assert time.monotonic() - emptied_at >= (1 - first.remaining[0]) / 10
    assert (await store.check([check("fast")])).allowed
    # It fills up to its burst and, over two more token-times, never past it.
    while (await store.check([check("fast", cost=0)])).remaining[0] < 2:
        assert time.monotonic() - emptied_at < 5, "the bucket never filled"
        await asyncio.sleep(POLL_INTERVAL)
    full_at = time.monotonic()
    while time.monotonic() - full_at < 0.1:
        assert (await store.check([check("fast", cost=0)])).remaining[0] <= 2
        await asyncio.sleep(POLL_INTERVAL)
    assert (await store.check([check("fast", cost=2)])).allowed


async def test_several_limits_on_different_identities_are_all_or_nothing(store: Store):
    request = [check("per-ip", "ip=203.0.113.5"), check("per-key", "header:x-api-key=alpha")]
    assert (await store.check(request)).remaining == approx(9, 1)
    assert (await store.check(request)).remaining == approx(8, 0)
    for _ in range(3):
        denied = await store.check(request)
        assert not denied.allowed
        assert denied.remaining == approx(8, 0)
    # The address's bucket was not charged by the denied requests...
    assert (await store.check([check("per-ip", "ip=203.0.113.5")])).remaining == approx(7)
    # ...and another API key from the same address is counted on its own.
    other = await store.check([check("per-ip", "ip=203.0.113.5"), check("per-key", "header:x-api-key=beta")])
    assert other.allowed and other.remaining == approx(6, 1)


async def test_identities_and_limits_have_separate_buckets(store: Store):
    assert (await store.check([check("tiny", "ip=192.0.2.10")])).allowed
    assert not (await store.check([check("tiny", "ip=192.0.2.10")])).allowed
    assert (await store.check([check("tiny", "ip=192.0.2.11")])).allowed
    assert (await store.check([check("one-a-hour", "ip=192.0.2.10")])).remaining == approx(4)


async def test_cost_zero_is_allowed_even_when_empty_and_charges_nothing(store: Store):
    fresh = await store.check([check("tiny", cost=0)])
    assert fresh.allowed and fresh.remaining == approx(1)
    assert (await store.check([check("tiny")])).allowed
    for _ in range(3):
        empty = await store.check([check("tiny", cost=0)])
        assert empty.allowed and empty.remaining == approx(0) and empty.retry_after == 0
    # Beside a limit that denies, a cost-0 limit does not make the request pass.
    assert not (await store.check([check("per-ip", cost=0), check("tiny")])).allowed


async def test_a_cost_above_the_burst_can_never_pass_and_charges_nothing(store: Store):
    denied = await store.check([check("per-ip", cost=1), check("one-a-hour", cost=6)])
    assert not denied.allowed
    assert denied.retry_after == math.inf
    assert denied.remaining == approx(10, 5)
    assert (await store.check([check("per-ip", cost=10)])).remaining == approx(0)


async def test_remaining_is_reported_per_limit_in_order(store: Store):
    request = [check("per-ip", cost=3), check("one-a-hour", cost=2), check("per-minute", cost=1)]
    assert (await store.check(request)).remaining == approx(7, 3, 2)
    decision = await store.check([check("per-minute", cost=2), check("per-ip", cost=0)])
    assert decision.allowed
    assert decision.remaining == pytest.approx((0, 7), abs=0.1)  # 6/minute refills 0.1 in a second


async def test_a_bucket_is_read_without_charging_it_and_deleted_back_to_full(store: Store):
    limit = LIMITS["per-ip"]
    fresh = await store.read(limit, "ip=192.0.2.1")
    assert (fresh.held, fresh.tokens, fresh.full_in) == (False, 10, 0)
    for _ in range(3):
        await store.check([check("per-ip")])
    for _ in range(2):  # reading twice charges nothing
        held = await store.read(limit, "ip=192.0.2.1")
        assert held.held is True and held.tokens == pytest.approx(7, abs=DRIFT)
        assert held.full_in == pytest.approx(3 * 3600, abs=60)
    other = await store.read(LIMITS["per-key"], "ip=192.0.2.1")  # another limit, same identity
    assert other.held is False and other.key != held.key
    assert await store.delete(limit, "ip=192.0.2.1") is True
    assert await store.delete(limit, "ip=192.0.2.1") is False
    assert (await store.read(limit, "ip=192.0.2.1")).held is False
    assert (await store.check([check("per-ip")])).remaining == approx(9)


async def test_a_shaping_bucket_owes_up_to_max_delay_and_each_wait_is_ten_seconds_longer(store: Store):
    """6/minute, burst 1, max_delay 30 s (a debt of 3 tokens): one at once, three waiting
    about 10, 20 and 30 s, then denied until the debt would cover it again, 10 s on; a
    check that may not wait (max_delay 0) is denied outright."""
    answers = [await store.check([check("shaped")]) for _ in range(5)]
    assert [a.allowed for a in answers] == [True, True, True, True, False]
    assert [a.wait for a in answers] == pytest.approx([0, 10, 20, 30, 0], abs=0.1)
    assert answers[4].remaining == pytest.approx((-3,), abs=0.05)
    assert answers[4].retry_after == pytest.approx(10, abs=0.1)
    other = LimitCheck(limit=LIMITS["shaped"], identity="ip=192.0.2.9", cost=1)
    assert (await store.check([other])).allowed and not (await store.check([other])).allowed


async def test_a_quota_and_a_bucket_are_all_or_nothing_and_the_quota_resets_with_the_utc_day(store: Store):
    pair = [check("tiny", identity="ip=192.0.2.2"), check("daily", identity="ip=192.0.2.2")]
    first = await store.check([check("daily", identity="ip=192.0.2.2")])
    both = await store.check(pair)
    spent = await store.check([check("one-a-hour", identity="ip=192.0.2.2"), check("daily", identity="ip=192.0.2.2")])
    assert (first.allowed, both.allowed, spent.allowed) == (True, True, False)
    assert both.remaining == approx(0, 0)
    assert spent.remaining == approx(5, 0)  # the bucket was not charged for the spent quota
    to_midnight = 86400 - time.time() % 86400
    assert spent.retry_after == pytest.approx(to_midnight, abs=2) and spent.resets[1] == pytest.approx(to_midnight, abs=2)
    assert spent.resets[0] is None
    # And the other way round: the empty bucket keeps a fresh quota from being charged.
    tiny_empty = await store.check([check("tiny", identity="ip=192.0.2.2"), check("daily", identity="ip=192.0.2.3")])
    assert not tiny_empty.allowed and tiny_empty.remaining == approx(0, 2)
    assert (await store.check([check("daily", identity="ip=192.0.2.3")])).remaining == approx(1)


async def test_an_owed_charge_is_taken_past_zero_and_the_next_read_is_refused_until_repaid(store: Store):
    """Envoy's charge after the response on both carriers: a read (cost 0) passes, the hits
    after it are taken even past what is left, and reads are refused until the debt is
    repaid; the other limit of a refused request is not charged, the owed one is."""

    def owed(name: str, cost: int, identity: str = "ip=192.0.2.20") -> LimitCheck:
        return LimitCheck(limit=LIMITS[name], identity=identity, cost=cost, owed=True)

    assert (await store.check([owed("one-a-hour", 0)])).allowed
    taken = await store.check([owed("one-a-hour", 8)])  # 5 held: 3 owed
    assert not taken.allowed and taken.remaining == approx(-3)
    assert taken.retry_after == pytest.approx(3 * 3600, abs=60)  # until a read passes: 3 tokens at 1/hour
    read = await store.check([owed("one-a-hour", 0)])
    assert not read.allowed and read.remaining == approx(-3)
    again = await store.check([owed("one-a-hour", 1), check("per-ip", "ip=192.0.2.20")])
    assert not again.allowed and again.remaining == approx(-4, 10)  # owed taken, per-ip untouched
    assert (await store.check([check("per-ip", "ip=192.0.2.20")])).remaining == approx(9)
    held = await store.read(LIMITS["one-a-hour"], "ip=192.0.2.20")
    assert held.tokens == pytest.approx(-4, abs=DRIFT) and held.full_in == pytest.approx(9 * 3600, abs=60)


async def test_a_bucket_in_debt_outlives_its_debt_in_redis(redis_for_contract):
    """The key's TTL covers the refill from the debt back to full, so Redis never forgets a
    bucket that still owes."""
    with redis_for_contract.client() as client:
        client.flushall()
    async with open_store(redis_for_contract.url, key_secret=None) as redis_store:
        charge = LimitCheck(limit=LIMITS["one-a-hour"], identity="ip=192.0.2.21", cost=20, owed=True)
        assert (await redis_store.check([charge])).remaining == approx(-15)
        with redis_for_contract.client() as client:
            (key,) = client.keys("*one-a-hour*")
            ttl = client.pttl(key) / 1000
    assert ttl >= 20 * 3600 - 60  # from -15 back to 5, at 1 an hour
