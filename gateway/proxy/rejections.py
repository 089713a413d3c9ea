"""The gateway's own refusals of a request, before or instead of the upstream: over a rate
or concurrency limit (429, or as the limit's response says), a store that failed a
fail-closed limit or an in-process store with no room (503), a body too large (413) and
a WebSocket handshake that is not one (400). Built from the route's compiled plan; trusts
the limiter's decision.
"""

from __future__ import annotations

from aiohttp import hdrs, web
from multidict import CIMultiDict

from gateway.limiter.concurrency import Admission
from gateway.limiter.decision import Decision
from gateway.limiter.outcomes import ALLOW, FAIL_CLOSED, FAIL_OPEN, NO_ROOM, SKIPPED
from gateway.proxy.problem import RETRY_AFTER_ONE, Answer, problem, problem_response
from gateway.proxy.route_plan import RoutePlan
from gateway.ratelimit_headers import retry_after_seconds


def not_a_handshake() -> web.Response:
    """A WebSocket handshake is a GET without a body (RFC 6455 §4.1), and aiohttp's client
    sends it upstream as one: a body, or another method, would reach the upstream as what
    the client did not send. A body announced (Content-Length, Transfer-Encoding) and
    forwarded without its bytes held the upstream waiting for them until timeout.read. The
    body is never read, so the connection closes rather than read it as frames or requests."""
    response = problem(400, "Bad Request", "A WebSocket handshake must be a GET request without a body.")
    response.force_close()
    return response


def body_too_large(plan: RoutePlan, headers: dict[str, str] | None = None) -> web.Response:
    response = problem_response(413, plan.body_too_large, headers=headers)
    response.force_close()  # the rest of the body is never read
    return response


def rejection(plan: RoutePlan, decision: Decision, limit_headers: dict[str, str]) -> web.Response:
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
    headers = CIMultiDict(limit_headers)
    headers[hdrs.RETRY_AFTER] = retry_after
    headers.extend(planned.content_type)
    headers[hdrs.CONTENT_LENGTH] = str(len(body))
    return Answer(planned.status, body, headers)


def concurrency_rejection(plan: RoutePlan, admission: Admission, limit_headers: dict[str, str]) -> web.Response:
    if admission.store_failed:
        statuses = admission.statuses
        full = [s.limit.name for s in statuses if s.outcome == NO_ROOM]
        return store_failed(plan, full, [s.limit.name for s in statuses if s.outcome == FAIL_CLOSED])
    refused = next(i for i, s in enumerate(admission.statuses) if s.outcome not in (ALLOW, SKIPPED, FAIL_OPEN))
    limited = plan.concurrency[refused]
    headers = {**limit_headers, **limited.fields}
    # The rate limits' policy, when sent, lists the concurrency limits too.
    headers.setdefault("RateLimit-Policy", plan.fields.concurrency_policy)
    return limited.limited.response(headers)


def store_failed(plan: RoutePlan, full: list[str], closed: list[str]) -> web.Response:
    """503 for limits the in-process store had no room for (`full`), else for fail-closed
    limits whose store failed (`closed`)."""
    template = plan.store_full(tuple(full)) if full else plan.store_unavailable(tuple(closed))
    return problem_response(503, template.body(), headers=RETRY_AFTER_ONE)
