"""lua/token_bucket.lua run by a real redis-server, called with redis-py directly.

The script's clock is Redis's TIME, which a test cannot set; instead, tests
write bucket state stamped relative to Redis's own clock (read with TIME just
before the call) and allow for the few milliseconds a round trip takes.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

import pytest
import redis

from gateway.limiter import bucket
from gateway.redis.scripts import load_script
from tests.processes import RedisServer, wait_until

# The longest a call takes to reach Redis on a loaded test machine; refill over
# this much time is the tolerance of comparisons with the model.
SLACK_MS = 250


@pytest.fixture(scope="module")
def server():
    with RedisServer() as running:
        yield running


@pytest.fixture
def client(server: RedisServer):
    connection = server.client()
    connection.flushall()
    yield connection
    connection.close()


@dataclass(frozen=True)
class Reply:
    allowed: int
    remaining: list[str]
    retry_ms: int
    wait_ms: int = 0


class TokenBucket:
    """The script, loaded once and called by SHA, with limits given as (key, capacity, rate, cost)."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.sha = client.script_load(load_script())

    def __call__(self, *limits: tuple[str, float, float, int]) -> Reply:
        keys = [key for key, *_ in limits]
        args: list[str] = ["b" * len(limits)]
        for _, capacity, rate, cost in limits:
            # As gateway.limiter.redis_store sends them, for buckets that may not owe.
            args += [repr(float(capacity)), repr(float(rate)), repr(float(cost)), "0.0"]
        allowed, remaining, retry_ms, wait_ms, resets = self.client.evalsha(self.sha, len(keys), *keys, *args)
        assert resets == [-1] * len(limits)  # buckets have no window to reset
        return Reply(allowed=allowed, remaining=list(remaining), retry_ms=retry_ms, wait_ms=wait_ms)


@pytest.fixture
def script(client) -> TokenBucket:
    return TokenBucket(client)


def redis_now_ms(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return seconds * 1000 + micros / 1000


def put(client: redis.Redis, key: str, tokens: float, ts: float) -> None:
    client.hset(key, mapping={"tokens": repr(float(tokens)), "ts": repr(float(ts))})


def held(client: redis.Redis, key: str) -> tuple[float, float]:
    tokens, ts = client.hmget(key, "tokens", "ts")
    return float(tokens), float(ts)


def test_seed_a_new_bucket_of_100_at_10_per_second_pays_1_and_holds_exactly_99(script, client):
    reply = script(("rl:seed", 100, 10, 1))
    assert reply == Reply(allowed=1, remaining=["99"], retry_ms=0)
    assert client.hget("rl:seed", "tokens") == "99"


def test_the_clock_is_redis_time_and_is_stored_as_the_stamp(script, client):
    before = redis_now_ms(client)
    script(("rl:clock", 10, 1, 1))
    after = redis_now_ms(client)
    _, ts = held(client, "rl:clock")
    assert before <= ts <= after
    # Refill is measured on that clock: half a second ago at 10/s is 5 tokens.
    now = redis_now_ms(client)
    put(client, "rl:clock", 0, now - 500)
    remaining = float(script(("rl:clock", 100, 10, 1)).remaining[0])
    assert 4.0 <= remaining <= 4.0 + SLACK_MS / 1000 * 10


def test_the_script_takes_no_time_argument():
    source = load_script()
    assert "redis.call('TIME')" in source
    # Per check, its kinds, then exactly four arguments per limit (a bucket's capacity, rate,
    # cost and debt; a quota's limit, period, cost and offset): none of them a time. ARGV's
    # length only ends the list of checks, each of which takes its kinds and four per limit.
    assert "local a = p + 4 * i - 3" in source
    code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("--"))
    assert set(re.findall(r"ARGV\[([^\]]+)\]", code)) == {"p", "a", "a + 1", "a + 2", "a + 3"}
    assert re.findall(r"#ARGV\S*", code) == ["#ARGV", "#ARGV[p]"]  # the end of the list, and a check's limit count
    assert "k, p = k + count, p + 1 + 4 * count" in code


def test_remaining_comes_back_as_strings_so_fractions_survive(script, client):
    put(client, "rl:frac", 2.75, redis_now_ms(client))
    reply = script(("rl:frac", 10, 1 / 3600, 1))
    assert all(isinstance(value, str) for value in reply.remaining)
    assert float(reply.remaining[0]) == pytest.approx(1.75, abs=1e-3)


def test_exactly_enough_tokens_is_allowed_and_a_hair_less_is_denied(script, client):
    now = redis_now_ms(client)
    put(client, "rl:exact", 3, now)
    reply = script(("rl:exact", 10, 1 / 3600, 3))
    assert reply.allowed == 1
    assert float(reply.remaining[0]) == pytest.approx(0, abs=1e-3)

    put(client, "rl:short", 2.99, now + 10_000)  # a stamp ahead: no refill at all
    reply = script(("rl:short", 10, 1 / 3600, 3))
    assert reply.allowed == 0
    assert reply.remaining == ["2.99"]


def test_a_denied_call_writes_nothing(script, client):
    put(client, "rl:denied", 0.5, redis_now_ms(client) + 60_000)
    before = client.hgetall("rl:denied")
    for _ in range(3):
        assert script(("rl:denied", 10, 1, 1)).allowed == 0
    assert client.hgetall("rl:denied") == before
    assert client.pttl("rl:denied") == -1, "a denied call set an expiry"


def test_a_denial_lengthens_a_ttl_its_limit_now_outlasts_and_leaves_a_long_enough_one(script, client):
    """Reproduction: a reload lowered a limit from 10/second to 1/hour. A denied key kept
    the 3 s TTL its last charge set, expired, and the client came back with a full burst
    from Redis. A denial now keeps the key until the bucket would be full at the rate
    it was checked at, and still writes no tokens."""
    for _ in range(20):
        assert script(("rl:lowered", 20, 10, 1)).allowed == 1
    assert 0 < client.pttl("rl:lowered") <= 3000  # full from empty in 2 s, plus 1 s
    state = held(client, "rl:lowered")
    reply = script(("rl:lowered", 20, 1 / 3600, 1))
    assert reply.allowed == 0
    full_in_ms = (20 - float(reply.remaining[0])) * 3600 * 1000
    assert full_in_ms < client.pttl("rl:lowered") <= full_in_ms + 1002  # + 1 s, rounded up
    assert held(client, "rl:lowered") == state
    ttl = client.pttl("rl:lowered")
    assert script(("rl:lowered", 20, 1 / 3600, 1)).allowed == 0
    assert client.pttl("rl:lowered") <= ttl  # long enough already: not set again


def test_several_limits_are_checked_first_and_charged_only_if_all_allow(script, client):
    now = redis_now_ms(client)
    put(client, "rl:empty", 0, now + 60_000)
    for order in (
        [("rl:new-a", 10, 1, 1), ("rl:new-b", 5, 1, 2), ("rl:empty", 10, 1, 1)],  # the denier comes last
        [("rl:empty", 10, 1, 1), ("rl:new-a", 10, 1, 1), ("rl:new-b", 5, 1, 2)],  # and first
    ):
        reply = script(*order)
        assert reply.allowed == 0
        assert not client.exists("rl:new-a", "rl:new-b"), "a limit was charged although another denied"
        assert [float(r) for r in reply.remaining] == [0.0 if key == "rl:empty" else cap for key, cap, *_ in order]

    reply = script(("rl:new-a", 10, 1, 1), ("rl:new-b", 5, 1, 2))
    assert reply == Reply(allowed=1, remaining=["9", "3"], retry_ms=0)
    assert client.hget("rl:new-a", "tokens") == "9"
    assert client.hget("rl:new-b", "tokens") == "3"


def test_retry_after_is_the_time_until_every_bucket_could_pay(script, client):
    now = redis_now_ms(client)
    put(client, "rl:minute", 0, now)
    put(client, "rl:second", 0.5, now)
    reply = script(("rl:minute", 10, 1 / 60, 1), ("rl:second", 10, 1, 1))
    assert reply.allowed == 0
    # The slower bucket decides: a token at 1/minute, less what refilled since `now`.
    assert 60_000 - SLACK_MS / 60 <= reply.retry_ms <= 60_000
    reply = script(("rl:second", 10, 1, 1))
    assert 500 - SLACK_MS <= reply.retry_ms <= 500


def test_a_cost_of_zero_is_allowed_and_charges_nothing(script, client):
    reply = script(("rl:zero-new", 10, 1, 0))
    assert reply == Reply(allowed=1, remaining=["10"], retry_ms=0)
    assert not client.exists("rl:zero-new")

    put(client, "rl:zero-empty", 0, redis_now_ms(client) + 60_000)
    before = client.hgetall("rl:zero-empty")
    reply = script(("rl:zero-empty", 10, 1, 0))
    assert reply == Reply(allowed=1, remaining=["0"], retry_ms=0)
    assert client.hgetall("rl:zero-empty") == before


def test_a_cost_above_capacity_is_denied_for_ever_and_no_balance_goes_negative(script, client):
    reply = script(("rl:big", 5, 100, 6))
    assert reply == Reply(allowed=0, remaining=["5"], retry_ms=-1)
    assert not client.exists("rl:big")
    for cost in (5, 6, 1, 7):
        reply = script(("rl:big", 5, 100, cost), ("rl:other", 3, 100, 1))
        tokens = [float(r) for r in reply.remaining]
        assert min(tokens) >= 0
        if cost > 5:
            assert reply.retry_ms == -1 and reply.allowed == 0
    for key in ("rl:big", "rl:other"):
        assert held(client, key)[0] >= 0


def test_a_stamp_in_the_future_is_clamped_to_no_refill_and_never_moves_backwards(script, client):
    future = redis_now_ms(client) + 60_000
    put(client, "rl:future", 2, future)
    reply = script(("rl:future", 10, 10, 1))
    assert reply.allowed == 1
    assert reply.remaining == ["1"], "the negative elapsed time took or added tokens"
    tokens, ts = held(client, "rl:future")
    assert (tokens, ts) == (1.0, future)
    # The TTL still covers a full refill counted from the stamp.
    assert 60_000 + 1_000 + 1_000 - SLACK_MS <= client.pttl("rl:future") <= 60_000 + 1_000 + 1_000

    script(("rl:future", 10, 10, 1))
    reply = script(("rl:future", 10, 10, 1))
    assert reply.allowed == 0 and reply.remaining == ["0"]
    # Refill starts only when Redis's clock reaches the stamp: wait until then, plus a token's time.
    assert 60_000 + 100 - SLACK_MS <= reply.retry_ms <= 60_000 + 100
    assert held(client, "rl:future") == (0.0, future)


def test_a_fractional_rate_of_one_an_hour(script, client):
    per_hour = 1 / 3600
    reply = script(("rl:hourly", 2, per_hour, 2))
    assert reply == Reply(allowed=1, remaining=["0"], retry_ms=0)
    assert 2 * 3_600_000 + 1000 - SLACK_MS <= client.pttl("rl:hourly") <= 2 * 3_600_000 + 1000
    reply = script(("rl:hourly", 2, per_hour, 1))
    assert reply.allowed == 0
    assert 3_600_000 - SLACK_MS <= reply.retry_ms <= 3_600_000
    # Half an hour ago at one an hour: half a token, so still denied, half an hour to wait.
    put(client, "rl:hourly", 0, redis_now_ms(client) - 1_800_000)
    reply = script(("rl:hourly", 2, per_hour, 1))
    assert reply.allowed == 0
    assert float(reply.remaining[0]) == pytest.approx(0.5, abs=1e-3)
    assert 1_800_000 - SLACK_MS <= reply.retry_ms <= 1_800_000


def test_a_very_high_rate_of_a_million_a_second(script, client):
    put(client, "rl:fast", 0, redis_now_ms(client) - 1)  # a millisecond ago: a thousand tokens
    reply = script(("rl:fast", 5, 1e6, 5))
    assert reply == Reply(allowed=1, remaining=["0"], retry_ms=0)
    # A full refill takes 5 microseconds: the key lives one second past it, rounded up to a millisecond.
    assert 1001 - SLACK_MS <= client.pttl("rl:fast") <= 1001
    # A bucket emptied with its stamp a second ahead denies for that second plus one rounded-up millisecond.
    put(client, "rl:fast", 0, redis_now_ms(client) + 1000)
    reply = script(("rl:fast", 5, 1e6, 1))
    assert reply.allowed == 0
    assert 1001 - SLACK_MS <= reply.retry_ms <= 1001


@pytest.mark.parametrize("capacity, rate", [(10, 1), (3, 0.5), (100, 1 / 60), (7, 1e6)])
def test_the_ttl_covers_a_full_refill_so_a_partly_full_bucket_never_expires_early(script, client, capacity, rate):
    key = f"rl:ttl:{capacity}:{rate}"
    script((key, capacity, rate, 1))
    full_refill_ms = math.ceil(capacity / rate * 1000) + 1000
    pttl = client.pttl(key)
    assert full_refill_ms - SLACK_MS <= pttl <= full_refill_ms
    # Every charge renews it.
    script((key, capacity, rate, 1))
    assert full_refill_ms - SLACK_MS <= client.pttl(key) <= full_refill_ms


def test_a_bucket_that_refills_in_more_than_1e14_seconds_is_charged_and_given_the_longest_ttl(script, client):
    """A burst of 2e9 at 1/day refills in 5.5 million years: its TTL in ms reached
    1e17, which Redis 7.0 passes to PEXPIRE as '1.728e+17' and PEXPIRE refuses,
    so every charge was a script error (after HSET had charged the bucket)."""
    reply = script(("rl:ages", 2e9, 1 / 86400, 1))
    assert reply.allowed == 1 and reply.remaining == ["1999999999"]
    assert 1e16 - SLACK_MS <= client.pttl("rl:ages") <= 1e16


def test_an_idle_bucket_key_vanishes_after_its_refill_time(script, client):
    reply = script(("rl:idle", 2, 20, 1))
    assert reply.allowed == 1
    assert 1100 - SLACK_MS <= client.pttl("rl:idle") <= 1100
    wait_until(lambda: not client.exists("rl:idle"), deadline=5.0, what="the idle bucket key to expire")
    # When it is gone the next call finds a full bucket, as the refill would have by then.
    assert script(("rl:idle", 2, 20, 1)).remaining == ["1"]


def test_random_calls_match_the_bucket_model(script, client):
    """The script is bucket.check in milliseconds: same decisions and counts for any stored state."""
    rng = random.Random(99)
    # Slow enough that the round trip's refill (SLACK_MS at most) cannot change the outcome's
    # digits that are compared; any state, including stamps ahead of Redis's clock.
    rates = [1 / 3600, 1 / 60, 0.01]
    for round_ in range(150):
        limits = []
        states: list[bucket.BucketState | None] = []
        specs = []
        written: dict[str, dict[str, str]] = {}
        now_ms = redis_now_ms(client)
        for i in range(rng.randint(1, 3)):
            key = f"rl:rand:{round_}:{i}"
            capacity = rng.choice([1, 2, 5, 20])
            rate = rng.choice(rates)
            cost = rng.choice([0, 1, 1, 2, 3, capacity, capacity + 1])
            if rng.random() < 0.2:
                states.append(None)
            else:
                tokens = rng.choice([0.0, rng.uniform(0, capacity), float(capacity), float(cost)])
                ts = now_ms + rng.choice([-rng.uniform(0, 600_000), 0.0, rng.uniform(0, 30_000)])
                put(client, key, tokens, ts)
                written[key] = client.hgetall(key)
                states.append(bucket.BucketState(tokens=tokens, stamp=(ts - now_ms) / 1000))
            limits.append((key, capacity, rate, cost))
            specs.append(bucket.BucketSpec(capacity=capacity, rate=rate, cost=cost))

        reply = script(*limits)
        elapsed = (redis_now_ms(client) - now_ms) / 1000
        early, late = bucket.check(states, specs, 0.0), bucket.check(states, specs, elapsed)
        if early.allowed != late.allowed:
            continue  # the decision flipped within the round trip: either answer is right
        assert reply.allowed == int(early.allowed), limits
        tolerance = max(rates) * elapsed + 1e-9
        for got, low, high in zip(reply.remaining, early.remaining, late.remaining):
            assert min(low, high) - tolerance <= float(got) <= max(low, high) + tolerance, limits
        if early.allowed:
            assert reply.retry_ms == 0
        elif math.isinf(early.retry_after):
            assert reply.retry_ms == -1
        else:
            assert math.ceil(late.retry_after * 1000) - 1 <= reply.retry_ms <= math.ceil(early.retry_after * 1000)
        for (key, _, _, cost), before, after in zip(limits, states, early.states):
            if early.allowed and cost:
                tokens, ts = held(client, key)
                assert tokens == pytest.approx(after.tokens, abs=tolerance), limits
                assert ts >= (float(written[key]["ts"]) if before else now_ms), "the stamp moved backwards"
            elif before is None:
                assert not client.exists(key), "a bucket was written although it was not charged"
            else:
                assert client.hgetall(key) == written[key], "an uncharged bucket changed"


def test_a_bucket_a_hair_short_of_the_cost_is_reported_short(client, script):
    """Remaining is a string with all of a double's digits: Lua's tostring keeps 14,
    and 0.999999999999999 tokens read as "1", a denial that looked like room."""
    tokens = 1 - 1e-15
    put(client, "hair", tokens, redis_now_ms(client) + 60_000)  # a stamp ahead: nothing refills
    reply = script(("hair", 10, 1, 1))
    assert reply.allowed == 0
    assert float(reply.remaining[0]) == tokens < 1


def test_several_checks_in_one_call_are_each_all_or_nothing_in_order(script, client):
    """A call of three checks, as the store batches them: the first takes the last token
    of a shared bucket, so the second (that bucket and a full one) is denied and charges
    neither, and the third, on other buckets, is allowed. Each gets its own five values."""
    put(client, "rl:shared:{a}", 1.0, redis_now_ms(client) + 60_000)  # stamped ahead: no refill
    bucket = ["1.0", "0.001", "1.0", "0.0"]
    roomy = ["10.0", "0.001", "1.0", "0.0"]
    keys = ["rl:shared:{a}", "rl:shared:{a}", "rl:roomy:{a}", "rl:other:{b}"]
    args = ["b", *bucket, "bb", *bucket, *roomy, "b", *roomy]
    reply = client.evalsha(script.sha, len(keys), *keys, *args)
    assert len(reply) == 15
    first, second, third = reply[0:5], reply[5:10], reply[10:15]
    assert first[:2] == [1, ["0"]]
    assert second[0] == 0 and second[1] == ["0", "10"] and second[2] > 0  # as found, nothing charged
    assert third[:2] == [1, ["9"]]
    assert not client.exists("rl:roomy:{a}")  # the denied check wrote nothing
    assert held(client, "rl:shared:{a}")[0] == 0.0
    assert float(client.hget("rl:other:{b}", "tokens")) == 9.0
