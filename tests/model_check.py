"""One script call held against the reference model (gateway/limiter/bucket.py):
the comparison the Lua state machine (test_lua_model.py) and the replay of real
decisions (test_replay.py) both make.

The model runs in the script's units, milliseconds, on the very double the
script computes from TIME, with its rate per millisecond. The two still round
differently: the script refills `elapsed / 1000 * rate`, the model
`elapsed * (rate / 1000)`. So they compare as follows.

- **Balances** (tokens found, and tokens remaining) agree to within
  `TOLERANCE × max(1, capacity)`: 1e-9 absolute for a capacity up to 1, 1e-9
  relative to the capacity above it. Tokens stay between the debt (a shaping limit's,
  or what owed charges took past zero) and the capacity, each step rounds by an ulp or
  two of the largest of them (2.2e-16 × capacity for a debt within it), and the bound
  leaves millions of ulps for a long run. A lost refill, a double charge or a
  unit slip is at least a millionth of a token at the rates covered.
- **Decisions** are identical, and each carrier decides by its own balance
  (allowed exactly when every bucket holds its cost, less the debt it may run
  into when it shapes: `balance - cost >= -debt`). The one exception is a
  *rounding tie*: the cost lies between the two balances, which agree to within
  the same tolerance. Two carriers that round in a different order cannot
  agree bit for bit at such a point. Two examples:
  - In the state machine, a bucket of 1 at 1e-6 tokens a second waits the
    1e9 ms it was told to. The script refills 1e6 × 1e-6 = 1.0 and allows.
    The model refills 1e9 × 9.999999999999999e-10 = 0.9999999999999999 and
    denies. The balances are 1 ulp apart.
  - In the replay, Redis's clock in ms at today's epoch has a resolution of
    2^-12 ms. So at 50/s every refill is a multiple of 0.05 × 2^-12 tokens,
    and a balance can be exactly the cost in real arithmetic. The denial
    cache sends the next check just as the balance reaches the cost, so this
    happens about once in a few thousand decisions. In one run the two
    carriers had drifted 4.4e-15 apart (20 ulps) by then: the script held
    0.9999999999999978 and denied, and the model held 1.0000000000000022 and
    allowed. In a simulated flood of 300,000 calls through the Lua bridge,
    the drift reached 6.4e-13. That is well inside the tolerance of 2e-8
    for a capacity of 20.
  Every tie is counted, with its gap and direction (`script_over_model`
  counts the ties where the script allowed and the model did not). After a
  tie the model follows the script's decision, so the two carry the same
  charges forward.
- **The denial cache's premise**, `remaining < cost` read from the reply,
  is the model's answer too, again except within a rounding tie.
- **Owed charges** (`BucketSpec.owed`) are charged whether the call is allowed or not, so
  their remaining is after the charge either way, and each refuses exactly when its
  balance after the charge is below zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.limiter import bucket

TOLERANCE = 1e-9


def within(a: float, b: float, bound: float, *scale: float) -> bool:
    return abs(a - b) <= bound * max(1.0, *scale)


@dataclass
class Agreement:
    """How one script call compared with the model."""

    model: bucket.Outcome
    problems: list[str] = field(default_factory=list)
    ties: int = 0  # decisions, or remaining-below-cost answers, split by rounding
    script_over_model: int = 0  # of those, decisions the script allowed and the model denied
    widest_tie: float = 0.0  # the largest gap between the balances of a tie
    # The model's buckets after the call, charged only if the script allowed (or the charge is
    # owed) with a cost above 0, as the script (and the in-process store) write them.
    states: list[bucket.BucketState | None] = field(default_factory=list)


def agree(
    states: Sequence[bucket.BucketState | None],
    specs: Sequence[bucket.BucketSpec],
    now: float,
    script_allowed: bool,
    script_remaining: Sequence[float],
) -> Agreement:
    outcome = bucket.check(states, specs, now)
    result = Agreement(model=outcome)
    found = [bucket.refill(state, spec, now) for state, spec in zip(states, specs)]
    script_found = [r + spec.cost if script_allowed or spec.owed else r for r, spec in zip(script_remaining, specs)]

    # Each carrier decides by its own balances.
    if script_allowed:
        consistent = all(r >= -spec.debt for r, spec in zip(script_remaining, specs))
    else:
        consistent = any(
            r < 0 if spec.owed else r - spec.cost < -spec.debt or spec.cost > spec.capacity
            for r, spec in zip(script_remaining, specs)
        )
    if not consistent:
        result.problems.append(f"the script decided allowed={script_allowed} against its own balances {script_remaining}")
    for mine, theirs, spec in zip(found, script_found, specs):
        if not within(theirs, mine.tokens, TOLERANCE, spec.capacity):
            result.problems.append(f"tokens found: script {theirs!r}, model {mine.tokens!r} ({spec})")
    if script_allowed != outcome.allowed:
        split = [
            (theirs, mine.tokens, spec)
            for mine, theirs, spec in zip(found, script_found, specs)
            if (spec.owed or spec.cost <= spec.capacity)
            and (theirs - spec.cost >= -spec.debt) != (mine.tokens - spec.cost >= -spec.debt)
        ]
        if split and all(within(t, m, TOLERANCE, s.capacity) for t, m, s in split):
            result.ties += 1
            result.script_over_model += script_allowed
            result.widest_tie = max(result.widest_tie, *(abs(t - m) for t, m, _ in split))
        else:
            result.problems.append(f"script allowed={script_allowed}, model {outcome} (balances {split})")

    model_remaining = [s.tokens - spec.cost if script_allowed or spec.owed else s.tokens for s, spec in zip(found, specs)]
    for theirs, mine, spec in zip(script_remaining, model_remaining, specs):
        if not within(theirs, mine, TOLERANCE, spec.capacity):
            result.problems.append(f"remaining: script {theirs!r}, model {mine!r} ({spec})")
        elif (theirs < spec.cost) != (mine < spec.cost):
            result.ties += 1  # within TOLERANCE, as just checked
            result.widest_tie = max(result.widest_tie, abs(theirs - mine))

    result.states = [
        bucket.BucketState(tokens=s.tokens - spec.cost, stamp=s.stamp) if (script_allowed or spec.owed) and spec.cost else state
        for state, s, spec in zip(states, found, specs)
    ]
    return result
