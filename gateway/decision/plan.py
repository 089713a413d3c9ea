"""What a route's limits compile to, once, for the decision core: each rate limit with its
cost, metric children and refusal, each concurrency limit with its refusal, the RateLimit
fields, and the problem bodies of refusals that name several limits or a failed store.
`gateway.proxy.route_plan` builds one per route; a reload builds new ones. Trusts the
config, which `gateway.config.loader` has validated."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.config.model import ConcurrencyLimit, Limit, RouteLimit
from gateway.decision.problems import (
    PROBLEM_CONTENT_TYPE_HEADER,
    QUOTA_EXCEEDED,
    REDUCED_CAPACITY,
    VIOLATED_POLICIES,
    ProblemTemplate,
    problem_body,
)
from gateway.limiter.limiter import Limiter
from gateway.limiter.outcomes import concurrency_outcomes, rate_limit_outcomes
from gateway.limiter.store import Prepared, PreparedLease
from gateway.metrics import Children, Metrics
from gateway.ratelimit_headers import RateLimitFields, retry_after_seconds

# Seconds a client refused by a concurrency limit is told to wait. Room comes back when
# any of its requests ends, which nobody can foresee; a lease's TTL would be far too long.
CONCURRENCY_RETRY_AFTER = 1.0
_TITLES = {429: "Too Many Requests", 503: "Service Unavailable"}


@dataclass(frozen=True, slots=True)
class Rejection:
    """What a request over one limit is answered with: its status, and its body split where
    the seconds to wait go (the limit's `response.body`, else problem+json naming the limit)."""

    status: int
    chunks: tuple[bytes, ...]
    content_type: str  # the one fixed field, written after the varying ones

    @classmethod
    def of(cls, limit: Limit) -> Rejection:
        status = limit.response.status
        if limit.response.body is not None:
            return cls(status, limit.response.body.chunks(limit.name), limit.response.content_type)
        template = rejection_template(status, (limit.name,))
        return cls(status, (template.head, template.tail), PROBLEM_CONTENT_TYPE_HEADER)


@dataclass(frozen=True, slots=True)
class LimitPlan:
    limit: Limit
    cost: int
    decisions: Children  # gateway_limiter_decisions_total for this route and limit, by decision
    charged: Any  # the gateway_limiter_cost_total child of this route and limit
    rejection: Rejection  # the answer when this limit denies
    classified: bool  # the limit has tiers or an allowlist (gateway.identity.tiers)
    # What the request's check carries (`LimitCheck.prepared`): checked now or rejected, and
    # with the limit's max_delay, for a request the caller can hold (the same when it has none).
    prepared: Prepared
    delayed: Prepared
    # The same for each of its tiers' limits, by name.
    tiers: Mapping[str, tuple[Prepared, Prepared]]

    def prepared_for(self, limit: Limit, delayed: bool) -> Prepared:
        """What a check of `limit`, this limit or one of its tiers', carries."""
        if limit is self.limit:
            return self.delayed if delayed else self.prepared
        now, later = self.tiers[limit.name]
        return later if delayed else now


@dataclass(frozen=True, slots=True)
class ConcurrencyPlan:
    limit: ConcurrencyLimit
    decisions: Children  # gateway_limiter_decisions_total for this route and limit, by decision
    in_flight: Any  # the gateway_concurrency_in_flight child of this limit
    # gateway_decision_concurrency_skipped_total for this route and limit: bound here, so
    # that it reads 0 until the decision listener skips one.
    decision_skipped: Any
    limited: bytes  # the 429's problem body
    fields: dict[str, str]  # its RateLimit (none left, no window known) and Retry-After
    prepared: PreparedLease  # what a lease under it carries (`LeaseCheck.prepared`)


@dataclass(frozen=True, slots=True)
class DecisionPlan:
    """A route's limits, compiled for deciding."""

    limits: tuple[LimitPlan, ...]
    enforced: tuple[int, ...]  # the indices in `limits` of those that are not shadow limits
    shadowed: bool  # some of the limits are shadow limits, which never reject
    shaping: bool  # some of the limits may delay a request (mode: delay) rather than reject it
    metered: tuple[int, ...]  # the indices in `limits` of those whose cost the response says
    classified: bool  # some of the limits have tiers or an allowlist (gateway.identity.tiers)
    fields: RateLimitFields  # the rate-limit fields of every answer
    concurrency: tuple[ConcurrencyPlan, ...]  # taken after `limits` allow, in order
    concurrency_limits: tuple[ConcurrencyLimit, ...]  # each of `concurrency`'s limit
    concurrency_prepared: tuple[PreparedLease, ...]  # and what its lease carries
    # (status, limit names, the store failed) -> problem body; one per status and subset of `limits` at most
    _rejections: dict[tuple[int, tuple[str, ...], bool | None], ProblemTemplate] = field(default_factory=dict, repr=False)

    @classmethod
    def of(
        cls,
        limits: Sequence[RouteLimit],
        concurrency: Sequence[ConcurrencyLimit],
        label: str,
        metrics: Metrics,
        local_divisor: int,
        limiter: Limiter,
    ) -> DecisionPlan:
        """`limiter` prepares each limit's checks (`Limiter.prepare`), with its local share."""
        planned = tuple(_limit_plan(rl.limit, rl.cost, label, metrics, limiter) for rl in limits)
        leases = tuple(_concurrency_plan(limit, label, metrics, limiter) for limit in concurrency)
        return cls(
            limits=planned,
            enforced=tuple(i for i, rl in enumerate(limits) if not rl.limit.shadow),
            shadowed=any(rl.limit.shadow for rl in limits),
            shaping=any(rl.limit.max_delay for rl in limits),
            metered=tuple(i for i, rl in enumerate(limits) if rl.limit.cost is not None),
            classified=any(rl.limit.tiers is not None or rl.limit.allow is not None for rl in limits),
            fields=RateLimitFields.of(
                [(lp.limit, lp.prepared.local.limit if lp.prepared.local else lp.limit) for lp in planned],
                local_divisor,
                concurrency,
            ),
            concurrency=leases,
            concurrency_limits=tuple(cp.limit for cp in leases),
            concurrency_prepared=tuple(cp.prepared for cp in leases),
        )

    def rejection(self, status: int, names: tuple[str, ...]) -> ProblemTemplate:
        """The problem body of a request over `names` (its blank: the seconds to wait), a 429 or a 503."""
        template = self._rejections.get((status, names, False))
        if template is None:
            template = self._rejections[(status, names, False)] = rejection_template(status, names)
        return template

    def store_unavailable(self, names: tuple[str, ...]) -> ProblemTemplate:
        """The 503 body when the fail-closed limits `names` could not be checked."""
        return self._store_problem(names, True, "The rate-limit store is unavailable and this limit fails closed.")

    def store_full(self, names: tuple[str, ...]) -> ProblemTemplate:
        """The 503 body when the in-process store had no room for the buckets of `names`."""
        return self._store_problem(names, None, "The gateway's in-process store is full and cannot track another client now.")

    def _store_problem(self, names: tuple[str, ...], kind: bool | None, detail: str) -> ProblemTemplate:
        template = self._rejections.get((503, names, kind))
        if template is None:
            template = self._rejections[(503, names, kind)] = ProblemTemplate.of(
                503, _TITLES[503], detail, kind=REDUCED_CAPACITY, **{VIOLATED_POLICIES: names}
            )
        return template


def rejection_template(status: int, names: tuple[str, ...]) -> ProblemTemplate:
    listed = ", ".join(repr(name) for name in names)
    return ProblemTemplate.of(
        status,
        _TITLES[status],
        f"Rate limit {listed} exceeded; retry in {{}} s.",
        kind=QUOTA_EXCEEDED,
        **{VIOLATED_POLICIES: names},
    )


def _limit_plan(limit: Limit, cost: int, label: str, metrics: Metrics, limiter: Limiter) -> LimitPlan:
    def prepared(applied: Limit) -> tuple[Prepared, Prepared]:
        now = limiter.prepare(applied, cost)
        # A tier's limit is held to the max_delay of the limit it is a tier of, as the core checks it.
        return now, limiter.prepare(applied, cost, max_delay=limit.max_delay) if limit.max_delay else now

    now, delayed = prepared(limit)
    return LimitPlan(
        limit=limit,
        cost=cost,
        decisions=Children(metrics.decisions, ("decision",), route=label, limit=limit.name).export(
            *((outcome,) for outcome in rate_limit_outcomes(limit))
        ),
        charged=metrics.cost.labels(route=label, limit=limit.name),
        rejection=Rejection.of(limit),
        classified=limit.tiers is not None or limit.allow is not None,
        prepared=now,
        delayed=delayed,
        tiers={} if limit.tiers is None else {tier.name: prepared(tier) for tier in limit.tiers.limits.values()},
    )


def _concurrency_plan(limit: ConcurrencyLimit, label: str, metrics: Metrics, limiter: Limiter) -> ConcurrencyPlan:
    return ConcurrencyPlan(
        limit=limit,
        prepared=limiter.concurrency.prepare(limit),
        decisions=Children(metrics.decisions, ("decision",), route=label, limit=limit.name).export(
            *((outcome,) for outcome in concurrency_outcomes(limit))
        ),
        in_flight=metrics.concurrency_in_flight.labels(limit=limit.name),
        decision_skipped=metrics.decision_concurrency_skipped.labels(route=label, limit=limit.name),
        limited=problem_body(
            429,
            "Too Many Requests",
            f"Concurrency limit {limit.name!r} reached: {limit.concurrency} requests already in flight; "
            f"retry in {retry_after_seconds(CONCURRENCY_RETRY_AFTER)} s.",
            kind=QUOTA_EXCEEDED,
            **{VIOLATED_POLICIES: [limit.name]},
        ),
        fields={"RateLimit": f'"{limit.name}";r=0', "Retry-After": str(retry_after_seconds(CONCURRENCY_RETRY_AFTER))},
    )
