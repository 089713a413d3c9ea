"""The gateway's own refusals of a request, before or instead of the upstream, as aiohttp
responses: the decision core's (over a rate or concurrency limit, 429 or as the limit's
response says; a store that failed a fail-closed limit or an in-process store with no room,
503), a body too large (413) and a WebSocket handshake that is not one (400). Built from
the route's compiled plan and the core's prebuilt answers; trusts both.
"""

from __future__ import annotations

from aiohttp import web
from multidict import CIMultiDict

from gateway.decision.verdict import Refusal
from gateway.proxy.problem import Answer, problem, problem_response
from gateway.proxy.route_plan import RoutePlan


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


def refused(refusal: Refusal) -> web.Response:
    """The decision core's refusal (over a rate or concurrency limit, or a store that failed
    a fail-closed limit) as the answer it prebuilt: only X-Request-ID is added, by the handler."""
    return Answer(refusal.status, refusal.body, CIMultiDict(refusal.headers))
