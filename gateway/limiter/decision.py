"""What the limiter answers: each limit's status and the request's decision, and the pure
functions that build them from a store's answer, a cached denial or a failure policy's
share. No I/O and no state: the limiter (gateway.limiter.limiter) calls these, and the
proxy, the access log and the tiers read what they return.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.config.model import Limit
from gateway.limiter.denial_cache import CachedDenial
from gateway.limiter.outcomes import ALLOW, DELAYED, DENY, FAIL_LOCAL, FAILURE_OUTCOMES, SHADOW_LIMITED, SKIPPED
from gateway.limiter.store import LimitCheck, StoreDecision


# Not frozen: a frozen dataclass sets each field through object.__setattr__ (three times the
# cost), and one is made for every check. Treated as immutable all the same: changed only
# through dataclasses.replace.
@dataclass(slots=True)
class LimitStatus:
    limit: Limit
    cost: int
    remaining: float | None  # None when unknown: the store failed open, or a cached denial answered
    outcome: str  # allow | delayed | deny | skipped | shadow_limited | fail_open | fail_closed | fail_local
    reset: float | None = None  # a quota's seconds until its window ends, when the store said

    @property
    def denied(self) -> bool:
        """Whether this limit denied the request: from the store, or from the local stand-in."""
        if self.outcome == DENY:
            return True
        return self.outcome == FAIL_LOCAL and self.remaining is not None and self.remaining < self.cost


# Not frozen: a frozen dataclass sets each field through object.__setattr__ (three times the
# cost), and one is made for every check. Treated as immutable all the same: changed only
# through dataclasses.replace.
@dataclass(slots=True)
class Decision:
    allowed: bool
    statuses: tuple[LimitStatus, ...]
    retry_after: float  # seconds; 0 when allowed
    store_failed: bool  # denied because a fail-closed limit could not be checked, or the in-process store was full
    wait: float = 0.0  # seconds an allowed request waits before it goes on (mode: delay)

    @property
    def store_unanswered(self) -> bool:
        """Whether the store failed this request (a failure policy decided some limit): it
        is not asked again for the request's concurrency limits, which take their policies."""
        return any(s.outcome in FAILURE_OUTCOMES for s in self.statuses)


# Limits a failure line names; a route has a few, an Envoy request up to 64 descriptors.
LOGGED_LIMITS = 5
# The decision for a request with no limits: nothing to ask the store.
UNLIMITED = Decision(allowed=True, statuses=(), retry_after=0.0, store_failed=False)


def local_share(limit: Limit, divisor: int, cost: int) -> Limit:
    """The conservative stand-in for `limit` under `on_store_error: local`: this
    instance's share of the fleet's limit, 1/`divisor` of its rate and burst.

    Its burst is never below the request's cost (nor 1), or a burst split many
    ways would never let such a request through."""
    rate = dataclasses.replace(limit.rate, tokens=limit.rate.tokens / divisor)
    burst = max(1.0, float(cost), limit.burst / divisor)
    share = None if limit.quota is None else dataclasses.replace(limit.quota, limit=burst)  # a quota's share of its window
    return dataclasses.replace(limit, rate=rate, burst=burst, quota=share)


def decision_of(checks: Sequence[LimitCheck], answer: StoreDecision) -> Decision:
    statuses = tuple(
        LimitStatus(
            limit=c.limit,
            cost=c.cost,
            remaining=left,
            outcome=owed_outcome(left) if c.owed else outcome_of(answer.allowed, left, c.cost, c.max_delay * c.limit.rate.per_second),
            reset=reset,
        )
        for c, left, reset in zip(checks, answer.remaining, answer.resets)
    )
    return Decision(
        allowed=answer.allowed, statuses=statuses, retry_after=answer.retry_after, store_failed=False, wait=answer.wait
    )


def outcome_of(allowed: bool, left: float | None, cost: int, debt: float) -> str:
    """`debt`: the tokens a shaping check's bucket may owe (max_delay × rate; 0 when it may
    not wait). A bucket that could pay within it would have delayed the request, not denied
    it: when another limit denies, it was not asked to decide, as a bucket with room is not."""
    if allowed:
        # Charged below zero: this limit is why the request waits.
        return DELAYED if left is not None and left < 0 else ALLOW
    return DENY if left is not None and left - cost < -debt else SKIPPED


def owed_outcome(left: float | None) -> str:
    """An owed charge's outcome: it is taken either way, and `left` is after it; below zero,
    the bucket could not pay (a read: it is in debt), and it refuses."""
    return DENY if left is not None and left < 0 else ALLOW


def owes_charge(checks: Sequence[LimitCheck]) -> bool:
    """Whether a check charges an owed cost, which must reach the store whatever it answers."""
    for c in checks:  # noqa: SIM110
        if c.owed and c.cost:
            return True
    return False


def as_shadow(status: LimitStatus) -> LimitStatus:
    """A shadow limit's status: a denial becomes `shadow_limited`; a store failure keeps its
    outcome (the store failed all the same), though it rejects nothing."""
    return dataclasses.replace(status, outcome=SHADOW_LIMITED) if status.outcome == DENY else status


def leased(checks: Sequence[LimitCheck]) -> bool:
    """Whether a check takes its cost from a lease (a loop: cheaper than any() on a generator)."""
    for c in checks:  # noqa: SIM110
        if c.limit.lease and c.cost:
            return True
    return False


def cached_denial(checks: Sequence[LimitCheck], cached: CachedDenial) -> Decision:
    """A denial answered from the cache: the covered limit is denied; the others went unasked."""
    if len(checks) == 1:  # most routes' one limit, without the generator
        c = checks[0]
        denied = LimitStatus(c.limit, c.cost, cached.remaining, DENY, cached.retry_after if c.limit.quota else None)
        return Decision(allowed=False, statuses=(denied,), retry_after=cached.retry_after, store_failed=False)
    statuses = tuple(
        LimitStatus(c.limit, c.cost, cached.remaining, DENY, cached.retry_after if c.limit.quota else None)
        if i == cached.index
        else LimitStatus(c.limit, c.cost, None, SKIPPED)
        for i, c in enumerate(checks)
    )
    return Decision(allowed=False, statuses=statuses, retry_after=cached.retry_after, store_failed=False)


def policies_named(checks: Sequence[LimitCheck]) -> str:
    """The checks' limits and policies for a log line, each named once with its count and
    at most LOGGED_LIMITS of them: one request may carry many checks of one limit."""
    counts = collections.Counter(f"{c.limit.name}={c.limit.on_store_error.value}" for c in checks)
    named = [name if n == 1 else f"{name} x{n}" for name, n in itertools.islice(counts.items(), LOGGED_LIMITS)]
    if len(counts) > LOGGED_LIMITS:
        named.append(f"{len(counts) - LOGGED_LIMITS} more limits")
    return ", ".join(named)
