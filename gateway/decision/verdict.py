"""What the decision core answers, in no listener's terms: allowed with the RateLimit fields
to send, or refused with the whole answer prebuilt (status, body and every header field but
the request id), built from the route's compiled plan and the limiter's decision. Pure:
the refusals are the proxy's rejections, the decision listener's denials and, translated,
Envoy's OVER_LIMIT. Trusts the limiter's decision."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.decision.plan import DecisionPlan
from gateway.decision.problems import PROBLEM_CONTENT_TYPE_HEADER
from gateway.limiter.concurrency import Admission
from gateway.limiter.decision import Decision
from gateway.limiter.outcomes import ALLOW, FAIL_CLOSED, FAIL_OPEN, NO_ROOM, SKIPPED
from gateway.limiter.store import LimitCheck
from gateway.ratelimit_headers import retry_after_seconds

RETRY_AFTER_ONE = "1"  # the 503s' Retry-After, and a concurrency refusal's


class Refusal:
    """A refusal's answer: its status, body, and header fields, Content-Type and
    Content-Length last, as a listener sends them (adding only its request id).
    `store_failed`: a 503, for a fail-closed limit the store could not check, or no room."""

    # A plain class: a frozen dataclass sets each field through object.__setattr__, and
    # one of these is made for every refusal.
    __slots__ = ("body", "headers", "status", "store_failed")

    def __init__(self, status: int, body: bytes, headers: dict[str, str], store_failed: bool) -> None:
        self.status = status
        self.body = body
        self.headers = headers
        self.store_failed = store_failed


class Verdict:
    """`refusal` None: allowed, with `fields`. `checks` and `decision` are what the limiter
    was asked and said, for the access log; `admission` the concurrency leases taken, which
    the caller releases when the response has ended. Made for every decision: a plain class."""

    __slots__ = ("admission", "checks", "decision", "fields", "refusal")

    def __init__(
        self,
        fields: dict[str, str],
        refusal: Refusal | None,
        checks: Sequence[LimitCheck],
        decision: Decision,
        admission: Admission | None = None,
    ) -> None:
        self.fields = fields
        self.refusal = refusal
        self.checks = checks
        self.decision = decision
        self.admission = admission


def rate_refusal(plan: DecisionPlan, decision: Decision, fields: dict[str, str]) -> Refusal:
    """A request over its limits: answered as the first limit that denied it (in the route's
    order) says, with Retry-After whatever its header style. A fail-closed limit whose store
    failed, or an in-process store with no room for the client: 503 problem+json with Retry-After: 1."""
    if decision.store_failed:
        enforced = [s for s in decision.statuses if not s.limit.shadow]
        full = [s.limit.name for s in enforced if s.outcome == NO_ROOM]
        return store_failed(plan, full, [s.limit.name for s in enforced if s.outcome == FAIL_CLOSED])
    statuses = decision.statuses
    denied = [i for i in plan.enforced if statuses[i].denied]
    first = plan.limits[denied[0]]
    planned = first.rejection
    retry_after = str(retry_after_seconds(decision.retry_after))
    if len(denied) == 1 or first.limit.response.body is not None:
        body = retry_after.encode().join(planned.chunks)
    else:  # the problem names every limit that denied
        names = tuple(statuses[i].limit.name for i in denied)
        body = plan.rejection(planned.status, names).body(retry_after)
    headers = {**fields, "Retry-After": retry_after, "Content-Type": planned.content_type, "Content-Length": str(len(body))}
    return Refusal(planned.status, body, headers, False)


def concurrency_refusal(plan: DecisionPlan, admission: Admission, fields: dict[str, str]) -> Refusal:
    if admission.store_failed:
        statuses = admission.statuses
        full = [s.limit.name for s in statuses if s.outcome == NO_ROOM]
        return store_failed(plan, full, [s.limit.name for s in statuses if s.outcome == FAIL_CLOSED])
    refused = next(i for i, s in enumerate(admission.statuses) if s.outcome not in (ALLOW, SKIPPED, FAIL_OPEN))
    limited = plan.concurrency[refused]
    headers = {**fields, **limited.fields}
    # The rate limits' policy, when sent, lists the concurrency limits too.
    headers.setdefault("RateLimit-Policy", plan.fields.concurrency_policy)
    return _problem(429, limited.limited, headers, store_failed=False)


def store_failed(plan: DecisionPlan, full: list[str], closed: list[str]) -> Refusal:
    """503 for limits the in-process store had no room for (`full`), else for fail-closed
    limits whose store failed (`closed`)."""
    template = plan.store_full(tuple(full)) if full else plan.store_unavailable(tuple(closed))
    return _problem(503, template.body(), {"Retry-After": RETRY_AFTER_ONE}, store_failed=True)


def _problem(status: int, body: bytes, headers: dict[str, str], *, store_failed: bool) -> Refusal:
    headers["Content-Type"] = PROBLEM_CONTENT_TYPE_HEADER
    headers["Content-Length"] = str(len(body))
    return Refusal(status, body, headers, store_failed)
