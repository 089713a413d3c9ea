"""The token-bucket model (gateway/limiter/bucket.py) as pure functions: no I/O, no clock.

A table of single steps pins each rule of the model; a long seeded random
sequence holds it to a second implementation written from the rules alone,
and to the invariants every store relies on. The key derivation the stores
share (gateway/limiter/keys.py) is pure too and is checked at the end.
"""

from __future__ import annotations

import math
import random

import pytest

from gateway.limiter.bucket import (
    BucketSpec,
    BucketState,
    check,
    refill,
    seconds_until_affordable,
    seconds_until_full,
)
from gateway.limiter.keys import DIGEST_BYTES, bucket_key, identity_digest


def spec(capacity: float, rate: float, cost: float = 1) -> BucketSpec:
    return BucketSpec(capacity=capacity, rate=rate, cost=cost)


def state(tokens: float, stamp: float) -> BucketState:
    return BucketState(tokens=tokens, stamp=stamp)


# --- refill: tokens = min(capacity, tokens + elapsed * rate) ---------------------------------

REFILL_CASES = [
    # id, state, spec, now, expected tokens, expected stamp
    ("new bucket starts full", None, spec(10, 1), 5.0, 10.0, 5.0),
    ("no time passed, no refill", state(3, 5.0), spec(10, 1), 5.0, 3.0, 5.0),
    ("elapsed times rate is added", state(3, 5.0), spec(10, 2), 6.5, 6.0, 6.5),
    ("refill stops at capacity", state(3, 5.0), spec(10, 2), 100.0, 10.0, 100.0),
    ("exactly reaching capacity", state(0, 0.0), spec(10, 2), 5.0, 10.0, 5.0),
    ("empty bucket, fractional rate", state(0, 0.0), spec(2, 1 / 3600), 1800.0, 0.5, 1800.0),
    ("very high rate fills at once", state(0, 0.0), spec(5, 1e6), 0.001, 5.0, 0.001),
    ("clock behind the stamp refills nothing", state(3, 10.0), spec(10, 2), 7.0, 3.0, 10.0),
    ("a full bucket stays full", state(10, 0.0), spec(10, 2), 1.0, 10.0, 1.0),
    ("capacity lowered since: clamped down", state(50, 0.0), spec(10, 2), 0.0, 10.0, 0.0),
]


@pytest.mark.parametrize(
    "before, bucket_spec, now, tokens, stamp", [case[1:] for case in REFILL_CASES], ids=[c[0] for c in REFILL_CASES]
)
def test_refill_adds_elapsed_times_rate_up_to_capacity(before, bucket_spec, now, tokens, stamp):
    after = refill(before, bucket_spec, now)
    assert after.tokens == pytest.approx(tokens, rel=1e-12, abs=1e-12)
    assert after.stamp == stamp


def test_refill_clamps_negative_elapsed_to_zero_and_never_moves_the_stamp_backwards():
    before = state(4, 100.0)
    for now in (99.999, 50.0, 0.0, -1e9):
        after = refill(before, spec(10, 1000), now)
        assert after == before
    assert refill(before, spec(10, 1), 100.5) == state(4.5, 100.5)


# --- check: a single bucket ---------------------------------------------------------------------

SINGLE_CASES = [
    # id, state, spec, now, allowed, remaining, retry_after
    ("new bucket pays its first cost", None, spec(100, 10, 1), 0.0, True, 99.0, 0.0),
    ("exactly enough tokens is allowed", state(3, 0.0), spec(10, 1, 3), 0.0, True, 0.0, 0.0),
    ("a hair too few tokens is denied", state(2.999, 0.0), spec(10, 1, 3), 0.0, False, 2.999, 0.001),
    ("refill makes it affordable", state(1, 0.0), spec(10, 1, 3), 2.0, True, 0.0, 0.0),
    ("empty bucket waits cost / rate", state(0, 0.0), spec(10, 4, 2), 0.0, False, 0.0, 0.5),
    ("deficit only is waited for", state(1.5, 0.0), spec(10, 1, 4), 0.0, False, 1.5, 2.5),
    ("cost 0 on an empty bucket is allowed", state(0, 0.0), spec(10, 1, 0), 0.0, True, 0.0, 0.0),
    ("cost 0 on a new bucket charges nothing", None, spec(10, 1, 0), 0.0, True, 10.0, 0.0),
    ("cost above capacity never passes", None, spec(5, 1, 6), 0.0, False, 5.0, math.inf),
    ("cost above capacity, empty", state(0, 0.0), spec(5, 1, 6), 0.0, False, 0.0, math.inf),
    ("cost equal to capacity on a full bucket", None, spec(5, 1, 5), 0.0, True, 0.0, 0.0),
    ("fractional rate: one an hour", state(0, 0.0), spec(2, 1 / 3600, 1), 0.0, False, 0.0, 3600.0),
    ("very high rate: a microsecond", state(0, 0.0), spec(5, 1e6, 1), 0.0, False, 0.0, 1e-6),
    ("stamp ahead of now: wait for now to reach it too", state(0, 10.0), spec(10, 1, 2), 7.0, False, 0.0, 5.0),
]


@pytest.mark.parametrize(
    "before, bucket_spec, now, allowed, remaining, retry_after",
    [case[1:] for case in SINGLE_CASES],
    ids=[c[0] for c in SINGLE_CASES],
)
def test_check_allows_when_tokens_cover_the_cost_and_charges_only_then(
    before, bucket_spec, now, allowed, remaining, retry_after
):
    outcome = check([before], [bucket_spec], now)
    assert outcome.allowed is allowed
    assert outcome.remaining == pytest.approx((remaining,), rel=1e-9, abs=1e-12)
    assert outcome.retry_after == pytest.approx(retry_after, rel=1e-9)
    refilled = refill(before, bucket_spec, now)
    expected_tokens = refilled.tokens - bucket_spec.cost if allowed else refilled.tokens
    assert outcome.states == (state(expected_tokens, refilled.stamp),)


def test_a_denied_check_returns_the_refilled_states_unchanged_so_storing_them_charges_nothing():
    before = [state(0.5, 0.0), state(9, 0.0)]
    specs = [spec(10, 1, 1), spec(10, 1, 1)]
    outcome = check(before, specs, 0.25)
    assert not outcome.allowed
    assert outcome.states == (state(0.75, 0.25), state(9.25, 0.25))
    assert outcome.remaining == (0.75, 9.25)


# --- check: several buckets, all-or-nothing ------------------------------------------------------

MULTI_CASES = [
    # id, states, specs, allowed, remaining, retry_after
    (
        "all allow: all are charged",
        [None, state(5, 0.0), state(2, 0.0)],
        [spec(10, 1, 1), spec(10, 1, 2), spec(3, 1, 2)],
        True,
        (9.0, 3.0, 0.0),
        0.0,
    ),
    (
        "the last one denies: none is charged",
        [None, state(5, 0.0), state(1, 0.0)],
        [spec(10, 1, 1), spec(10, 1, 2), spec(3, 1, 2)],
        False,
        (10.0, 5.0, 1.0),
        1.0,
    ),
    (
        "the first one denies: none is charged",
        [state(0, 0.0), None],
        [spec(10, 2, 1), spec(10, 1, 1)],
        False,
        (0.0, 10.0),
        0.5,
    ),
    (
        "two deny: wait for the slower one",
        [state(0, 0.0), state(0, 0.0), None],
        [spec(10, 2, 1), spec(10, 1 / 60, 1), spec(10, 1, 1)],
        False,
        (0.0, 0.0, 10.0),
        60.0,
    ),
    (
        "one can never pay: inf beats any finite wait",
        [state(0, 0.0), None],
        [spec(10, 1, 1), spec(5, 1, 6)],
        False,
        (0.0, 5.0),
        math.inf,
    ),
    (
        "cost 0 beside a denying limit",
        [state(0, 0.0), state(0, 0.0)],
        [spec(10, 1, 0), spec(10, 1, 1)],
        False,
        (0.0, 0.0),
        1.0,
    ),
]


@pytest.mark.parametrize(
    "before, specs, allowed, remaining, retry_after", [c[1:] for c in MULTI_CASES], ids=[c[0] for c in MULTI_CASES]
)
def test_several_limits_are_all_or_nothing_and_retry_after_waits_for_every_bucket(
    before, specs, allowed, remaining, retry_after
):
    outcome = check(before, specs, 0.0)
    assert outcome.allowed is allowed
    assert outcome.remaining == pytest.approx(remaining)
    assert outcome.retry_after == pytest.approx(retry_after)
    assert tuple(s.tokens for s in outcome.states) == pytest.approx(remaining)


def test_check_rejects_mismatched_states_and_specs():
    with pytest.raises(ValueError):
        check([None, None], [spec(1, 1)], 0.0)


def test_seconds_until_full_and_until_affordable():
    assert seconds_until_full(state(4, 0.0), spec(10, 2), 0.0) == 3.0
    assert seconds_until_full(state(10, 0.0), spec(10, 2), 0.0) == 0.0
    # A stamp ahead of now: the refill starts only when now reaches it.
    assert seconds_until_full(state(4, 5.0), spec(10, 2), 3.0) == 5.0
    assert seconds_until_affordable(state(4, 0.0), spec(10, 2, 6), 0.0) == 1.0
    assert seconds_until_affordable(state(7, 0.0), spec(10, 2, 6), 0.0) == 0.0
    assert seconds_until_affordable(state(10, 0.0), spec(10, 2, 11), 0.0) == math.inf


# --- a second implementation, from the rules alone, and a long random sequence ------------------


class Reference:
    """The rules as written in the requirements, one bucket at a time."""

    def __init__(self, specs: list[BucketSpec]) -> None:
        self.specs = specs
        self.tokens: list[float | None] = [None] * len(specs)
        self.stamps: list[float] = [0.0] * len(specs)

    def step(self, indexes: list[int], costs: list[float], now: float) -> tuple[bool, list[float], float]:
        current = []
        for i in indexes:
            capacity, rate = self.specs[i].capacity, self.specs[i].rate
            if self.tokens[i] is None:
                tokens, stamp = capacity, now
            else:
                elapsed = now - self.stamps[i]
                if elapsed < 0:
                    elapsed = 0.0
                tokens = min(capacity, self.tokens[i] + elapsed * rate)
                stamp = self.stamps[i] if self.stamps[i] > now else now
            current.append((tokens, stamp))
        allowed = all(tokens >= cost for (tokens, _), cost in zip(current, costs))
        waits = []
        for i, (tokens, stamp), cost in zip(indexes, current, costs):
            if tokens < cost:
                capacity, rate = self.specs[i].capacity, self.specs[i].rate
                if self.specs[i].owed:  # charged anyway: until a read finds the bucket at zero again
                    waits.append((stamp - now) + (cost - tokens) / rate)
                else:
                    waits.append(math.inf if cost > capacity else (stamp - now) + (cost - tokens) / rate)
        remaining = []
        for i, (tokens, stamp), cost in zip(indexes, current, costs):
            if allowed or self.specs[i].owed:
                tokens -= cost
                # Only a charged bucket is written back, as the stores do.
                if cost:
                    self.tokens[i], self.stamps[i] = tokens, stamp
            remaining.append(tokens)
        return allowed, remaining, (0.0 if allowed else max(waits))


def test_random_sequences_match_a_reference_written_from_the_rules_and_keep_the_invariants():
    rng = random.Random(20240601)
    for _ in range(40):
        specs = [
            BucketSpec(
                capacity=rng.choice([1, 2, 5, 10, 100]),
                rate=rng.choice([1 / 3600, 0.5, 1, 7, 1e3]),
                cost=0,
                owed=rng.random() < 0.3,  # its charges are taken even when refused, into debt
            )
            for _ in range(4)
        ]
        reference = Reference(specs)
        held: list[BucketState | None] = [None] * len(specs)
        now = 0.0
        for _ in range(150):
            # Mostly forward, sometimes backwards (a clock stepped back), sometimes not at all.
            now += rng.choice([0.0, rng.uniform(0, 0.5), rng.uniform(0, 5), -rng.uniform(0, 2)])
            indexes = rng.sample(range(len(specs)), rng.randint(1, len(specs)))
            costs = [rng.choice([0, 1, 1, 1, 2, 3, specs[i].capacity, specs[i].capacity + 1]) for i in indexes]
            step_specs = [
                BucketSpec(capacity=specs[i].capacity, rate=specs[i].rate, cost=c, owed=specs[i].owed) for i, c in zip(indexes, costs)
            ]
            before = [held[i] for i in indexes]

            outcome = check(before, step_specs, now)
            allowed, remaining, retry_after = reference.step(indexes, costs, now)

            assert outcome.allowed is allowed
            assert outcome.remaining == pytest.approx(remaining, rel=1e-9, abs=1e-9)
            assert outcome.retry_after == pytest.approx(retry_after, rel=1e-9, abs=1e-9)
            for old, new, s in zip(before, outcome.states, step_specs):
                assert new.tokens <= s.capacity and (s.owed or new.tokens >= 0.0)
                if old is not None:
                    assert new.stamp >= old.stamp, "the stamp moved backwards"
                    if not allowed and not s.owed:
                        assert new.tokens >= min(old.tokens, s.capacity), "a denied check took tokens"
            for i, new, s in zip(indexes, outcome.states, step_specs):
                if s.cost and (allowed or s.owed):  # what the stores write back
                    held[i] = new
            if allowed:
                assert outcome.retry_after == 0.0
            else:
                assert outcome.retry_after > 0
                if math.isfinite(outcome.retry_after):
                    # retry_after is tight: a moment before it still denies, at it every bucket can
                    # pay (an owed one: a read, since its charge was taken).
                    retried = [BucketSpec(s.capacity, s.rate, 0 if s.owed else s.cost, owed=s.owed) for s in step_specs]
                    after = list(outcome.states)  # the owed charges taken
                    later = check(after, retried, now + outcome.retry_after * (1 + 1e-9) + 1e-9)
                    assert later.allowed
                    sooner = check(after, retried, now + outcome.retry_after * 0.999)
                    assert not sooner.allowed


def test_charges_over_a_long_run_never_exceed_capacity_plus_refill():
    rng = random.Random(7)
    bucket_spec = BucketSpec(capacity=20, rate=5, cost=1)
    held: BucketState | None = None
    now, charged = 0.0, 0
    for _ in range(5000):
        now += rng.uniform(0, 0.3)
        cost = rng.choice([1, 2, 3])
        outcome = check([held], [BucketSpec(capacity=20, rate=5, cost=cost)], now)
        if outcome.allowed:
            held = outcome.states[0]
            charged += cost
    # Everything paid came from the initial burst or from the refill since the first request.
    assert charged <= bucket_spec.capacity + bucket_spec.rate * now + 1e-6
    # And the limit was actually exercised: a client asking this often was held close to the rate.
    assert charged >= bucket_spec.rate * now * 0.9


# --- keys: what the stores name a bucket --------------------------------------------------------


def test_identity_digest_is_fixed_length_keyed_and_hides_the_identity():
    secret = b"s" * 32
    digest = identity_digest(secret, "header:x-api-key=sk_live_123")
    assert len(digest) == DIGEST_BYTES * 2 and int(digest, 16) >= 0
    assert "sk_live_123" not in digest
    assert identity_digest(secret, "header:x-api-key=sk_live_123") == digest
    assert identity_digest(b"t" * 32, "header:x-api-key=sk_live_123") != digest
    assert identity_digest(secret, "header:x-api-key=sk_live_124") != digest
    # However long or odd the client's value, the digest has the same shape.
    for identity in ("ip=1.2.3.4", "query:k=" + "x" * 10_000, "cookie:c=\udcff{}}{"):
        assert len(identity_digest(secret, identity)) == DIGEST_BYTES * 2
    # A secret longer than BLAKE2b's 64-byte key limit is accepted.
    assert len(identity_digest(b"k" * 100, "ip=1.2.3.4")) == DIGEST_BYTES * 2


def test_bucket_key_puts_the_digest_in_a_cluster_hash_tag():
    assert bucket_key("rl:", "per-ip", "ab12") == "rl:per-ip:{ab12}"


# --- shaping (mode: delay): a bucket may owe max_delay × rate tokens ---------------------------


def test_a_shaping_bucket_queues_requests_fairly_and_rejects_past_its_debt():
    """Rate 10/s, burst 1, max_delay 0.5 s (debt 5 tokens), 8 requests at the same instant:
    one goes at once, the next five wait 0.1, 0.2, ... 0.5 s, and the rest are rejected,
    charging nothing, told to come back when the debt would cover them."""
    shaping = BucketSpec(capacity=1, rate=10, cost=1, debt=0.5 * 10)
    held: BucketState | None = None
    waits, rejected = [], []
    for _ in range(8):
        outcome = check([held], [shaping], 0.0)
        if outcome.allowed:
            waits.append(outcome.wait)
            held = outcome.states[0]
        else:
            rejected.append(outcome)
    assert waits == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4, 0.5])
    assert held == BucketState(tokens=-5.0, stamp=0.0)
    assert [o.remaining for o in rejected] == [(-5.0,), (-5.0,)]
    assert [o.retry_after for o in rejected] == pytest.approx([0.1, 0.1])
    assert all(o.states == (held,) and o.wait == 0 for o in rejected)
    # As the debt is repaid, the queue moves: 0.1 s later one more fits, waiting the full 0.5 s.
    later = check([held], [shaping], 0.1)
    assert later.allowed and later.wait == pytest.approx(0.5) and later.remaining == pytest.approx((-5.0,))


def test_released_requests_are_exactly_those_a_plain_bucket_admits():
    """Each shaped request's release time (its check time plus its wait) is a time at which
    a plain bucket of the same capacity and rate, charged at the earlier releases, admits it."""
    rng = random.Random(7)
    shaping = BucketSpec(capacity=3, rate=4, cost=1, debt=2.0 * 4)
    plain = BucketSpec(capacity=3, rate=4, cost=1)
    held: BucketState | None = None
    releases = []
    now = 0.0
    for _ in range(2000):
        now += rng.expovariate(12)  # three times the rate: most requests wait or are rejected
        outcome = check([held], [shaping], now)
        if outcome.allowed:
            held = outcome.states[0]
            assert outcome.wait <= 2.0 + 1e-9
            releases.append(now + outcome.wait)
    assert releases == sorted(releases)  # first come, first released
    replayed: BucketState | None = None
    for release in releases:
        found = refill(replayed, plain, release)
        assert found.tokens >= plain.cost - 1e-9, (release, found)  # to within rounding
        replayed = BucketState(tokens=found.tokens - plain.cost, stamp=found.stamp)
    assert len(releases) > 4 * (now - 2.0)  # shaping kept the bucket busy: nearly its rate went through


def test_several_limits_stay_all_or_nothing_when_one_shapes_and_the_wait_is_the_longest():
    shaping = BucketSpec(capacity=1, rate=10, cost=1, debt=5)
    other_shaping = BucketSpec(capacity=1, rate=1, cost=1, debt=1)
    strict = BucketSpec(capacity=2, rate=1, cost=1)
    empty = BucketState(tokens=0.0, stamp=0.0)
    both = check([empty, empty], [shaping, other_shaping], 0.0)
    assert both.allowed and both.wait == pytest.approx(1.0)  # the longer of 0.1 s and 1 s
    assert both.remaining == (-1.0, -1.0)
    # The strict limit cannot pay: the shaping bucket is not charged into debt either.
    denied = check([empty, empty], [shaping, strict], 0.0)
    assert not denied.allowed and denied.wait == 0 and denied.states == (empty, empty)
    assert denied.retry_after == pytest.approx(1.0)


# --- owed charges: taken whatever the answer, into debt -----------------------------------------


def test_envoys_read_then_charge_pattern_drives_the_bucket_into_debt_and_refuses_the_next_read():
    """Envoy's charge after the response: a read (cost 0) before the request, the hits after
    it. 2 per minute, as the reference's token-quota.sh: three reads pass (the third finds
    the bucket at exactly 0, as the reference's count at its limit passes), the third charge
    takes it to -1, and the fourth read is refused until the bucket has refilled past zero."""
    rate = 2 / 60
    read, hits = BucketSpec(2, rate, 0, owed=True), BucketSpec(2, rate, 1, owed=True)
    held: BucketState | None = None
    for expected in (1.0, 0.0, -1.0):
        assert check([held], [read], 0.0).allowed
        charged = check([held], [hits], 0.0)
        assert charged.allowed is (expected >= 0) and charged.remaining == (expected,)
        held = charged.states[0]
    refused = check([held], [read], 0.0)
    assert not refused.allowed and refused.remaining == (-1.0,) and refused.retry_after == pytest.approx(30.0)
    assert not check([held], [read], 29.9).allowed
    assert check([held], [read], 30.0).allowed
    # A charge larger than the whole bucket is taken too, and repaid at the rate.
    huge = check([None], [BucketSpec(2, rate, 10, owed=True)], 0.0)
    assert not huge.allowed and huge.states == (BucketState(-8.0, 0.0),) and huge.remaining == (-8.0,)
    assert huge.retry_after == pytest.approx(240.0)  # until a read passes: eight tokens at 1 per 30 s
    assert seconds_until_full(huge.states[0], read, 0.0) == pytest.approx(300.0)


def test_an_owed_charge_is_taken_when_another_limit_refuses_and_the_others_stay_all_or_nothing():
    owed, plain = BucketSpec(5, 1, 2, owed=True), BucketSpec(1, 1, 1)
    empty = BucketState(0.0, 0.0)
    refused = check([None, empty], [owed, plain], 0.0)
    assert not refused.allowed
    assert refused.states == (BucketState(3.0, 0.0), empty)  # the owed charge taken, the plain one not
    assert refused.remaining == (3.0, 0.0) and refused.retry_after == pytest.approx(1.0)


def test_an_owed_quota_counts_past_its_limit_and_refuses_reads_until_its_window_ends():
    from gateway.limiter import quota

    hour = 3_600_000
    charge = quota.spec_of("hour", 0, 2, 3, owed=True)
    first = check([None], [charge], 0.0, quota_now=1000.0)
    assert not first.allowed and first.states[0].count == 3 and first.remaining == (-1.0,)
    assert first.retry_after == pytest.approx(hour - 1000)  # not never: the next window reads it again
    read = quota.spec_of("hour", 0, 2, 0, owed=True)
    assert not check([first.states[0]], [read], 0.0, quota_now=hour - 1).allowed
    assert check([first.states[0]], [read], 0.0, quota_now=hour).allowed


def test_owed_charges_over_a_long_run_admit_no_more_than_capacity_plus_refill_plus_one_charge():
    """Reads before, charges after, as Envoy sends them: what is charged in all never exceeds
    the burst plus the refill by more than the last charge, which the bucket owes."""
    rng = random.Random(11)
    capacity, rate = 20, 5
    held: BucketState | None = None
    now, charged, refused = 0.0, 0, 0
    for _ in range(5000):
        now += rng.uniform(0, 0.3)
        if not check([held], [BucketSpec(capacity, rate, 0, owed=True)], now).allowed:
            refused += 1
            continue
        cost = rng.choice([1, 2, 3, 8, 30])  # the hits are known only after the response
        outcome = check([held], [BucketSpec(capacity, rate, cost, owed=True)], now)
        held = outcome.states[0]
        charged += cost
    assert charged <= capacity + rate * now + 30
    assert charged >= rate * now * 0.9 and refused > 0

