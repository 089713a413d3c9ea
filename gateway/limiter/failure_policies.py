"""Each limit's `on_store_error`, applied when the store cannot answer a check: `open`
allows, `closed` rejects (the proxy answers 503), and `local` asks an in-process stand-in
whose rate and burst are the global ones divided by `store.local_divisor` × `workers`. An
in-process store with no room for a client's buckets refuses it, charging nothing.

Trusts the checks it is given; asks no store but the in-process stand-in. Store failures
come in floods, so each kind is logged once a second at most, on the limiter's clock.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

from gateway.config.model import FailurePolicy
from gateway.limiter.decision import Decision, LimitStatus, local_share, policies_named
from gateway.limiter.memory_store import MemoryStore, StoreFull
from gateway.limiter.outcomes import FAILURE_OUTCOME, NO_ROOM
from gateway.limiter.store import LimitCheck, StoreError

log = logging.getLogger("gateway.limiter.limiter")  # the limiter's lines, as operators grep them

# Store failures come in floods; one line a second says enough.
FAILURE_LOG_INTERVAL = 1.0


class FailurePolicies:
    """`local_store`: the stand-in of `on_store_error: local`; `local_divisor`: its share."""

    def __init__(self, local_store: MemoryStore, local_divisor: int, clock: Callable[[], float]) -> None:
        self.local_store = local_store
        self._local_divisor = local_divisor
        self._clock = clock
        self._last_log = -FAILURE_LOG_INTERVAL

    def on_store_error(self, checks: Sequence[LimitCheck], exc: StoreError) -> Decision:
        if self._may_log():
            log.warning("store failed, applying failure policies (%s): %.200s", policies_named(checks), exc)
        return self.decide(checks)

    def decide(self, checks: Sequence[LimitCheck]) -> Decision:
        """Each limit's failure policy decides, the store unasked."""
        policies = [c.limit.on_store_error for c in checks]
        if FailurePolicy.CLOSED in policies:
            statuses = tuple(LimitStatus(c.limit, c.cost, None, FAILURE_OUTCOME[c.limit.on_store_error]) for c in checks)
            return Decision(allowed=False, statuses=statuses, retry_after=1.0, store_failed=True)
        local = [self.local_check(c) for c in checks if c.limit.on_store_error is FailurePolicy.LOCAL]
        try:
            answer = self.local_store.check_now(local) if local else None
        except StoreFull as full:
            return self.no_room(checks, full)
        remaining = iter(answer.remaining if answer else ())
        statuses = tuple(
            LimitStatus(
                limit=c.limit,
                cost=c.cost,
                remaining=next(remaining) if c.limit.on_store_error is FailurePolicy.LOCAL else None,
                outcome=FAILURE_OUTCOME[c.limit.on_store_error],
            )
            for c in checks
        )
        allowed = answer.allowed if answer else True
        return Decision(
            allowed=allowed,
            statuses=statuses,
            retry_after=answer.retry_after if answer else 0.0,
            store_failed=False,
            wait=answer.wait if answer and allowed else 0.0,
        )

    def no_room(self, checks: Sequence[LimitCheck], exc: StoreFull) -> Decision:
        """The in-process store could not hold this request's buckets: refused, nothing charged."""
        if self._may_log():
            log.warning("refusing requests with 503: %s", exc)
        statuses = tuple(LimitStatus(c.limit, c.cost, None, NO_ROOM) for c in checks)
        return Decision(allowed=False, statuses=statuses, retry_after=1.0, store_failed=True)

    def local_check(self, check: LimitCheck) -> LimitCheck:
        """`check` as the stand-in takes it: against the limit's share, as the plans compiled
        it; a check made without them (or changed since) has its share worked out here."""
        prepared = check.prepared
        if prepared is not None and prepared.local is not None and prepared.fits(check):
            return dataclasses.replace(check, limit=prepared.local.limit, prepared=prepared.local)
        return dataclasses.replace(check, limit=local_share(check.limit, self._local_divisor, check.cost), prepared=None)

    def _may_log(self) -> bool:
        now = self._clock()
        if now - self._last_log < FAILURE_LOG_INTERVAL:
            return False
        self._last_log = now
        return True
