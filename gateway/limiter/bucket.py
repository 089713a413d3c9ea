"""Token-bucket math: the reference model every store carries out. No I/O, no clock.

A bucket holds `tokens` as of time `stamp` (seconds). It refills continuously
at `rate` tokens per second up to `capacity`. A request of several limits is
all-or-nothing: it is allowed only if every bucket holds at least its cost, and
only then is every bucket charged. `lua/token_bucket.lua` is the same model in
milliseconds, and the shared store tests hold both to it.

A lease (`lease`, carried by `lua/token_lease.lua`) takes several whole tokens
from one bucket at once, for a gateway to spend locally: as many as it wants or
the bucket holds, whichever is fewer, but never fewer than the cost. Taking
exactly the cost is `check` of that one bucket.

Shaping (`mode: delay`): a bucket may owe up to `debt` tokens (max_delay × rate).
A request it cannot pay now, but could within its debt, is charged now, taking
the bucket below zero, and told to `wait` until the tokens it took would have
refilled. Each later request finds a deeper debt and waits longer, so the
requests released after their waits are exactly those a plain bucket admits.

A request's limits may also include fixed-window quotas (`gateway.limiter.quota`),
checked and charged in the same all-or-nothing step.

Owed charges (`owed`): a limit whose charge is owed whatever the answer (a cost settled
after the response, or a rule that charges every hit) is charged even when the request
is refused and even past what the bucket holds, so the bucket goes into debt (a quota:
past its limit). It still answers as any limit does: it refuses when it could not pay the
cost, and a cost of 0 (a read) is refused while the bucket is below zero. Its retry is
when such a read passes again. The other limits of the request stay all or nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.config.model import Limit
from gateway.limiter import quota
from gateway.limiter.store import BucketReading, LimitCheck


@dataclass(frozen=True, slots=True)
class BucketState:
    tokens: float
    stamp: float


@dataclass(frozen=True, slots=True)
class BucketSpec:
    capacity: float
    rate: float  # tokens per second
    cost: float
    debt: float = 0.0  # tokens the bucket may owe: max_delay × rate; 0 rejects what it cannot pay now
    owed: bool = False  # charged even when refused, past zero (then `debt` is 0)


@dataclass(frozen=True, slots=True)
class Outcome:
    """The result of one all-or-nothing check over several buckets."""

    allowed: bool
    # per limit: after the charge if allowed (or owed), else as found (a quota: its limit less its count)
    remaining: tuple[float, ...]
    retry_after: float  # seconds until every limit could pay (an owed one: a read); 0 when allowed, inf if never
    states: tuple[BucketState | quota.QuotaState, ...]  # the states to store back (when denied: only owed ones charged)
    wait: float = 0.0  # when allowed: how long the request waits before it goes on (shaping)
    resets: tuple[float | None, ...] = ()  # per limit: a quota's time until its window ends, None for a bucket


def refill(state: BucketState | None, spec: BucketSpec, now: float) -> BucketState:
    """The bucket as of `now`. A new bucket starts full; the clock never runs backwards."""
    if state is None:
        return BucketState(tokens=spec.capacity, stamp=now)
    elapsed = max(0.0, now - state.stamp)
    tokens = min(spec.capacity, state.tokens + elapsed * spec.rate)
    return BucketState(tokens=tokens, stamp=max(state.stamp, now))


Spec = BucketSpec | quota.QuotaSpec
State = BucketState | quota.QuotaState


def check(
    states: Sequence[State | None],
    specs: Sequence[Spec],
    now: float,
    *,
    quota_now: float | None = None,
    quota_unit: float = 1.0,
) -> Outcome:
    """Check every limit, then charge all of them only if all allow (or, for a bucket that
    may owe, allow after a wait). `now` is in the unit of the rates. Quotas are counted at
    `quota_now` (default `now`), in milliseconds since the epoch, `quota_unit` of them
    to one unit of `now` (the script runs in milliseconds: 1; the in-process store in
    seconds: 1000)."""
    wall = now if quota_now is None else quota_now
    found: list[tuple[float, State, float | None]] = []  # (balance, state as of now, time to its reset)
    retry = wait = 0.0
    allowed = True
    for state, spec in zip(states, specs, strict=True):
        if isinstance(spec, quota.QuotaSpec):
            count, start, end = quota.used(state, spec, wall)  # type: ignore[arg-type]
            reset = (end - wall) / quota_unit
            found.append((spec.limit - count, quota.QuotaState(count=count, start=start), reset))
            if count + spec.cost > spec.limit:
                allowed = False
                never = spec.cost > spec.limit and not spec.owed  # an owed charge is read again next window
                retry = max(retry, math.inf if never else reset)
            continue
        current = refill(state, spec, now)  # type: ignore[arg-type]
        found.append((current.tokens, current, None))
        if spec.owed:
            if current.tokens < spec.cost:
                allowed = False
                # Until a read (a cost of 0) passes again: the charge is taken all the same.
                owing = BucketState(tokens=current.tokens - spec.cost, stamp=current.stamp)
                retry = max(retry, seconds_until_affordable(owing, BucketSpec(spec.capacity, spec.rate, 0.0), now))
            continue
        if current.tokens < spec.cost:
            until = seconds_until_affordable(current, spec, now)
            if math.isinf(until) or current.tokens - spec.cost < -spec.debt:
                allowed = False
                # A bucket that may owe admits again once the debt would cover the rest.
                retry = max(retry, max(0.0, until - spec.debt / spec.rate))
            else:
                wait = max(wait, until)
    resets = tuple(reset for _, _, reset in found)
    if not allowed:
        return Outcome(
            allowed=False,
            remaining=tuple(balance - spec.cost if spec.owed else balance for (balance, _, _), spec in zip(found, specs)),
            retry_after=retry,
            states=tuple(_charged(state, spec) if spec.owed else state for (_, state, _), spec in zip(found, specs)),
            resets=resets,
        )
    return Outcome(
        allowed=True,
        remaining=tuple(balance - spec.cost for (balance, _, _), spec in zip(found, specs)),
        retry_after=0.0,
        states=tuple(_charged(state, spec) for (_, state, _), spec in zip(found, specs)),
        wait=wait,
        resets=resets,
    )


def _charged(state: State, spec: Spec) -> State:
    if isinstance(state, quota.QuotaState):
        return quota.QuotaState(count=state.count + spec.cost, start=state.start)
    return BucketState(tokens=state.tokens - spec.cost, stamp=state.stamp)


def refunded(state: BucketState, capacity: float, tokens: float) -> BucketState:
    """`tokens` given back to a bucket as of its own stamp, never past `capacity`: it then
    holds no more than it would had they never been charged (`lua/token_refund.lua`). A
    settlement that charged less than was reserved gives back the difference this way; one
    that charged more is an owed check of the difference (`check`, `BucketSpec.owed`)."""
    return BucketState(tokens=min(capacity, state.tokens + tokens), stamp=state.stamp)


@dataclass(frozen=True, slots=True)
class LeaseOutcome:
    allowed: bool
    granted: int  # whole tokens taken: at least the cost when allowed, 0 when denied
    remaining: float  # after the grant if allowed, else as found
    retry_after: float  # seconds until the bucket could pay the cost; 0 when allowed, inf if never
    state: BucketState  # the state to store back


def lease(state: BucketState | None, spec: BucketSpec, want: int, now: float) -> LeaseOutcome:
    """Take min(want, whole tokens held) tokens, and at least `spec.cost`, or deny if the
    bucket holds less than the cost. `spec.cost` is a whole number."""
    current = refill(state, spec, now)
    if current.tokens < spec.cost:
        return LeaseOutcome(
            allowed=False,
            granted=0,
            remaining=current.tokens,
            retry_after=seconds_until_affordable(current, spec, now),
            state=current,
        )
    granted = max(int(spec.cost), min(want, math.floor(current.tokens)))
    after = BucketState(tokens=current.tokens - granted, stamp=current.stamp)
    return LeaseOutcome(allowed=True, granted=granted, remaining=after.tokens, retry_after=0.0, state=after)


def seconds_until_affordable(state: BucketState, spec: BucketSpec, now: float) -> float:
    """When a bucket left alone could pay its cost; inf if the cost exceeds its capacity."""
    if spec.cost > spec.capacity:
        return math.inf
    # A stamp ahead of `now` (a clock that stepped back) refills nothing until `now` reaches it.
    return max(0.0, state.stamp - now) + max(0.0, spec.cost - state.tokens) / spec.rate


def seconds_until_full(state: BucketState, spec: BucketSpec, now: float) -> float:
    """When a bucket left alone would be full again: the moment it may be forgotten."""
    return max(0.0, state.stamp - now) + (spec.capacity - state.tokens) / spec.rate


def spec_of(check: LimitCheck) -> Spec:
    """The model's spec of one check: a quota's windows, or a bucket that may owe
    `max_delay` × rate tokens when the check may wait, or whatever an owed charge takes."""
    limit = check.limit
    if limit.quota is not None:
        return quota.spec_of(limit.quota.per, limit.quota.reset, limit.quota.limit, check.cost, owed=check.owed)
    rate = limit.rate.per_second
    if check.owed:  # charged whatever the answer: it never waits
        return BucketSpec(capacity=limit.burst, rate=rate, cost=check.cost, owed=True)
    return BucketSpec(capacity=limit.burst, rate=rate, cost=check.cost, debt=check.max_delay * rate)


def reading(key: str, limit: Limit, state: BucketState | None, now: float) -> BucketReading:
    """A stored bucket state (None: none held) as refilled up to `now`."""
    spec = BucketSpec(capacity=limit.burst, rate=limit.rate.per_second, cost=0)
    current = refill(state, spec, now)
    return BucketReading(key=key, held=state is not None, tokens=current.tokens, full_in=seconds_until_full(current, spec, now))
