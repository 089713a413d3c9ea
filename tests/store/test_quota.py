"""Fixed-window quotas: the window math (gateway/limiter/quota.py) as pure functions,
the script's quotas held to it in Lua 5.1 (lupa) at computed times, and the same
script on a real redis-server, all-or-nothing with token buckets.

The script reads Redis's TIME; the lupa bridge gives it any time the test picks,
so window boundaries (month ends, leap days, reset offsets) are crossed exactly,
to the microsecond, without waiting for them.
"""

from __future__ import annotations

import datetime
import math
import random

import pytest

from gateway.limiter import bucket, quota
from gateway.limiter.quota import DAY_MS, QuotaSpec, QuotaState
from gateway.redis.scripts import load_script
from tests.lua_bridge import FakeRedis, LuaScript
from tests.processes import RedisServer

SCRIPT = load_script()
UTC = datetime.UTC
HOUR_MS = 3_600_000


def ms(*date: int) -> float:
    """Milliseconds since the epoch of a UTC date and time."""
    return datetime.datetime(*date, tzinfo=UTC).timestamp() * 1000


def spec(per: str, reset: str = "00:00", limit: int = 10, cost: int = 1) -> QuotaSpec:
    hours, minutes = reset.split(":")
    return quota.spec_of(per, int(hours) * 3600 + int(minutes) * 60, limit, cost)


# --- the calendar ---------------------------------------------------------------------------


def test_days_and_dates_convert_as_the_standard_library_does():
    epoch = datetime.date(1970, 1, 1)
    rng = random.Random(1)
    days = [*range(-800, 800), *(rng.randint(-700_000, 2_900_000) for _ in range(5000))]
    for day in days:
        date = epoch + datetime.timedelta(days=day)
        assert quota.civil_from_days(day) == (date.year, date.month, date.day)
        assert quota.days_from_civil(date.year, date.month, date.day) == day


# --- windows: start <= now < end ------------------------------------------------------------

WINDOW_CASES = [
    # id, spec, now, expected start, expected end
    ("a day from midnight", spec("day"), ms(2026, 11, 29, 20, 15), ms(2026, 11, 29), ms(2026, 11, 30)),
    ("a day's last microsecond", spec("day"), ms(2026, 11, 30) - 0.001, ms(2026, 11, 29), ms(2026, 11, 30)),
    ("a day's first instant", spec("day"), ms(2026, 11, 30), ms(2026, 11, 30), ms(2026, 12, 1)),
    ("a day resetting at 13:30, before it", spec("day", "13:30"), ms(2026, 11, 29, 13, 29), ms(2026, 11, 28, 13, 30),
     ms(2026, 11, 29, 13, 30)),
    ("a day resetting at 13:30, at it", spec("day", "13:30"), ms(2026, 11, 29, 13, 30), ms(2026, 11, 29, 13, 30),
     ms(2026, 11, 30, 13, 30)),
    ("an hour, reset at :15", spec("hour", "07:15"), ms(2026, 11, 29, 20, 10), ms(2026, 11, 29, 19, 15),
     ms(2026, 11, 29, 20, 15)),
    ("a week starts on Monday", spec("week"), ms(2026, 11, 29, 23, 59), ms(2026, 11, 23), ms(2026, 11, 30)),
    ("a week, reset at 06:00, Monday 05:00", spec("week", "06:00"), ms(2026, 11, 30, 5), ms(2026, 11, 23, 6),
     ms(2026, 11, 30, 6)),
    ("a month of 30 days", spec("month"), ms(2026, 11, 29, 20), ms(2026, 11, 1), ms(2026, 12, 1)),
    ("December into January", spec("month"), ms(2026, 12, 31, 23, 59, 59), ms(2026, 12, 1), ms(2027, 1, 1)),
    ("January's first instant", spec("month"), ms(2027, 1, 1), ms(2027, 1, 1), ms(2027, 2, 1)),
    ("February of a leap year", spec("month"), ms(2028, 2, 29, 12), ms(2028, 2, 1), ms(2028, 3, 1)),
    ("February of a common year", spec("month"), ms(2027, 2, 28, 12), ms(2027, 2, 1), ms(2027, 3, 1)),
    ("the 1st before the reset time is last month's", spec("month", "09:00"), ms(2026, 12, 1, 8, 59),
     ms(2026, 11, 1, 9), ms(2026, 12, 1, 9)),
    ("the 1st at the reset time is this month's", spec("month", "09:00"), ms(2026, 12, 1, 9), ms(2026, 12, 1, 9),
     ms(2027, 1, 1, 9)),
    ("before 1970", spec("month"), ms(1969, 12, 15), ms(1969, 12, 1), ms(1970, 1, 1)),
    ("the year 2100, not a leap year", spec("month"), ms(2100, 2, 28, 23), ms(2100, 2, 1), ms(2100, 3, 1)),
]


@pytest.mark.parametrize(("quota_spec", "now", "start", "end"), [c[1:] for c in WINDOW_CASES], ids=[c[0] for c in WINDOW_CASES])
def test_the_window_holding_now(quota_spec, now, start, end):
    assert quota.window(quota_spec, now) == (start, end)
    assert start <= now < end


def test_a_counter_of_an_earlier_window_counts_nothing_and_a_step_back_never_resets_one():
    daily = spec("day")
    today, tomorrow = ms(2026, 11, 29), ms(2026, 11, 30)
    held = QuotaState(count=7, start=today)
    assert quota.used(held, daily, today + HOUR_MS) == (7, today, tomorrow)
    assert quota.used(held, daily, tomorrow) == (0, tomorrow, ms(2026, 12, 1))
    # Redis's clock stepped back into yesterday (a failover): today's count still holds.
    assert quota.used(held, daily, today - HOUR_MS) == (7, today, tomorrow)
    assert quota.used(None, daily, today) == (0, today, tomorrow)


# --- the model: quotas beside buckets, all-or-nothing ---------------------------------------


def test_a_quota_admits_its_limit_per_window_and_its_denial_lasts_until_the_window_ends():
    daily = spec("day", limit=3)
    now = ms(2026, 11, 29, 18)
    held: QuotaState | None = None
    for left in (2, 1, 0):
        outcome = bucket.check([held], [daily], now)
        assert outcome.allowed and outcome.remaining == (left,) and outcome.resets == (6 * HOUR_MS,)
        held = outcome.states[0]
    denied = bucket.check([held], [daily], now)
    assert not denied.allowed and denied.remaining == (0,) and denied.retry_after == 6 * HOUR_MS
    assert bucket.check([held], [daily], ms(2026, 11, 30)).allowed  # the next window
    assert bucket.check([None], [spec("day", limit=3, cost=4)], now).retry_after == math.inf


def test_a_quota_and_a_bucket_are_charged_together_or_not_at_all():
    now = ms(2026, 11, 29, 18)
    daily = spec("day", limit=1)
    tokens = bucket.BucketSpec(capacity=5, rate=1 / 1000, cost=1)  # the model in ms, as the script
    full_bucket = None
    spent = QuotaState(count=1, start=ms(2026, 11, 29))
    # The quota is spent: the bucket is not charged.
    outcome = bucket.check([full_bucket, spent], [tokens, daily], now)
    assert not outcome.allowed and outcome.states[0] == bucket.BucketState(tokens=5, stamp=now)
    assert outcome.retry_after == 6 * HOUR_MS
    # The bucket is empty: the quota is not charged.
    empty = bucket.BucketState(tokens=0, stamp=now)
    outcome = bucket.check([empty, None], [tokens, daily], now)
    assert not outcome.allowed and outcome.states[1] == QuotaState(count=0, start=ms(2026, 11, 29))
    assert outcome.retry_after == 1000  # the bucket's wait, shorter than the quota's
    outcome = bucket.check([full_bucket, None], [tokens, daily], now)
    assert outcome.allowed and outcome.remaining == (4, 0)


# --- the script at computed times (lupa) ----------------------------------------------------


def quota_args(quota_spec: QuotaSpec) -> list[str]:
    """A quota's ARGV as gateway.limiter.redis_store formats it."""
    values = (quota_spec.limit, quota_spec.period_ms, quota_spec.cost, quota_spec.offset_ms)
    return [repr(float(v)) for v in values]


def bucket_args(spec_: bucket.BucketSpec) -> list[str]:
    """A bucket's ARGV; the spec's rate is per ms (the model in the script's units)."""
    return [repr(float(v)) for v in (spec_.capacity, spec_.rate * 1000, spec_.cost, spec_.debt)]


def at(fake: FakeRedis, when_ms: float) -> float:
    fake.set_clock(round(when_ms * 1000))
    return float(fake.seconds) * 1000 + float(fake.microseconds) / 1000  # the script's `now`


def test_the_script_counts_quotas_as_the_model_does_across_window_boundaries():
    """Random quotas (each period, reset offsets, limits and costs), checked at times
    clustered around their window boundaries: every reply, count, stamp and TTL is the
    model's."""
    rng = random.Random(3)
    boundaries = 0
    for run in range(60):
        per = rng.choice(["hour", "day", "week", "month"])
        quota_spec = spec(per, f"{rng.randrange(24):02d}:{rng.randrange(60):02d}", limit=rng.randint(1, 5))
        fake = FakeRedis()
        script = LuaScript(SCRIPT, fake)
        key = f"rl:q{run}:{{c}}"
        held: QuotaState | None = None
        when = ms(rng.randint(1990, 2100), rng.randint(1, 12), rng.randint(1, 28))
        for _ in range(40):
            cost = rng.randint(0, quota_spec.limit + 1)
            current = QuotaSpec(quota_spec.limit, quota_spec.period_ms, quota_spec.offset_ms, cost)
            # Next: just before, at or after the current window's end, or somewhere inside it.
            end = quota.window(current, when)[1]
            when = rng.choice([end - 0.001, end, end + 0.001, when + rng.random() * (end - when)])
            now = at(fake, when)
            model = bucket.check([held], [current], now)
            reply = script([key], ["q", *quota_args(current)])
            boundaries += now == end
            assert reply[0] == model.allowed, (per, when, held, reply, model)
            assert float(reply[1][0]) == model.remaining[0]
            expected_retry = 0 if model.allowed else (-1 if math.isinf(model.retry_after) else math.ceil(model.retry_after))
            assert (reply[2], reply[3], reply[4]) == (expected_retry, 0, [math.ceil(model.resets[0])])
            if model.allowed and cost:
                held = model.states[0]
                stored = fake.hashes[key]
                assert (float(stored["n"]), float(stored["w"])) == (held.count, held.start)
                # The counter expires when its window ends (PEXPIRE in whole ms, rounded up).
                assert fake.deadlines[key] == fake.milliseconds + max(1, math.ceil(model.resets[0]))
            if fake._live(key) is None:
                held = None
    assert boundaries > 20


def test_a_denied_quota_is_kept_until_the_end_of_its_window_as_checked_now():
    """A reload that lengthened a quota's window (an hour to a day) must not let the
    counter expire at the end of the hour it was last charged in: it would come back
    empty, the day's quota given again."""
    fake = FakeRedis()
    script = LuaScript(SCRIPT, fake)
    hourly, daily = spec("hour", limit=2), spec("day", limit=2)
    at(fake, ms(2026, 11, 30, 10, 30))
    assert [script(["rl:q:{c}"], ["q", *quota_args(hourly)])[0] for _ in range(3)] == [1, 1, 0]
    assert fake.deadlines["rl:q:{c}"] == ms(2026, 11, 30, 11)
    at(fake, ms(2026, 11, 30, 10, 45) + 0.4)  # PTTL truncates this to a millisecond short
    assert script(["rl:q:{c}"], ["q", *quota_args(hourly)])[0] == 0
    assert fake.deadlines["rl:q:{c}"] == ms(2026, 11, 30, 11), "a denial in its window leaves its end alone"
    assert script(["rl:q:{c}"], ["q", *quota_args(daily)])[0] == 0
    assert fake.deadlines["rl:q:{c}"] == ms(2026, 12, 1), "gone when the day ends, as a charge would set it"
    at(fake, ms(2026, 11, 30, 12))
    assert script(["rl:q:{c}"], ["q", *quota_args(daily)])[0] == 0  # still the day's 2


def test_the_script_charges_quotas_and_buckets_together_or_not_at_all():
    fake = FakeRedis()
    script = LuaScript(SCRIPT, fake)
    now = at(fake, ms(2026, 11, 30) - 0.001)  # the window's last microsecond
    one_token = bucket_args(bucket.BucketSpec(capacity=1, rate=1 / 60_000, cost=1))
    daily = quota_args(spec("day", limit=1))
    keys = ["rl:bucket:{c}", "rl:daily:{c}"]
    assert script(keys, ["bq", *one_token, *daily]) == [1, ["0", "0"], 0, 0, [-1, 1]]
    # Both spent: the quota for the microsecond left of its window, the bucket for a minute.
    assert script(keys, ["bq", *one_token, *daily]) == [0, ["0", "0"], 60_000, 0, [-1, 1]]
    # A new window, and a request whose bucket is empty: the quota is not charged ...
    now = at(fake, ms(2026, 11, 30))
    fake.hashes["rl:empty:{c}"] = {"tokens": "0", "ts": repr(now)}
    assert script(["rl:empty:{c}", keys[1]], ["bq", *one_token, *daily]) == [0, ["0", "1"], 60_000, 0, [-1, DAY_MS]]
    # ... so it still has its one unit for the next request, and then none.
    assert script([keys[1]], ["q", *daily]) == [1, ["0"], 0, 0, [DAY_MS]]
    assert script([keys[1]], ["q", *daily])[:3] == [0, ["0"], DAY_MS]


# --- a real redis-server --------------------------------------------------------------------


def test_a_real_redis_charges_a_spent_quota_and_a_bucket_together_or_not_at_all():
    """On redis-server, with its real TIME: a quota of 2 a day and a bucket of 3. Two
    requests pass; the third is denied by the quota and the bucket keeps its last token;
    the quota's counter expires when the UTC day ends."""
    with RedisServer() as server:
        client = server.client()
        try:
            sha = client.script_load(SCRIPT)
            keys = ["rl:bucket:{c}", "rl:daily:{c}"]
            args = ["bq", *bucket_args(bucket.BucketSpec(capacity=3, rate=1 / 86_400_000, cost=1)),
                    *quota_args(spec("day", limit=2))]
            replies = [client.evalsha(sha, 2, *keys, *args) for _ in range(3)]
            seconds, micros = client.time()
            bucket_tokens = client.hget(keys[0], "tokens")
            pttl = client.pttl(keys[1])
        finally:
            client.close()
    now = seconds * 1000 + micros / 1000
    to_midnight = quota.window(spec("day"), now)[1] - now
    assert [r[0] for r in replies] == [1, 1, 0]
    assert [r[1][1] for r in replies] == ["1", "0", "0"]  # the quota's units left
    # The bucket (refilling a token a day, so by nanotokens between calls) charged twice;
    # the denied request charged it nothing.
    assert [float(r[1][0]) for r in replies] == pytest.approx([2, 1, 1], abs=1e-6)
    assert float(bucket_tokens) == pytest.approx(1, abs=1e-6)
    assert to_midnight - 1000 <= replies[2][2] <= to_midnight + 1000  # Retry-After: the day's end
    assert to_midnight - 1000 <= pttl <= to_midnight + 1000


def test_a_real_redis_takes_the_window_from_its_own_time():
    """A counter stamped with the previous hour's window counts nothing on redis-server;
    one stamped with the window Redis's TIME is in counts in full."""
    hourly = spec("hour", limit=2)
    with RedisServer() as server:
        client = server.client()
        try:
            sha = client.script_load(SCRIPT)
            seconds, micros = client.time()
            start, _ = quota.window(hourly, seconds * 1000 + micros / 1000)
            client.hset("rl:last-hour:{c}", mapping={"n": "2", "w": repr(start - HOUR_MS)})
            client.hset("rl:this-hour:{c}", mapping={"n": "2", "w": repr(start)})
            last_hour = client.evalsha(sha, 1, "rl:last-hour:{c}", "q", *quota_args(hourly))
            this_hour = client.evalsha(sha, 1, "rl:this-hour:{c}", "q", *quota_args(hourly))
            stored = client.hgetall("rl:last-hour:{c}")
        finally:
            client.close()
    if start != quota.window(hourly, seconds * 1000 + micros / 1000 + 1000)[0]:
        pytest.skip("the hour ended between reading TIME and the calls")
    assert last_hour[:2] == [1, ["1"]] and stored == {"n": "1", "w": repr(start).removesuffix(".0")}
    assert this_hour[:2] == [0, ["0"]]


def test_a_cluster_refund_gives_a_quota_its_units_back_and_a_bucket_its_tokens():
    """lua/token_refund.lua, after a later Redis Cluster slot denied the request: the
    quota's count goes down by the cost (never below zero), the bucket's tokens up
    (never past capacity), and a limit that expired meanwhile stays absent."""
    fake = FakeRedis()
    refund = LuaScript(load_script("token_refund.lua"), fake)
    fake.hashes["rl:q:{c}"] = {"n": "3", "w": "0"}
    fake.hashes["rl:b:{c}"] = {"tokens": "4.5", "ts": "0"}
    assert refund(["rl:q:{c}", "rl:b:{c}", "rl:gone:{c}"], ["10.0", "2.0", "5.0", "1.0", "5.0", "1.0"]) == 2
    assert fake.hashes["rl:q:{c}"] == {"n": "1", "w": "0"}
    assert fake.hashes["rl:b:{c}"] == {"tokens": "5", "ts": "0"}
    assert "rl:gone:{c}" not in fake.hashes
    assert refund(["rl:q:{c}"], ["10.0", "2.0"]) == 1 and fake.hashes["rl:q:{c}"]["n"] == "0"
