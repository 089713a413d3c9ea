"""The one place a request is decided, for the proxy, the decision listener and Envoy's
rate-limit service: its checks built from the compiled plan and the identities the
listener read, the limiter asked (shadow limits, tiers and allowlists applied), a shaping
limit's wait waited out, its concurrency leases taken when the caller will hold them, each
outcome counted and the time it took observed once, and the verdict made.

Knows no listener's protocol; trusts the plan (compiled from a validated config) and the
identities, which the listener read as its trust model says. Time comes from `clock`, so
that tests of it set the time rather than wait for it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from gateway.config.model import Limit
from gateway.decision.plan import DecisionPlan
from gateway.decision.verdict import Verdict, concurrency_refusal, rate_refusal
from gateway.identity.tiers import with_allowlisted
from gateway.limiter.decision import UNLIMITED, Decision
from gateway.limiter.limiter import Limiter
from gateway.limiter.outcomes import ALLOW, DELAYED, FAIL_LOCAL
from gateway.limiter.store import LimitCheck

_NO_CHECKS: tuple[LimitCheck, ...] = ()
# The outcomes of an admitted request's limits that charged its cost (the store, or the
# stand-in of `on_store_error: local`); the others charged nothing.
CHARGED = frozenset((ALLOW, DELAYED, FAIL_LOCAL))


class Decider:
    """`latency`: the histogram child each decision's seconds go to (rate limits and
    concurrency leases together, once a request); `delay`: the one a shaping wait's go to."""

    def __init__(self, limiter: Limiter, latency: Any, delay: Any, clock: Callable[[], float] = time.perf_counter) -> None:
        self.limiter = limiter
        self._latency = latency
        self._delay = delay
        self._clock = clock
        # Requests that may be waiting out a mode: delay wait: those waiting, and those whose
        # check may yet tell them to. At most the caller's `max_delayed`; past it, checks may not delay.
        self._delayed = 0

    async def decide(
        self,
        plan: DecisionPlan,
        identities: Sequence[str],
        *,
        held: Sequence[Limit | None] | None = None,
        max_delayed: int = 0,
        lease_identities: Sequence[str] | None = None,
    ) -> Verdict:
        """`identities`: one per limit of `plan`; `held`: what each limit holds this client to
        (gateway.identity.tiers.held_to; None for a limit its allowlist names), when the plan
        is classified. `lease_identities`: one per concurrency limit, for a caller that
        releases the admission when its response has ended; None: they are skipped and
        counted (a decision listener never sees that end)."""
        clock = self._clock
        # A slot to wait in is taken before the check, so waiting requests never pass the cap;
        # without one, the check may not delay (the store rejects what it cannot admit now).
        shaping = plan.shaping and self._delayed < max_delayed
        if shaping:
            self._delayed += 1
        started = clock()
        try:
            checks, decision = await self._check(plan, identities, held, shaping)
            deciding = clock() - started
            if decision.wait:
                started = clock()
                await asyncio.sleep(decision.wait)
                self._delay.observe(clock() - started)
        finally:
            if shaping:
                self._delayed -= 1
        fields = plan.fields.headers(decision.statuses) if plan.limits else plan.fields.fixed
        if not decision.allowed:
            self._latency.observe(deciding)
            return Verdict(fields, rate_refusal(plan, decision, fields), checks, decision)
        if not plan.concurrency or lease_identities is None:
            for cp in plan.concurrency:
                cp.decision_skipped.inc()  # a lease would be held for a request never seen to end
            if plan.limits:
                self._latency.observe(deciding)
            return Verdict(fields, None, checks, decision)
        started = clock()
        admission = await self.limiter.concurrency.acquire(
            plan.concurrency_limits, lease_identities, store_failed=decision.store_unanswered, prepared=plan.concurrency_prepared
        )
        # One observation a request, its rate limits' check and its concurrency limits' admission
        # together: a concurrency-only route asks the store too.
        self._latency.observe(deciding + clock() - started)
        for cp, status in zip(plan.concurrency, admission.statuses):
            cp.decisions(status.outcome).inc()
        if not admission.admitted:
            return Verdict(fields, concurrency_refusal(plan, admission, fields), checks, decision, admission)
        return Verdict(fields, None, checks, decision, admission)

    async def _check(
        self, plan: DecisionPlan, identities: Sequence[str], held: Sequence[Limit | None] | None, shaping: bool
    ) -> tuple[Sequence[LimitCheck], Decision]:
        limits = plan.limits
        if not limits:
            return _NO_CHECKS, UNLIMITED
        if shaping:
            checks = [
                LimitCheck(limit=lp.limit, identity=who, cost=lp.cost, max_delay=lp.limit.max_delay, prepared=lp.delayed)
                for lp, who in zip(limits, identities)
            ]
        else:
            checks = [
                LimitCheck(limit=lp.limit, identity=who, cost=lp.cost, prepared=lp.prepared) for lp, who in zip(limits, identities)
            ]
        asked: Sequence[LimitCheck] = checks
        if held is not None:
            asked = [
                c if limit is c.limit else dataclasses.replace(c, limit=limit, prepared=lp.prepared_for(limit, shaping))
                for lp, c, limit in zip(limits, checks, held)
                if limit is not None
            ]
        if plan.shadowed:
            decision = await self.limiter.check_with_shadow(asked)
        else:
            decision = await self.limiter.check(asked)
        if held is not None:
            decision = with_allowlisted(decision, checks, held)
        allowed = decision.allowed
        for lp, status in zip(limits, decision.statuses):
            lp.decisions(status.outcome).inc()
            # A cost the response says is counted when it is settled (gateway.decision.settle).
            if allowed and status.outcome in CHARGED and lp.limit.cost is None and status.cost and not status.denied:
                lp.charged.inc(status.cost)
        return checks, decision

    async def check(self, checks: Sequence[LimitCheck], *, shadowed: bool, shed: bool = False) -> Decision:
        """A decision on checks a listener built itself (Envoy's descriptors), timed as every
        decision is. `shed`: the listener is past its in-flight cap; the failure policies answer."""
        started = self._clock()
        if shadowed:
            decision = await self.limiter.check_with_shadow(checks, shed=shed)
        else:
            decision = await self.limiter.check(checks, shed=shed)
        if checks:
            self._latency.observe(self._clock() - started)
        return decision
