"""Token-bucket math: the reference model every store carries out. No I/O, no clock.

A bucket holds `tokens` as of time `stamp` (seconds). It refills continuously
at `rate` tokens per second up to `capacity`. A request of several limits is
all-or-nothing: it is allowed only if every bucket holds at least its cost, and
only then is every bucket charged. `lua/token_bucket.lua` is the same model in
milliseconds, and the shared store tests hold both to it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BucketState:
    tokens: float
    stamp: float


@dataclass(frozen=True, slots=True)
class BucketSpec:
    capacity: float
    rate: float  # tokens per second
    cost: float


@dataclass(frozen=True, slots=True)
class Outcome:
    """The result of one all-or-nothing check over several buckets."""

    allowed: bool
    remaining: tuple[float, ...]  # per bucket: after the charge if allowed, else as found
    retry_after: float  # seconds until every bucket could pay; 0 when allowed, inf if never
    states: tuple[BucketState, ...]  # the states to store back (unchanged ones when denied)


def refill(state: BucketState | None, spec: BucketSpec, now: float) -> BucketState:
    """The bucket as of `now`. A new bucket starts full; the clock never runs backwards."""
    if state is None:
        return BucketState(tokens=spec.capacity, stamp=now)
    elapsed = max(0.0, now - state.stamp)
    tokens = min(spec.capacity, state.tokens + elapsed * spec.rate)
    return BucketState(tokens=tokens, stamp=max(state.stamp, now))


def check(states: Sequence[BucketState | None], specs: Sequence[BucketSpec], now: float) -> Outcome:
    """Check every bucket, then charge all of them only if all allow."""
    current = [refill(state, spec, now) for state, spec in zip(states, specs, strict=True)]
    short = [(state, spec) for state, spec in zip(current, specs) if state.tokens < spec.cost]
    if short:
        return Outcome(
            allowed=False,
            remaining=tuple(s.tokens for s in current),
            retry_after=max(seconds_until_affordable(state, spec, now) for state, spec in short),
            states=tuple(current),
        )
    charged = tuple(BucketState(tokens=s.tokens - spec.cost, stamp=s.stamp) for s, spec in zip(current, specs))
    return Outcome(allowed=True, remaining=tuple(s.tokens for s in charged), retry_after=0.0, states=charged)


def seconds_until_affordable(state: BucketState, spec: BucketSpec, now: float) -> float:
    """When a bucket left alone could pay its cost; inf if the cost exceeds its capacity."""
    if spec.cost > spec.capacity:
        return math.inf
    # A stamp ahead of `now` (a clock that stepped back) refills nothing until `now` reaches it.
    return max(0.0, state.stamp - now) + max(0.0, spec.cost - state.tokens) / spec.rate


def seconds_until_full(state: BucketState, spec: BucketSpec, now: float) -> float:
    """When a bucket left alone would be full again: the moment it may be forgotten."""
    return max(0.0, state.stamp - now) + (spec.capacity - state.tokens) / spec.rate
