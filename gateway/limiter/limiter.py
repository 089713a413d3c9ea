"""The decision the proxy asks for: check a request's limits, and apply each
limit's failure policy when the store cannot answer.

Trusts the store to be atomic and to raise only `StoreError`. When it does,
each limit's `on_store_error` decides: `open` allows, `closed` rejects (the
proxy answers 503), and `local` asks an in-process bucket whose rate and burst
are the global ones divided by `store.local_divisor`.

Shadow limits (`shadow: true`) never decide a request. `check_with_shadow` sends
the enforced limits in one all-or-nothing store check, as `check` does, and each
shadow limit in a check of its own, all at once. So a shadow limit that is short
never keeps the enforced limits from being charged, nor another shadow limit:
each is charged whenever it alone has room, as if it were the request's only
limit. The Lua script and its model stay as they are. Routes without shadow
limits call `check` and pay nothing for the feature.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.config.model import FailurePolicy, Limit
from gateway.limiter.circuit_breaker import BreakerState, CircuitBreaker
from gateway.limiter.client_waves import ClientWaves
from gateway.limiter.denial_cache import REFUNDING_STORE_MAX_HOLD, CachedDenial, DenialCache
from gateway.limiter.memory_store import MemoryStore
from gateway.limiter.store import BucketReading, LimitCheck, Store, StoreDecision, StoreError, StoreNotConnected
from gateway.limiter.top_limited import TopLimited

log = logging.getLogger(__name__)

# Store failures come in floods; one line a second says enough.
FAILURE_LOG_INTERVAL = 1.0

# "skipped": this limit had room, but another denied the request, so nothing was charged.
ALLOW, DENY, SKIPPED = "allow", "deny", "skipped"
# A shadow limit that would have denied: it was not charged, and the request went on.
SHADOW_LIMITED = "shadow_limited"
FAIL_OPEN, FAIL_CLOSED, FAIL_LOCAL = "fail_open", "fail_closed", "fail_local"
_FAILURE_OUTCOME = {FailurePolicy.OPEN: FAIL_OPEN, FailurePolicy.CLOSED: FAIL_CLOSED, FailurePolicy.LOCAL: FAIL_LOCAL}


@dataclass(frozen=True, slots=True)
class LimitStatus:
    limit: Limit
    cost: int
    remaining: float | None  # None when unknown: the store failed open, or a cached denial answered
    outcome: str  # allow | deny | skipped | shadow_limited | fail_open | fail_closed | fail_local


@dataclass(frozen=True, slots=True)
class Decision:
    allowed: bool
    statuses: tuple[LimitStatus, ...]
    retry_after: float  # seconds; 0 when allowed
    store_failed: bool  # denied because a fail-closed limit could not be checked


# The decision for a request with no limits: nothing to ask the store.
UNLIMITED = Decision(allowed=True, statuses=(), retry_after=0.0, store_failed=False)


# What a check is told while the circuit breaker keeps it from the store.
BREAKER_OPEN = StoreError("the store failed repeatedly; circuit breaker open")


class Limiter:
    """`shared_store`: the store is shared with other gateways over the network (Redis).
    Then a bucket found short of its cost is answered locally until it could pay
    (`gateway.limiter.denial_cache`), one client's concurrent checks reach the
    store in waves (`gateway.limiter.client_waves`), and a store that keeps failing
    is left alone for a while (`gateway.limiter.circuit_breaker`).
    `on_breaker_change` is told each new breaker state, for the metric."""

    def __init__(
        self,
        store: Store,
        *,
        local_divisor: int = 1,
        shared_store: bool = False,
        on_breaker_change: Callable[[BreakerState], None] | None = None,
    ) -> None:
        self.store = store
        if not shared_store:
            self.denials = None
        elif store.refunds:
            self.denials = DenialCache(max_hold=REFUNDING_STORE_MAX_HOLD)
        else:
            self.denials = DenialCache()
        self.breaker = CircuitBreaker(on_change=on_breaker_change)
        self._waves = ClientWaves()
        self._local_divisor = local_divisor
        self._local_store = MemoryStore()
        self._local_limits: dict[tuple[str, int], Limit] = {}
        self._last_failure_log = -FAILURE_LOG_INTERVAL
        # (limit name, identity) of each denial, for the admin API's top limited clients.
        self.top_limited = TopLimited(now=time.monotonic())

    async def check(self, checks: Sequence[LimitCheck]) -> Decision:
        if not checks:
            return UNLIMITED
        if self.denials is not None:
            decision = await self._check_shared(checks, self.denials)
        else:
            try:
                decision = _decision(checks, await self.store.check(checks))
            except StoreError as exc:
                decision = self._on_store_error(checks, exc)
        if not decision.allowed:  # an allowed request costs this one test
            now = time.monotonic()
            for c, status in zip(checks, decision.statuses):
                if _limited(c, status):
                    self.top_limited.add((c.limit.name, c.identity), now)
        return decision

    async def check_with_shadow(self, checks: Sequence[LimitCheck]) -> Decision:
        """`check` for checks of which some are shadow limits: only the enforced ones decide."""
        enforced = [c for c in checks if not c.limit.shadow]
        shadows = [c for c in checks if c.limit.shadow]
        main, *shadowed = await asyncio.gather(self.check(enforced), *(self.check((c,)) for c in shadows))
        enforced_statuses = iter(main.statuses)
        shadow_statuses = (_as_shadow(d.statuses[0]) for d in shadowed)
        statuses = tuple(next(shadow_statuses) if c.limit.shadow else next(enforced_statuses) for c in checks)
        return Decision(
            allowed=main.allowed, statuses=statuses, retry_after=main.retry_after, store_failed=main.store_failed
        )

    async def _check_shared(self, checks: Sequence[LimitCheck], denials: DenialCache) -> Decision:
        cached = denials.lookup(checks, time.monotonic())
        if cached is not None:
            return _cached_denial(checks, cached)
        signature = tuple((c.limit.name, c.identity, c.cost) for c in checks)
        try:
            wave = await self._waves.join(signature)
        except StoreError as exc:  # the wave this one waited for failed
            return self._on_store_error(checks, exc)
        error = None
        try:
            if wave.after is not None:  # the wave waited for may have emptied the bucket
                cached = denials.lookup(checks, time.monotonic())
                if cached is not None:
                    return _cached_denial(checks, cached)
            sent_at = time.monotonic()
            if not self.breaker.allows(sent_at):
                # Not the wave's error: the store was not asked, and the next wave asks
                # the breaker for itself (it may be closed again by then).
                return self._on_store_error(checks, BREAKER_OPEN)
            try:
                answer = await self.store.check(checks)
            except StoreNotConnected:
                self.breaker.not_sent(time.monotonic())
                raise
            except StoreError:
                self.breaker.failed(time.monotonic())
                raise
            except asyncio.CancelledError:
                self.breaker.abandoned(time.monotonic())
                raise
            self.breaker.succeeded()
            # Allowed or not, a bucket left short of its cost cannot pass until it refills.
            for c, left in zip(checks, answer.remaining):
                if left is not None and left < c.cost:
                    denials.record(c, remaining=left, sent_at=sent_at)
        except StoreError as exc:
            error = exc
            return self._on_store_error(checks, exc)
        finally:
            # After recording: the next wave wakes to a cache that knows this answer.
            self._waves.leave(signature, wave, error)
        return _decision(checks, answer)

    def _on_store_error(self, checks: Sequence[LimitCheck], exc: StoreError) -> Decision:
        now = time.monotonic()
        if now - self._last_failure_log >= FAILURE_LOG_INTERVAL:
            self._last_failure_log = now
            policies = ", ".join(f"{c.limit.name}={c.limit.on_store_error.value}" for c in checks)
            log.warning("store failed, applying failure policies (%s): %s", policies, exc)
        policies = [c.limit.on_store_error for c in checks]
        if FailurePolicy.CLOSED in policies:
            statuses = tuple(LimitStatus(c.limit, c.cost, None, _FAILURE_OUTCOME[c.limit.on_store_error]) for c in checks)
            return Decision(allowed=False, statuses=statuses, retry_after=1.0, store_failed=True)
        local = [
            dataclasses.replace(c, limit=self._local_limit(c.limit, c.cost))
            for c in checks
            if c.limit.on_store_error is FailurePolicy.LOCAL
        ]
        answer = self._local_store.check_now(local) if local else None
        remaining = iter(answer.remaining if answer else ())
        statuses = tuple(
            LimitStatus(
                limit=c.limit,
                cost=c.cost,
                remaining=next(remaining) if c.limit.on_store_error is FailurePolicy.LOCAL else None,
                outcome=_FAILURE_OUTCOME[c.limit.on_store_error],
            )
            for c in checks
        )
        allowed = answer.allowed if answer else True
        return Decision(
            allowed=allowed, statuses=statuses, retry_after=answer.retry_after if answer else 0.0, store_failed=False
        )

    def _local_limit(self, limit: Limit, cost: int) -> Limit:
        """The conservative stand-in for `limit`: this instance's share of the fleet's limit.

        Its burst is never below the request's cost (nor 1), or a burst split many
        ways would never let such a request through."""
        local = self._local_limits.get((limit.name, cost))
        if local is None:
            divisor = self._local_divisor
            rate = dataclasses.replace(limit.rate, tokens=limit.rate.tokens / divisor)
            local = dataclasses.replace(limit, rate=rate, burst=max(1.0, float(cost), limit.burst / divisor))
            self._local_limits[(limit.name, cost)] = local
        return local

    async def read_bucket(self, limit: Limit, identity: str) -> BucketReading:
        """The bucket of `limit` for `identity` as the store holds it. Raises StoreError."""
        return await self.store.read(limit, identity)

    def denied_here_for(self, limit: Limit, identity: str) -> float:
        """How long this process still answers that bucket's denial itself (0: it asks the store)."""
        if self.denials is None:
            return 0.0
        return self.denials.held_for(limit.name, identity, time.monotonic())

    async def reset_bucket(self, limit: Limit, identity: str) -> bool:
        """Delete the bucket in the store, and then this process's cached denials of it,
        which would otherwise keep the client denied here until they ran out. Whether the
        store held the bucket. The in-process stand-in of `on_store_error: local` is reset
        first, so a reset while the store is down still frees the client here; then
        StoreError is raised, and the cached denials stay, as does the store's bucket."""
        await self._local_store.delete(limit, identity)  # bucket ids ignore the stand-in's cost
        held = await self.store.delete(limit, identity)
        if self.denials is not None:
            self.denials.forget(limit.name, identity)
        return held

    async def store_reachable(self) -> tuple[bool, str]:
        """Whether the store answers now, and if not, why (`store.refusal(why)`: it refuses us)."""
        try:
            await self.store.ping()
        except StoreError as exc:
            return False, str(exc)
        return True, "ok"


def _limited(check: LimitCheck, status: LimitStatus) -> bool:
    """Whether this limit denied the request: from the store, or from the local stand-in."""
    if status.outcome == DENY:
        return True
    return status.outcome == FAIL_LOCAL and status.remaining is not None and status.remaining < check.cost


def _decision(checks: Sequence[LimitCheck], answer: StoreDecision) -> Decision:
    statuses = tuple(
        LimitStatus(
            limit=c.limit,
            cost=c.cost,
            remaining=left,
            outcome=ALLOW if answer.allowed else (DENY if left is not None and left < c.cost else SKIPPED),
        )
        for c, left in zip(checks, answer.remaining)
    )
    return Decision(allowed=answer.allowed, statuses=statuses, retry_after=answer.retry_after, store_failed=False)


def _as_shadow(status: LimitStatus) -> LimitStatus:
    """A shadow limit's status: a denial becomes `shadow_limited`; a store failure keeps its
    outcome (the store failed all the same), though it rejects nothing."""
    return dataclasses.replace(status, outcome=SHADOW_LIMITED) if status.outcome == DENY else status


def _cached_denial(checks: Sequence[LimitCheck], cached: CachedDenial) -> Decision:
    """A denial answered from the cache: the covered limit is denied; the others went unasked."""
    statuses = tuple(
        LimitStatus(c.limit, c.cost, cached.remaining, DENY) if i == cached.index else LimitStatus(c.limit, c.cost, None, SKIPPED)
        for i, c in enumerate(checks)
    )
    return Decision(allowed=False, statuses=statuses, retry_after=cached.retry_after, store_failed=False)
