"""The reservations of one admitted request whose route has limits that take their cost from
the response (`cost: {from, reserve, missing}`), and their settlement when it has ended.

The core's verdict says, per limit, what its reservation charged and where
(`gateway.limiter.settlement` settles it there); this keeps that for the request, and counts
what each limit was finally charged in gateway_limiter_cost_total. Knows no listener's
protocol: the caller reads the costs from the response (each limit's `missing` when it does
not say, 0 when no response came) and hands them to `settle` once. Trusts the verdict.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from gateway.config.model import ResponseCost
from gateway.decision.plan import DecisionPlan
from gateway.decision.verdict import Verdict
from gateway.limiter.outcomes import DENY
from gateway.limiter.settlement import Settlements
from gateway.limiter.store import LimitCheck


class Reservations:
    """`costs`: each metered limit's cost, in the route's order, as `settle` takes their actuals."""

    __slots__ = ("_entries", "_settlements", "costs", "settled")

    def __init__(self, plan: DecisionPlan, verdict: Verdict, settlements: Settlements) -> None:
        statuses, checks = verdict.decision.statuses, verdict.checks
        entries: list[tuple[Any, LimitCheck, str]] = []
        costs: list[ResponseCost] = []
        for i in plan.metered:
            status, planned = statuses[i], plan.limits[i]
            # The limit its reservation charged: a tier's own, or the limit's.
            check = LimitCheck(limit=status.limit, identity=checks[i].identity, cost=status.cost)
            entries.append((planned.charged, check, DENY if status.denied else status.outcome))
            assert planned.limit.cost is not None  # `metered` lists only these
            costs.append(planned.limit.cost)
        self._entries = entries
        self._settlements = settlements
        self.costs: tuple[ResponseCost, ...] = tuple(costs)
        self.settled = False

    async def settle(self, actuals: Sequence[int]) -> None:
        """Settle each limit at its actual cost, once: a second call does nothing."""
        if self.settled:
            return
        self.settled = True
        settle = self._settlements.settle
        if len(self._entries) == 1:
            (charged, check, outcome), actual = self._entries[0], actuals[0]
            charged.inc(await settle(check, outcome, actual))
            return
        units = await asyncio.gather(*(settle(check, outcome, actual) for (_, check, outcome), actual in zip(self._entries, actuals)))
        for (charged, _, _), amount in zip(self._entries, units):
            charged.inc(amount)
