"""The denial cache and client waves: exact by construction, and shown to be.

The pure parts run on their own; then three limiters, each with its own
connection and cache, share one real Redis under random traffic, and every
time a cache would answer a request, Redis is asked (without charging) whether
it would have allowed it. It never would have."""

from __future__ import annotations

import asyncio
import collections
import gc
import random
import time

import pytest

from gateway.config.model import Limit
from gateway.limiter import denial_cache
from gateway.limiter.client_waves import ClientWaves, Wave
from gateway.limiter.denial_cache import DenialCache, could_pass_in, held_until
from gateway.limiter.keys import bucket_key, identity_digest
from gateway.limiter.limiter import Limiter
from gateway.limiter.store import LimitCheck, StoreError
from gateway.redis.secret import SECRET_KEY_SUFFIX
from gateway.redis.store import RedisStore
from gateway.testing import config_from_yaml
from tests.helpers import store_config

pytestmark = pytest.mark.timing  # measures time, load or memory: one such module runs at a time


def limit(rate: str = "10/second", burst: int = 5, name: str = "per_client", shape: str = "") -> Limit:
    """`shape`: more of the limit's YAML, such as `mode: delay, max_delay: 500ms`, or a quota instead of a rate."""
    body = shape if shape.startswith("quota") else f"rate: {rate}, burst: {burst}" + (f", {shape}" if shape else "")
    config = config_from_yaml(
        f"limits:\n  {name}: {{{body}, key: header:X-API-Key}}\n"
        f"routes:\n  - match: {{path: /}}\n    upstream: http://127.0.0.1:1\n    limits: [{name}]\n"
    )
    return config.limits[0]


def test_a_denial_lasts_until_the_missing_tokens_refill_less_the_margins():
    per_client = limit(rate="10/second")
    wait = could_pass_in(remaining=0.5, limit=per_client, cost=2)
    assert wait == pytest.approx(1.5 / 10)
    until = held_until(100.0, wait)
    exact = 100.0 + 1.5 / 10
    assert exact - 0.002 < until < exact
    assert until == pytest.approx(exact * 1 - 0.15 * denial_cache.CLOCK_RATE_MARGIN - denial_cache.ROUNDING_MARGIN)


def test_a_shaping_limit_is_denied_only_past_its_debt_and_that_much_shorter():
    """10/s with max_delay 500 ms may owe 5 tokens: a bucket at -4 admits a request of
    cost 1 (after a wait), so nothing is cached; at -5.5 the denial ends when the bucket
    is back at -4, 0.15 s on, not when it could pay outright, 0.65 s on."""
    shaping = limit(rate="10/second", shape="mode: delay, max_delay: 500ms")
    cache = DenialCache()
    cache.record(LimitCheck(shaping, "k", 1), remaining=-4.0, sent_at=100.0)
    assert len(cache) == 0
    cache.record(LimitCheck(shaping, "k", 1), remaining=-5.5, sent_at=100.0)
    hit = cache.lookup([LimitCheck(shaping, "k", 1)], 100.1)
    assert hit is not None and hit.retry_after == pytest.approx(0.05, abs=0.002)
    assert hit.remaining == pytest.approx(-4.5)
    assert cache.lookup([LimitCheck(shaping, "k", 1)], 100.15) is None


def test_a_spent_quota_is_denied_until_its_window_ends_and_refills_nothing_meanwhile():
    daily = limit(name="daily", shape="quota: {limit: 10, per: day}")
    cache = DenialCache()
    cache.record(LimitCheck(daily, "k", 1), remaining=0.0, sent_at=100.0, reset=3600.0)
    hit = cache.lookup([LimitCheck(daily, "k", 1)], 2000.0)
    assert hit is not None and hit.remaining == 0.0
    # Held a little less than the window, by the margins, but the window's real end is what
    # a Retry-After advertises: 3.6 s early for a day's quota would be 86 s early for a month's.
    assert hit.expires_in == pytest.approx(3600 - 1900 - 3600 * denial_cache.CLOCK_RATE_MARGIN - 0.001)
    assert hit.retry_after == pytest.approx(3600 - 1900)
    assert cache.lookup([LimitCheck(daily, "k", 1)], 100.0 + 3600 * (1 - denial_cache.CLOCK_RATE_MARGIN)) is None


def test_a_denial_covers_its_bucket_and_cost_until_it_ends():
    cache = DenialCache()
    per_client = limit(rate="10/second")
    cache.record(LimitCheck(per_client, "k", 2), remaining=0.5, sent_at=100.0)
    assert cache.lookup([LimitCheck(per_client, "k", 2)], 100.1).index == 0
    # Another cost or another client is not covered: a cost of 1 could pass right now.
    assert cache.lookup([LimitCheck(per_client, "k", 1)], 100.1) is None
    assert cache.lookup([LimitCheck(per_client, "other", 2)], 100.1) is None
    # A request of several limits is covered when one of them is.
    other = limit(name="other")
    hit = cache.lookup([LimitCheck(other, "k", 1), LimitCheck(per_client, "k", 2)], 100.1)
    assert hit is not None and hit.index == 1
    assert hit.remaining == pytest.approx(1.5) and hit.retry_after == pytest.approx(0.05, abs=0.002)
    # Past the refill, it is gone.
    assert cache.lookup([LimitCheck(per_client, "k", 2)], 100.15) is None
    assert len(cache) == 0


def test_with_a_store_that_refunds_a_denial_is_held_at_most_max_hold():
    """A Redis Cluster may give tokens back, so a denial cannot be trusted for its full length."""
    slow = limit(rate="1/hour", burst=5)
    cache = DenialCache(max_hold=0.05)
    cache.record(LimitCheck(slow, "k", 1), remaining=0.0, sent_at=100.0)
    held = cache.lookup([LimitCheck(slow, "k", 1)], 100.049)
    assert held is not None and held.retry_after == pytest.approx(3600 - 0.049)
    assert cache.lookup([LimitCheck(slow, "k", 1)], 100.05) is None
    unbounded = DenialCache()
    unbounded.record(LimitCheck(slow, "k", 1), remaining=0.0, sent_at=100.0)
    assert unbounded.lookup([LimitCheck(slow, "k", 1)], 3000.0) is not None


def test_a_limit_replaced_by_a_reload_never_matches_an_old_denial():
    cache = DenialCache()
    before = limit(rate="1/hour")
    cache.record(LimitCheck(before, "k", 1), remaining=0, sent_at=0.0)
    after = limit(rate="1/second")  # same name, new settings
    assert cache.lookup([LimitCheck(after, "k", 1)], 1.0) is None
    assert cache.lookup([LimitCheck(before, "k", 1)], 1.0) is None  # and the stale entry is dropped
    assert len(cache) == 0


def test_a_limit_a_reload_left_unchanged_keeps_its_denials():
    cache = DenialCache()
    before = limit(rate="1/hour")
    cache.record(LimitCheck(before, "k", 1), remaining=0, sent_at=0.0)
    reloaded = limit(rate="1/hour")  # equal settings, a new object
    assert reloaded is not before
    assert cache.lookup([LimitCheck(reloaded, "k", 1)], 1.0) is not None
    assert cache.lookup([LimitCheck(reloaded, "k", 1)], 2.0) is not None


def test_memory_is_bounded_by_forgetting_the_oldest_denial():
    cache = DenialCache(max_entries=100)
    per_client = limit(rate="1/hour")
    for i in range(1000):
        cache.record(LimitCheck(per_client, f"client-{i}", 1), remaining=0, sent_at=0.0)
    assert len(cache) == 100
    assert cache.lookup([LimitCheck(per_client, "client-999", 1)], 1.0) is not None
    assert cache.lookup([LimitCheck(per_client, "client-0", 1)], 1.0) is None


async def test_waves_send_concurrent_checks_of_one_client_once_per_round_trip():
    waves = ClientWaves()
    sent: list[list[int]] = []
    current: list[int] = []
    answer = asyncio.Event()

    async def check(i: int) -> None:
        wave = await waves.join("client")
        current.append(i)
        try:
            await answer.wait()
        finally:
            waves.leave("client", wave)

    first = asyncio.ensure_future(check(0))
    await asyncio.sleep(0)
    rest = [asyncio.ensure_future(check(i)) for i in range(1, 6)]
    await asyncio.sleep(0)
    assert current == [0], "the others must wait for the wave in flight"
    sent.append(current[:])
    current.clear()
    answer.set()
    await first
    await asyncio.gather(*rest)
    assert sorted(current) == [1, 2, 3, 4, 5]  # all five went as one wave
    assert len(waves) == 0


async def test_a_wave_sends_no_more_checks_than_it_has_seats_and_the_rest_go_next():
    """Seats are counted from what the wave waited for learned; a check without a seat waits
    one more round trip, and the next wave counts its seats afresh."""
    counted: list[tuple[str, float | None]] = []

    def seats(checks: str, waited) -> int:
        counted.append((checks, waited.sent_at))
        return 2 if waited.sent_at == 1.0 else 0  # 0: each wave still gets one

    waves = ClientWaves(seats=seats)
    answers = {wave_number: asyncio.Event() for wave_number in range(1, 6)}
    sent: dict[int, list[int]] = collections.defaultdict(list)
    opened: list[object] = []

    async def check(i: int) -> None:
        wave = await waves.join("client", "checks")
        if wave not in opened:
            opened.append(wave)
        number = opened.index(wave) + 1
        sent[number].append(i)
        try:
            await answers[number].wait()
            wave.learn(float(number), (5.0 - number,), (None,))
        finally:
            waves.leave("client", wave)

    tasks = [asyncio.ensure_future(check(i)) for i in range(6)]
    await asyncio.sleep(0)
    assert dict(sent) == {1: [0]}, "the first check goes alone; the others wait for it"
    answers[1].set()
    while len(sent) < 2:
        await asyncio.sleep(0)
    for _ in range(3):
        await asyncio.sleep(0)
    assert sorted(sent[2]) == [1, 2], "two seats: two of the five waiting checks go"
    answers[2].set()
    for number in (3, 4, 5):
        while len(sent) < number:
            await asyncio.sleep(0)
        answers[number].set()
    await asyncio.gather(*tasks)
    assert [len(sent[n]) for n in range(1, 6)] == [1, 2, 1, 1, 1], "then one seat each (0 counted, 1 given)"
    assert counted == [("checks", 1.0), ("checks", 2.0), ("checks", 3.0), ("checks", 4.0)]
    assert len(waves) == 0


async def test_a_client_that_never_stops_keeps_no_chain_of_past_waves():
    """Two requests of one client take turns for ever: each arrives while the other's wave
    is in flight, so every wave is opened by a waiter of the one before. A finished wave
    is forgotten; it was kept by the next one's `after`, and so on back to the first."""
    waves = ClientWaves()
    current = await waves.join("client")
    for _ in range(5):
        waiting = asyncio.ensure_future(waves.join("client"))
        await asyncio.sleep(0)
        waves.leave("client", current)
        current = await waiting
    gc.collect()
    alive = sum(isinstance(o, Wave) for o in gc.get_objects())
    assert alive <= 2, f"{alive} waves alive: more than the one in flight and the one it waited for"
    waves.leave("client", current)
    assert len(waves) == 0


async def test_a_wave_learns_the_fewest_tokens_any_answer_left_and_its_earliest_send():
    waves = ClientWaves()
    wave = await waves.join("client")
    wave.learn(2.0, (7.0, None), (None, None))
    wave.learn(1.5, (9.0, 3.0), (None, 60.0))
    wave.learn(2.5, (4.0, 5.0), (None, 50.0))
    assert (wave.sent_at, list(wave.fewest_left), list(wave.resets)) == (1.5, [4.0, 3.0], [None, 60.0])
    waves.leave("client", wave)


async def test_a_failed_wave_fails_the_wave_behind_it_at_once():
    waves = ClientWaves()
    release = asyncio.Event()

    async def failing() -> None:
        wave = await waves.join("client")
        await release.wait()
        waves.leave("client", wave, StoreError("redis: no answer within 10 ms"))

    first = asyncio.ensure_future(failing())
    await asyncio.sleep(0)
    waiting = asyncio.ensure_future(waves.join("client"))
    await asyncio.sleep(0)
    assert not waiting.done()
    release.set()
    await first
    with pytest.raises(StoreError, match="no answer within 10 ms"):
        await waiting
    assert len(waves) == 0


# Reads a bucket as the script would find it, without charging it.
PEEK_SCRIPT = """
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + tonumber(time[2]) / 1000
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local capacity, rate = tonumber(ARGV[1]), tonumber(ARGV[2])
local held, ts = tonumber(state[1]), tonumber(state[2])
if held == nil or ts == nil then return tostring(capacity) end
return tostring(math.min(capacity, held + math.max(0, now - ts) / 1000 * rate))
"""


@pytest.mark.parametrize("max_delay", [0.0, 0.05], ids=["rejecting", "shaping"])
async def test_under_random_traffic_from_three_gateways_the_cache_never_denies_what_redis_would_allow(
    dedicated_redis, max_delay
):
    """Shaping: the limit may owe max_delay × rate = 2 tokens, and a request Redis would
    admit into that debt (after a wait) is one the cache must not deny."""
    redis_server = dedicated_redis
    # The default store.timeout: every decision must come from Redis or the cache.
    config = store_config(redis_server.url, timeout=0.01, key_secret=None)
    stores = [RedisStore(config) for _ in range(3)]
    limiters = [Limiter(store, shared_store=True) for store in stores]
    per_client = limit(rate="40/second", burst=4, shape=f"mode: delay, max_delay: {max_delay * 1000:g}ms" if max_delay else "")
    debt = max_delay * 40
    client = redis_server.client()
    peek = client.register_script(PEEK_SCRIPT)
    rng = random.Random(6)
    cache_answers = store_answers = delayed = 0
    for store in stores:
        await store.start()
    secret = client.get("rl:" + SECRET_KEY_SUFFIX).encode()
    try:

        async def traffic(limiter: Limiter) -> None:
            nonlocal cache_answers, store_answers, delayed
            end = time.monotonic() + 1.5
            while time.monotonic() < end:
                identity, cost = f"client-{rng.randrange(3)}", rng.choice((1, 1, 2, 3))
                checks = [LimitCheck(per_client, identity, cost, max_delay=max_delay)]
                now = time.monotonic()
                cached = limiter.denials.lookup(checks, now)
                if cached is not None:
                    # The cache claims Redis denies this until `until`; a peek that ended before
                    # then must agree.
                    until = now + cached.expires_in
                    key = bucket_key("rl:", per_client.name, identity_digest(secret, identity))
                    tokens = float(await asyncio.to_thread(peek, keys=[key], args=[4.0, 40.0]))
                    if time.monotonic() < until:
                        assert tokens - cost < -debt, f"the cache denied {identity} cost {cost} with {tokens} tokens in Redis"
                        cache_answers += 1
                else:
                    store_answers += 1
                decision = await limiter.check(checks)
                assert decision.statuses[0].outcome in ("allow", "deny", "delayed" if max_delay else "allow")
                delayed += decision.statuses[0].outcome == "delayed"
                await asyncio.sleep(rng.random() * 0.004)  # paces the traffic; synchronises nothing

        await asyncio.gather(*(traffic(limiter) for limiter in limiters for _ in range(4)))
    finally:
        for store in stores:
            await store.close()
    assert cache_answers > 100 and store_answers > 100, (cache_answers, store_answers)
    assert (delayed > 100) == bool(max_delay), delayed
