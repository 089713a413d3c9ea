"""Settling a cost the response said (`cost: {from, reserve, missing}`), after the response.

The reservation (`check.cost`) was charged where the request's check was decided, and the
settlement goes to the same place: the store for an allowed check, the in-process stand-in
for one `on_store_error: local` decided, and nowhere for a check that charged nothing (refused,
allowlisted, a shadow limit that would have refused, or failed open: as a fixed cost is not
charged later when the store is back, neither is this). What the response said less the
reservation is one atomic store call (`Store.settle`): less goes back, more is charged into
debt, which refuses the client's later requests until the bucket has refilled past zero.

Failures: the response has been sent, so nothing can be refused for it. A settlement call
is not idempotent, and one that timed out may still be applied by a Redis that was only
slow: retrying it would charge the client twice. So only a settlement that was never sent (no connection to the store:
`StoreNotConnected`, or the open circuit breaker holding the store back) is kept and retried
in the background, after RETRY_FIRST and twice as long each time, for RETRY_FOR seconds in
all; at most MAX_PENDING wait at once. One not made by then is `LOST`; one that was sent and
not answered (a timeout, a connection lost mid-call, a refusal) is `UNCONFIRMED`: Redis may
or may not have applied it, and it is not sent again. Either way what is left charged is
what the store holds: a lost refund leaves its tokens charged (under-admission until the
bucket refills), a lost debt leaves only the reservation charged (an overshoot, bounded by
what the client's requests cost beyond their reservations). Each outcome is counted
(`SETTLED`, `RETRIED`, `LOST`, `UNCONFIRMED`). Trusts the store to raise only `StoreError`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from gateway.limiter.circuit_breaker import BreakerState, CircuitBreaker
from gateway.limiter.memory_store import MemoryStore
from gateway.limiter.outcomes import ALLOW, FAIL_LOCAL
from gateway.limiter.store import LimitCheck, Store, StoreError, StoreNotConnected

log = logging.getLogger(__name__)

# The outcomes of gateway_limiter_settlements_total.
SETTLED, RETRIED, LOST, UNCONFIRMED = "settled", "retried", "lost", "unconfirmed"
SETTLEMENT_OUTCOMES = (SETTLED, RETRIED, LOST, UNCONFIRMED)
# A store that fails one call (a failover, a slow moment) usually answers the next within a
# second; one down for longer than RETRY_FOR is an outage, and what it owes a client by then
# has mostly refilled anyway at the rates such budgets run at (per minute or per hour).
RETRY_FIRST = 0.05
RETRY_MAX = 1.0
RETRY_FOR = 10.0
# Settlements waiting for a retry: an outage at 10,000 requests a second fills this in a
# second, past which each new one is lost at once rather than held in memory.
MAX_PENDING = 10_000
FAILURE_LOG_INTERVAL = 1.0


class Settlements:
    """`local_check`: the check as the in-process stand-in took it (its share of the limit).
    `on_outcome` is told each settlement's outcome, for the metric."""

    def __init__(
        self,
        store: Store,
        local_store: MemoryStore,
        breaker: CircuitBreaker,
        local_check: Callable[[LimitCheck], LimitCheck],
        *,
        on_outcome: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._local_store = local_store
        self._breaker = breaker
        self._local_check = local_check
        self._on_outcome = on_outcome
        self._clock = clock
        self._pending: set[asyncio.Task[None]] = set()  # the event loop holds tasks only weakly
        self._last_log = -FAILURE_LOG_INTERVAL

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def settle(self, check: LimitCheck, outcome: str, actual: int) -> int:
        """Settle `actual` units for `check`, whose reservation `outcome` decided. Returns the
        units now charged for it: `actual` when settled, the reservation while a retry is
        pending or once lost, 0 when the reservation charged nothing."""
        delta = actual - check.cost
        if outcome == FAIL_LOCAL:
            self._local_store.settle_now(self._local_check(check), delta)
            return actual
        if outcome != ALLOW:
            return 0
        if not delta:
            self._count(SETTLED)
            return actual
        if self._breaker.state is BreakerState.CLOSED:
            try:
                await self._store.settle(check, delta)
            except StoreNotConnected as exc:
                self._failed(check, delta, exc)
                return check.cost
            except StoreError as exc:
                self._unconfirmed(check, delta, exc)
                return check.cost
            self._count(SETTLED)
            return actual
        self._failed(check, delta, StoreError("the circuit breaker holds the store back"))
        return check.cost

    def _unconfirmed(self, check: LimitCheck, delta: int, exc: StoreError) -> None:
        self._count(UNCONFIRMED)
        now = self._clock()
        if now - self._last_log >= FAILURE_LOG_INTERVAL:
            self._last_log = now
            log.warning("a settlement of %+d units of %s went unanswered, and is not sent again: %.200s", delta, check.limit.name, exc)

    def _failed(self, check: LimitCheck, delta: int, exc: StoreError) -> None:
        now = self._clock()
        if now - self._last_log >= FAILURE_LOG_INTERVAL:
            self._last_log = now
            log.warning("could not settle %+d units of %s, retrying for %gs: %.200s", delta, check.limit.name, RETRY_FOR, exc)
        if len(self._pending) >= MAX_PENDING:
            self._count(LOST)
            return
        task = asyncio.ensure_future(self._retry(check, delta))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _retry(self, check: LimitCheck, delta: int) -> None:
        # Bounded by the pauses waited, not a clock: a settlement is given up after as many
        # tries on any clock, an injected one that stands still included.
        pause, waited = RETRY_FIRST, 0.0
        while waited + pause <= RETRY_FOR:
            await asyncio.sleep(pause)
            waited += pause
            pause = min(pause * 2, RETRY_MAX)
            if self._breaker.state is not BreakerState.CLOSED:
                continue
            try:
                await self._store.settle(check, delta)
            except StoreNotConnected:
                continue
            except StoreError:
                self._count(UNCONFIRMED)
                return
            self._count(RETRIED)
            return
        self._count(LOST)
        log.warning("lost a settlement of %+d units of %s: the store failed it for %gs", delta, check.limit.name, RETRY_FOR)

    def _count(self, outcome: str) -> None:
        if self._on_outcome is not None:
            self._on_outcome(outcome)

    async def close(self, timeout: float) -> None:
        """Wait, boundedly, for the retries under way; those left are cancelled and counted lost."""
        if self._pending:
            await asyncio.wait(self._pending, timeout=timeout)
        for task in list(self._pending):
            task.cancel()
            self._count(LOST)
