"""The exact text of lua/token_bucket.lua, run in Lua 5.1 (lupa) with a clock the
test controls, against the reference model (gateway/limiter/bucket.py).

A Hypothesis state machine holds one to three limits (capacity, rate), moves
Redis's TIME forward, not at all, backward, or by exactly the wait a denial
asked for, and checks random subsets of the limits with random costs. After
every step the script and the model must agree:

- **Decisions and remaining tokens** compare as tests/model_check.py says:
  identical decisions, each made by the carrier's own balance, except a
  rounding tie (the cost between two balances that agree, as in
  `test_a_rounding_tie_is_the_only_split_decision`), counted and printed;
  balances within `1e-9 × max(1, capacity)`; and the denial cache's premise
  (`remaining < cost`) the same. The reply's remaining is exactly the stored
  balance.
- **The stored stamp equals the model's exactly**, and a bucket Redis has
  expired is one the model says would be full by now.
- **retry_after**: the script's whole milliseconds are the model's wait rounded
  up (-1 where the model says never).

Some limits' charges are owed (kind "B"): taken even when the check is refused, past zero
into debt, which a read (cost 0) then finds and is refused for; the same invariants hold,
with the stored state charged whenever the charge is owed.

Some steps send two to four checks in one script call, as the store's batches
do: each check is held to the model in turn, on the same `now`, after what the
checks before it charged.

The model runs in milliseconds on the script's own `now` (model_check.py).
Like the script and the in-process store, the model's bucket is written back
only when a request is allowed with a cost above 0; storing a refilled but
uncharged bucket is the same model in exact arithmetic.

Hypothesis runs derandomized with no example database, so every run tries the
same examples (400 of up to 40 steps, about 6,900 script calls). The test also
fails if a change to the strategies stops reaching zero or negative elapsed
time, cost 0, a cost above capacity, rates at both ends, fractional tokens, an
expired bucket, or a wait of exactly the Retry-After.
"""

from __future__ import annotations

import collections
import math

import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from gateway.limiter import bucket
from gateway.redis.scripts import load_script
from tests.lua_bridge import FakeRedis, LuaScript, RedisScriptError
from tests.model_check import TOLERANCE, agree, within
from tests.processes import RedisServer

SCRIPT = load_script()
MIN_RATE, MAX_RATE = 1e-6, 1e6
MAX_CAPACITY = 1e6
EXAMPLES = 400
STEPS = 40

MICROS = 1_000_000

# TIME at the start: 0, today, a year from 2100, or anywhere in 32-bit seconds.
clock_starts = st.one_of(
    st.sampled_from([0, 1_700_000_000 * MICROS, 4_133_980_800 * MICROS + 123_456]),
    st.integers(0, 2**32 * MICROS),
)
# Steps of Redis's clock in microseconds: none, backward (a failover to a host whose
# clock is behind), sub-millisecond, seconds, and days to years (buckets expire).
time_steps = st.one_of(
    st.just(0),
    st.integers(-10 * MICROS, -1),
    st.integers(1, 999),
    st.integers(1_000, 10 * MICROS),
    st.integers(10 * MICROS, 10**9 * MICROS),
)
log_uniform_rates = st.builds(lambda exponent: 10.0**exponent, st.floats(math.log10(MIN_RATE), math.log10(MAX_RATE)))
rates = st.one_of(
    st.sampled_from([MIN_RATE, MAX_RATE, 1.0, 50.0, 0.1, 1 / 3, 1 / 86400]),
    log_uniform_rates,
    st.floats(MIN_RATE, MAX_RATE),
)
# The gateway's bursts are whole numbers; the script takes any, so fractions too.
# 1e10 makes a bucket that refills in more than 1e14 s: its TTL is capped.
capacities = st.one_of(
    st.sampled_from([1.0, 2.0, 20.0, MAX_CAPACITY, 1e10]),
    st.integers(1, int(MAX_CAPACITY)).map(float),
    st.floats(0.001, MAX_CAPACITY),
)

coverage: collections.Counter[str] = collections.Counter()


def script_args(capacity: float, rate: float, cost: int, debt: float = 0.0) -> list[str]:
    """One bucket's ARGV as gateway.limiter.redis_store formats it (after the kinds, ARGV[1])."""
    return [repr(float(capacity)), repr(float(rate)), repr(float(cost)), repr(float(debt))]


def argv(*buckets: list[str], kinds: str = "") -> list[str]:
    """ARGV for buckets given by `script_args`: their kinds (default all "b"), then their values."""
    return [kinds or "b" * len(buckets), *(a for values in buckets for a in values)]


# How long a shaping limit (mode: delay) may hold a request, in seconds: none (it
# rejects), a fraction of a token's refill, the 500 ms first asked for, and a minute.
max_delays = st.sampled_from([0.0, 0.0, 0.0, 0.001, 0.5, 60.0])


class TokenBucketAgainstModel(RuleBasedStateMachine):
    @initialize(
        limits=st.lists(st.tuples(capacities, rates), min_size=1, max_size=3),
        delays=st.lists(max_delays, min_size=3, max_size=3),
        owed=st.lists(st.sampled_from([False, False, True]), min_size=3, max_size=3),
        start=clock_starts,
    )
    def setup(self, limits: list[tuple[float, float]], delays: list[float], owed: list[bool], start: int) -> None:
        self.redis = FakeRedis()
        self.script = LuaScript(SCRIPT, self.redis)
        self.limits = limits
        # Whether each bucket's charges are owed ("B": taken even when refused, into debt).
        self.owed = owed[: len(limits)]
        # Tokens each bucket may owe: max_delay × rate, as the stores compute it (none when owed).
        self.debts = [0.0 if o else delay * rate for delay, o, (_, rate) in zip(delays, self.owed, limits)]
        self.keys = [f"rl:limit{i}:{{client}}" for i in range(len(limits))]
        self.model: list[bucket.BucketState | None] = [None] * len(limits)
        self.clock = start
        self.redis.set_clock(start)
        self.retry_ms = 0
        # Built once per example, not per draw: a new strategy object is validated and
        # analysed on its first draw, which cost more than the script calls themselves.
        self.choices = st.lists(st.sampled_from(range(len(limits))), min_size=1, unique=True)
        self.costs = [st.one_of(st.just(0), st.integers(1, int(capacity) + 2)) for capacity, _ in limits]
        for _capacity, rate in limits:
            coverage["rate <= 1e-5"] += rate <= 1e-5
            coverage["rate >= 1e5"] += rate >= 1e5

    def now_ms(self) -> float:
        """The script's `now`: the same double, by the same operations."""
        return float(self.redis.seconds) * 1000 + float(self.redis.microseconds) / 1000

    def move_clock(self, step: int) -> None:
        self.clock = max(0, self.clock + step)  # Redis's TIME is never before 1970
        self.redis.set_clock(self.clock)

    @rule(step=time_steps)
    def time_passes(self, step: int) -> None:
        self.move_clock(step)

    @precondition(lambda self: self.retry_ms > 0)
    @rule()
    def client_waits_as_told(self) -> None:
        """Exactly the Retry-After the last denial gave: refill lands on the cost."""
        self.move_clock(self.retry_ms * 1000)
        coverage["waited exactly retry_after"] += 1

    def draw_check(self, data: st.DataObject) -> tuple[list[int], list[int]]:
        """Some of the limits, and a cost for each."""
        chosen = data.draw(self.choices, label="limits")
        costs = [data.draw(self.costs[i], label=f"cost{i}") for i in chosen]
        return chosen, costs

    @rule(data=st.data())
    def check(self, data: st.DataObject) -> None:
        self.call([self.draw_check(data)])

    @rule(data=st.data(), count=st.integers(2, 4))
    def checks_in_one_call(self, data: st.DataObject, count: int) -> None:
        """Several checks in one script call, as a batch of the store sends them: each is
        held to the model in turn, the later ones after what the earlier ones charged."""
        self.call([self.draw_check(data) for _ in range(count)])
        coverage["checks in one call"] += 1

    def call(self, checks: list[tuple[list[int], list[int]]]) -> None:
        keys = [self.keys[i] for chosen, _ in checks for i in chosen]
        args = [
            arg
            for chosen, costs in checks
            for arg in argv(
                *(script_args(*self.limits[i], cost, self.debts[i]) for i, cost in zip(chosen, costs)),
                kinds="".join("B" if self.owed[i] else "b" for i in chosen),
            )
        ]
        reply = self.script(keys, args)
        assert len(reply) == 5 * len(checks)
        for n, (chosen, costs) in enumerate(checks):
            # What Redis holds now is what the last check of each bucket left there.
            later = {i for chosen_later, _ in checks[n + 1 :] for i in chosen_later}
            self.agree_with_model(chosen, costs, reply[5 * n : 5 * n + 5], stored={i for i in chosen if i not in later})

    def agree_with_model(self, chosen: list[int], costs: list[int], reply: list, stored: set[int]) -> None:
        allowed, remaining, retry_ms, wait_ms, resets = reply
        assert resets == [-1] * len(chosen)

        now = self.now_ms()
        specs = [
            bucket.BucketSpec(
                capacity=self.limits[i][0], rate=self.limits[i][1] / 1000, cost=c, debt=self.debts[i], owed=self.owed[i]
            )
            for i, c in zip(chosen, costs)
        ]
        states = [self.model[i] for i in chosen]
        agreement = agree(states, specs, now, bool(allowed), [float(text) for text in remaining])
        outcome = agreement.model
        self._note(states, specs, now, outcome)
        coverage["rounding tie"] += agreement.ties
        coverage["script allowed in a tie"] += agreement.script_over_model

        assert agreement.problems == []
        assert len(remaining) == len(chosen)
        for i, state in zip(chosen, agreement.states):
            self.model[i] = state
        for text, spec, i in zip(remaining, specs, chosen):
            assert float(text) == float(repr(float(text)))  # a number, read back as written
            if (allowed or spec.owed) and spec.cost and i in stored:
                # The reply is exactly what was stored: the gateway's denial cache
                # trusts `remaining < cost`, so 0.99999999999999989 may not read as 1.
                assert float(text) == float(self.redis.hashes[self.keys[i]]["tokens"]), text
        if allowed:
            assert retry_ms == 0
            if outcome.allowed:
                # The wait: the model's, rounded up to the millisecond; 0 when every bucket could pay.
                slack = TOLERANCE * max(1.0, outcome.wait)
                assert outcome.wait - slack <= wait_ms < outcome.wait + 1 + slack, (wait_ms, outcome)
                coverage["delayed"] += wait_ms > 0
                coverage["in debt"] += any(float(text) < 0 for text in remaining)
        elif outcome.allowed:
            pass  # a rounding tie: the model's wait is 0, the script's the ulps it lacks, rounded up
        elif math.isinf(outcome.retry_after):
            assert retry_ms == -1
        elif outcome.retry_after >= 2**63:
            # Past 2^63 ms (292 million years) Redis's reply wraps to -2^63, which
            # the store reads as never: the same answer for any client alive.
            assert retry_ms == -(2**63)
            coverage["retry_after beyond 2^63 ms"] += 1
        else:
            slack = TOLERANCE * max(1.0, outcome.retry_after)
            assert outcome.retry_after - slack <= retry_ms < outcome.retry_after + 1 + slack, (retry_ms, outcome)
        self.retry_ms = max(0, retry_ms)

    def _note(self, states, specs, now, outcome) -> None:
        for state, spec in zip(states, specs):
            coverage["cost 0"] += spec.cost == 0
            coverage["cost above capacity"] += spec.cost > spec.capacity
            if state is not None:
                coverage["zero elapsed"] += now == state.stamp
                coverage["negative elapsed"] += now < state.stamp
                tokens = bucket.refill(state, spec, now).tokens
                coverage["fractional tokens"] += tokens != int(tokens)
            if spec.owed:
                coverage["owed charge refused, taken"] += spec.cost > 0 and not outcome.allowed
                refilled = bucket.refill(state, spec, now).tokens if state is not None else spec.capacity
                coverage["owed read in debt"] += spec.cost == 0 and refilled < 0
        coverage["allowed"] += outcome.allowed
        coverage["denied"] += not outcome.allowed

    @invariant()
    def redis_holds_what_the_model_holds(self) -> None:
        if not hasattr(self, "redis"):
            return
        now = self.now_ms()
        for key, state, (capacity, rate) in zip(self.keys, self.model, self.limits):
            held = self.redis._live(key)
            spec = bucket.BucketSpec(capacity=capacity, rate=rate / 1000, cost=0)
            if held is None:
                # Never charged, or expired: Redis may only forget a bucket that is full again.
                if state is not None:
                    coverage["expired"] += 1
                    assert within(bucket.refill(state, spec, now).tokens, capacity, TOLERANCE, capacity), (state, now)
                    self.model[self.keys.index(key)] = None
                continue
            assert state is not None
            assert float(held["ts"]) == state.stamp
            assert within(float(held["tokens"]), state.tokens, TOLERANCE, capacity), (held, state)


def test_the_script_makes_the_models_decisions():
    coverage.clear()
    run_state_machine_as_test(
        TokenBucketAgainstModel,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    print("coverage:", dict(coverage))
    for case in (
        "zero elapsed", "negative elapsed", "cost 0", "cost above capacity", "rate <= 1e-5", "rate >= 1e5",
        "fractional tokens", "allowed", "denied", "expired", "waited exactly retry_after", "delayed", "in debt",
        "checks in one call", "owed charge refused, taken", "owed read in debt",
    ):
        assert coverage[case] > 0, f"no example had {case}: {dict(coverage)}"


def test_a_rounding_tie_is_the_only_split_decision():
    """Charge a bucket of 1 at 1e-6 tokens a second, wait the 1e9 ms it asks for: the
    script refills 1e6 s × 1e-6 = 1.0 and allows; the model, per millisecond, refills
    1e9 × 9.999999999999999e-10 = 0.9999999999999999 and would deny. The real
    product of those doubles is 0.99999999999999995: a tie 4.5e-17 from the cost."""
    fake = FakeRedis()
    script = LuaScript(SCRIPT, fake)
    spec = bucket.BucketSpec(capacity=1.0, rate=1e-6 / 1000, cost=1)
    assert script(["k"], argv(script_args(1.0, 1e-6, 1))) == [1, ["0"], 0, 0, [-1]]
    state = bucket.BucketState(tokens=0.0, stamp=0.0)
    fake.set_clock(10**9 * 1000)
    allowed, remaining, *_ = script(["k"], argv(script_args(1.0, 1e-6, 1)))
    agreement = agree([state], [spec], 1e9, bool(allowed), [float(r) for r in remaining])
    assert (allowed, agreement.model.allowed, agreement.model.remaining) == (1, False, (0.9999999999999999,))
    assert agreement.problems == []
    assert (agreement.ties, agreement.script_over_model, agreement.widest_tie) == (1, 1, 2**-53)
    # The same split with balances a millionth of a token apart is a failure, not a tie.
    agreement = agree([state], [spec], 1e9, True, [1e-6])
    assert agreement.problems and agreement.ties == 0


PROBE = """
local time = redis.call('TIME')
redis.call('HSET', KEYS[1], 'third', 1/3, 'sum', 0.1 + 0.2, 'big', 2^53 + 2, 'huge', 1e300, 'tiny', 5e-324,
  'whole', 7)
local got = redis.call('HMGET', KEYS[1], 'third', 'sum', 'big', 'huge', 'tiny', 'whole', 'missing')
local absent = redis.call('HMGET', KEYS[2], 'tokens', 'ts')
return {type(time[1]), type(time[2]), got[1], got[2], got[3], got[4], got[5], got[6], type(got[7]),
  type(absent[1]), type(absent[2]), 7.9, -7.9, 1e19, 0/0, {1, 'two', false, 4}, true}
"""


def test_the_bridge_answers_as_a_real_redis_does():
    """The bridge's conversions, held against a real redis-server running the same probe:
    numbers as arguments keep every digit, missing fields are false, TIME is two strings,
    replies truncate numbers and end arrays at the first nil, and PEXPIRE refuses 1e+17."""
    refuse_exponent = "redis.call('SET', KEYS[1], 1) return redis.call('PEXPIRE', KEYS[1], 1e17)"
    with RedisServer() as server:
        client = server.client()
        try:
            real = client.eval(PROBE, 2, "probe", "absent")
            with pytest.raises(redis.ResponseError, match="not an integer"):
                client.eval(refuse_exponent, 1, "x")
        finally:
            client.close()
    fake = FakeRedis()
    fake.set_clock(1_700_000_000 * MICROS)
    assert LuaScript(PROBE, fake)(["probe", "absent"], []) == real
    fake.hashes["x"] = {}
    with pytest.raises(RedisScriptError, match="not an integer"):
        LuaScript(refuse_exponent.replace("redis.call('SET', KEYS[1], 1) ", ""), fake)(["x"], [])
