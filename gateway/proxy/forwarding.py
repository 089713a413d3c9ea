"""Sending an admitted request upstream: the one attempt loop every route goes through.

A route with one `upstream` is a pool of one target without ejection, so HTTP
requests and WebSocket handshakes alike go through `forward`: the target the
balancer picks takes a slot of its upstream (`UpstreamSlots`, a wait bounded by
`timeout.queue`, else 503), the attempt is sent, its outcome is counted for the
target, and a connect failure goes to another target as far as
`gateway.upstream.balancing.retry_allowed` lets it; none left in rotation is the other 503.
A slot is held until the response has been passed on, or for a WebSocket until
it closes, so neither kind of traffic can take every connection from the other
without the other getting its bounded answer.

The upstream client's errors are translated here: a refused upstream is 502, a
slow one 504, a broken one 502. The client learns what failed, never where: the
upstream's address stays in the log. Trusts the plans compiled from the config.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from aiohttp import hdrs, web
from aiohttp.http import HttpVersion10
from multidict import CIMultiDict
from yarl import URL

from gateway.metrics import NO_TARGET, QUEUE_FULL
from gateway.proxy.access_log import AccessRecord
from gateway.proxy.bounded_protocol import ClientLimitExceeded, hung_up
from gateway.proxy.header_rewrite import rewrite_headers
from gateway.proxy.problem import RETRY_AFTER_ONE, Problem, problem_response
from gateway.proxy.relayed_response import ArrivedResponse, RelayedResponse
from gateway.proxy.response_cost import CostMeter
from gateway.proxy.route_plan import PoolPlan, RoutePlan, TargetPlan
from gateway.proxy.upstreams import Upstream
from gateway.proxy.websocket import WebSocketConnectFailed, proxy_websocket
from gateway.upstream.balancing import Outcome, retry_allowed
from gateway.upstream.body import RequestBody
from gateway.upstream.client import UpstreamClient
from gateway.upstream.errors import ConnectFailed, UpstreamError, UpstreamTimeout

log = logging.getLogger(__name__)

_CANNOT_CONNECT = Problem.of(502, "Bad Gateway", "Cannot connect to the upstream.")
_FAILED = Problem.of(502, "Bad Gateway", "The upstream failed.")
_UNBOUNDED = contextlib.nullcontext()  # reusable: a route without timeout.total


# One attempt on one target: its answer, or _ConnectFailed when nothing was sent.
Attempt = Callable[[TargetPlan, Upstream, float | None], Awaitable[web.StreamResponse]]


async def forward(
    plan: RoutePlan,
    attempt: Attempt,
    limit_headers: dict[str, str],
    record: AccessRecord,
) -> web.StreamResponse:
    """Run `attempt` on the target the balancer picks and, after a connect failure, on
    another. The limiter decided once, before: a retry charges the client nothing."""
    pool = plan.pool
    started = time.monotonic()
    tried = 0  # bit i: target i was tried
    remaining = plan.total_timeout
    failed: web.StreamResponse | None = None  # the 502 or 504 of the last connect failure
    while True:
        index = _next_target(pool, plan, tried, failed, limit_headers)
        if not isinstance(index, int):
            return index
        tried |= 1 << index
        target = pool.targets[index]
        record.upstream_target = target.label
        upstream = target.upstream
        slots = upstream.slots
        if not slots.try_take() and not await slots.take(plan.queue_timeout):
            plan.unavailable(QUEUE_FULL).inc()
            return problem_response(503, plan.queue_full, headers={**limit_headers, **RETRY_AFTER_ONE})
        target.requests.inc()
        target.state.in_flight += 1
        try:
            return await attempt(target, upstream, remaining)
        except _ConnectFailed as exc:
            failed = exc.response
        finally:
            target.state.in_flight -= 1
            slots.give_back()
        if plan.total_timeout is not None:
            remaining = plan.total_timeout - (time.monotonic() - started)
        if not retry_allowed(Outcome.CONNECT_FAILED, retries_used=tried.bit_count() - 1, retries=pool.retries, remaining=remaining):
            return failed


class HttpAttempt:
    """An HTTP request's attempt (an `Attempt`, tried on each target in turn): send it, and
    relay the answer as it streams."""

    __slots__ = ("body", "headers", "host", "length", "limit_headers", "meter", "plan", "record", "request", "rest")

    def __init__(
        self,
        request: web.BaseRequest,
        plan: RoutePlan,
        rest: str,
        headers: CIMultiDict[str],
        host: str | None,
        body: RequestBody,
        length: int | None,
        limit_headers: dict[str, str],
        record: AccessRecord,
        meter: CostMeter | None = None,
    ) -> None:
        """`meter`: reads the response's cost as it is relayed, and settles it before the last
        bytes go, so the client's next request finds it settled (gateway.proxy.response_cost)."""
        self.request, self.plan, self.rest, self.headers, self.host = request, plan, rest, headers, host
        self.body, self.length, self.limit_headers, self.record = body, length, limit_headers, record
        self.meter = meter

    async def __call__(self, target: TargetPlan, upstream: Upstream, remaining: float | None) -> web.StreamResponse:
        # timeout.total bounds the whole exchange, the relay of the body included.
        deadline = None if remaining is None else asyncio.get_running_loop().time() + remaining
        return await self._exchange(target, upstream.client, deadline)

    async def _exchange(self, target: TargetPlan, client: UpstreamClient, deadline: float | None) -> web.StreamResponse:
        request, plan, headers, limit_headers, record = self.request, self.plan, self.headers, self.limit_headers, self.record
        rest, body, length, host = self.rest, self.body, self.length, self.host
        sent = time.perf_counter()
        try:
            async with _until(deadline):
                upstream = await client.request(
                    request.method, rest, headers, body, length=length, host=host,
                    connect_timeout=plan.connect_timeout, read_timeout=plan.read_timeout,
                )
        except TimeoutError:
            _count(target, Outcome.TIMEOUT)
            return problem_response(504, plan.upstream_timeout, headers=limit_headers)
        except ConnectFailed as exc:
            _count(target, Outcome.CONNECT_FAILED)
            log.warning("cannot connect to upstream %s: %s", target.where, exc)
            if exc.timed_out:
                raise _ConnectFailed(problem_response(504, plan.upstream_timeout, headers=limit_headers)) from None
            raise _ConnectFailed(_CANNOT_CONNECT.response(limit_headers)) from None
        except UpstreamTimeout:
            _count(target, Outcome.TIMEOUT)
            return problem_response(504, plan.upstream_timeout, headers=limit_headers)
        except UpstreamError as exc:
            stalled = request.content.exception()
            if isinstance(stalled, ClientLimitExceeded):
                return stalled.response()  # the client's body stalled (client_body_timeout), not the upstream
            _count(target, Outcome.FAILED)
            log.warning("upstream %s failed: %s", target.where, exc)
            return _FAILED.response(limit_headers)
        latency = time.perf_counter() - sent
        plan.upstream_latency().observe(latency)
        target.latency.observe(latency)
        # One outcome per attempt, counted once its relay has ended: a response cut off mid-body
        # is a failure, not an answer and then a failure, which would reset the count each time
        # and keep a target that cuts every response from being ejected.
        outcome = Outcome.SERVER_ERROR if upstream.status >= 500 else Outcome.ANSWERED
        try:
            record.upstream_status, record.upstream_ms = upstream.status, round(latency * 1000, 3)
            arrived = upstream.arrived
            response = (ArrivedResponse if arrived else RelayedResponse)(status=upstream.status, reason=upstream.reason)
            response.headers.extend(upstream.headers)
            plan.locations.apply(response.headers, headers)
            if plan.response_headers is not None:
                rewrite_headers(response.headers, plan.response_headers)
            response.headers.update(limit_headers)
            response.headers["X-Request-ID"] = record.request_id
            if request.version == HttpVersion10 and hdrs.CONTENT_LENGTH not in response.headers:
                # To HTTP/1.0 such a body ends with the connection; aiohttp would keep a
                # keep-alive client's open, and the client would wait out keepalive_timeout.
                response.force_close()
            meter = self.meter
            if meter is not None:
                meter.head(upstream.headers)
            await response.prepare(request)
            try:
                if arrived:
                    body = upstream.take()
                    if meter is not None:
                        meter.feed(body)
                        await meter.finish()
                    await response.write_eof(body)
                    return response
                async with _until(deadline):
                    if meter is None:
                        while chunk := await upstream.read():
                            await response.write(chunk)
                    else:
                        while chunk := await upstream.read():
                            meter.feed(chunk)
                            await response.write(chunk)
                if meter is not None:  # past timeout.total's reach: the body has all come
                    await meter.finish()
            except TimeoutError:
                # Past timeout.total with the status line gone: all that is left is to cut the connection.
                outcome = Outcome.TIMEOUT
                log.warning("upstream %s passed timeout.total mid-response", target.where)
                if request.transport is not None:
                    request.transport.close()
                return response
            except ConnectionResetError:
                return response  # the client went away; the unfinished upstream connection is closed
            except asyncio.CancelledError:
                if not hung_up(request):
                    raise
                # The client went away mid-response: its status was sent, and is what is logged.
                asyncio.current_task().uncancel()  # type: ignore[union-attr]
                return response
            except UpstreamError as exc:
                # The status line is gone; all that is left is to cut the connection.
                outcome = Outcome.FAILED
                log.warning("upstream %s failed mid-response: %s", target.where, exc or type(exc).__name__)
                if request.transport is not None:
                    request.transport.close()
                return response
            await response.write_eof()
            return response
        finally:
            client.release(upstream)
            _count(target, outcome)


def websocket_attempt(
    request: web.BaseRequest, plan: RoutePlan, rest: str, headers: CIMultiDict[str], limit_headers: dict[str, str], record: AccessRecord
) -> Attempt:
    """A WebSocket handshake's attempt, and then its frames both ways on aiohttp's client.
    Its connect failures and accepted handshakes count for passive ejection; the frames
    that follow count for nothing."""
    ws_headers = {**limit_headers, "X-Request-ID": record.request_id}
    timed_out = problem_response(504, plan.upstream_timeout, headers=limit_headers)

    async def attempt(target: TargetPlan, upstream: Upstream, remaining: float | None) -> web.StreamResponse:
        def answered(status: int, latency: float) -> None:
            plan.upstream_latency().observe(latency)
            target.latency.observe(latency)
            record.upstream_status, record.upstream_ms = status, round(latency * 1000, 3)

        sent = headers
        if upstream.ws_authorization is not None:
            sent = headers.copy()  # another target of the pool may have no credentials of its own
            sent[hdrs.AUTHORIZATION] = upstream.ws_authorization
        session = upstream.ws_session(plan.connect_timeout, plan.read_timeout)
        try:
            return await proxy_websocket(
                request, session, URL(upstream.ws_base + rest, encoded=True), sent, ws_headers,
                timed_out, answered, opened=lambda: _count(target, Outcome.ANSWERED),
            )
        except WebSocketConnectFailed as exc:
            _count(target, Outcome.CONNECT_FAILED)
            log.warning("cannot open a WebSocket to upstream %s: %s", target.where, exc.reason)
            raise _ConnectFailed(exc.response) from None

    return attempt


def _until(deadline: float | None) -> contextlib.AbstractAsyncContextManager[object]:
    return _UNBOUNDED if deadline is None else asyncio.timeout_at(deadline)


class _ConnectFailed(Exception):
    """An attempt that could not connect: nothing was sent, so another target may take
    the request. `response` is the client's answer if none does."""

    def __init__(self, response: web.Response) -> None:
        super().__init__()
        self.response = response


def _count(target: TargetPlan, outcome: Outcome) -> None:
    """Count one attempt's outcome on a target: its metrics and its passive ejection."""
    if outcome is not Outcome.ANSWERED:
        target.errors(outcome.value).inc()
    if target.state.answered(outcome, time.monotonic()):
        target.ejections.inc()
        passive = target.state.passive
        assert passive is not None  # only a target with passive ejection is ejected
        log.warning(
            "upstream target %s is out of rotation for %g s after %d consecutive failures",
            target.name, passive.eject_for, passive.eject_after,
        )


def _next_target(
    pool: PoolPlan, plan: RoutePlan, tried: int, failed: web.StreamResponse | None, limit_headers: dict[str, str]
) -> int | web.StreamResponse:
    """The index of the target for the next attempt (a retry counted as one), or, with none
    left, the answer: the last attempt's failure, else 503 for want of a target."""
    index = pool.balancer.choose(time.monotonic(), tried)
    if index is not None:
        if tried:
            plan.retried.inc()
        return index
    if failed is not None:
        return failed
    plan.unavailable(NO_TARGET).inc()
    return pool.no_target.response({**limit_headers, **RETRY_AFTER_ONE})
