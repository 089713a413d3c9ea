"""The request path: route, shed past max_in_flight, rate-limit, take concurrency leases, then
proxy (or answer 404/429/503), giving the leases back when the response has ended.

Knows nothing of Redis: it asks the decision core (gateway.decision) for a verdict. Trusts the
config; trusts nothing in the request. The upstream contacted always comes
from the matched route, never from the request target or the Host header.
Bodies stream both ways in chunks and are never held whole, except that a
request body still arriving is read ahead up to 64 KiB (a chunked one up to the
route's max_body_size) before an upstream connection is taken, so a client that
trickles its body holds none. Sending it upstream, and the answers that can
come of that, are gateway.proxy.forwarding's.
"""

from __future__ import annotations

import asyncio
import logging
import ssl

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from gateway.config.model import GatewayConfig
from gateway.decision.core import Decider
from gateway.decision.settle import Reservations
from gateway.identity.methods import method_label
from gateway.identity.values import IdentityRejected
from gateway.limiter.concurrency import Admission
from gateway.metrics import STATUS_CLASSES, Metrics
from gateway.proxy.access_log import ACCESS_RECORD, AccessRecord, request_id
from gateway.proxy.asked_identities import lease_identities, rate_identities
from gateway.proxy.bounded_protocol import CANCEL_ON_HANGUP, ClientLimitExceeded, hung_up
from gateway.proxy.forwarding import HttpAttempt, forward, websocket_attempt
from gateway.proxy.header_rewrite import rewrite_headers
from gateway.proxy.headers import GATEWAY_WRITTEN, add_forwarded, drop_cgi_aliases, end_to_end
from gateway.proxy.paths import NormalPath, PathRejected, normalize_path
from gateway.proxy.problem import RETRY_AFTER_ONE, problem
from gateway.proxy.protocol import checked_host
from gateway.proxy.rejections import body_too_large, not_a_handshake, refused
from gateway.proxy.request_body import (
    REQUEST_BUFFER_BYTES,
    STREAM_CHUNK_BYTES,
    awaiting_continue,
    expectation,
    read_ahead,
    send_continue,
)
from gateway.proxy.response_cost import CostMeter
from gateway.proxy.route_plan import Plans, RoutePlan, compile_plans
from gateway.proxy.routing import ConditionRejected
from gateway.proxy.upstreams import Upstream
from gateway.proxy.websocket import ClientLeft, is_websocket_upgrade
from gateway.upstream.balancing import TargetStates
from gateway.upstream.body import RequestBody
from gateway.upstream.connection import HeadBounds
from gateway.upstream.health_checks import HealthChecks

log = logging.getLogger(__name__)

# nginx's status for a request whose client closed the connection before the answer:
# logged and counted, never sent, and never a 5xx, which would page someone for a client's choice.
CLIENT_CLOSED = 499


class ProxyHandler:
    def __init__(self, config: GatewayConfig, decider: Decider, metrics: Metrics) -> None:
        # Each pool target's health, ejection and load, kept across reloads.
        self._targets = TargetStates()
        self._decider = decider
        self._metrics = metrics
        self._connections = config.upstream_connections
        self._head_bounds = HeadBounds(max_size=config.upstream_max_header_size, max_lines=config.upstream_max_header_lines)
        # One TLS context for every https upstream, made with the first: loading the system's
        # trust store costs tens of milliseconds, which a gateway without one never pays.
        self._tls: ssl.SSLContext | None = None
        # Each upstream some config in use names, by base URL; the plans hold them too.
        self._upstreams: dict[str, Upstream] = {}
        # Upstreams a reload dropped (a pool's targets replaced, a route removed), by the
        # generation of the config that dropped them. Requests that began on an older config
        # may still send there, so each closes once none of those is in flight: a fleet
        # whose targets change on every deploy would otherwise keep every target it ever had.
        self._generation = 0
        self._in_flight_by_generation: dict[int, int] = {}
        self._retiring: dict[str, int] = {}
        # Everything compiled from the config sits behind this one reference.
        self._plans = self._compile(config)
        metrics.keep_targets(frozenset(t.name for t in self._plans.pool_targets))
        metrics.keep_routes(self._plans.route_labels, self._plans.limit_names)
        self._health = HealthChecks(metrics.target_healthy, metrics.show_targets, self._tls_of)
        self._closing: set[asyncio.Future[None]] = set()  # the event loop holds tasks only weakly
        self._in_flight = 0  # requests in handle() now, this one included

    def _compile(self, config: GatewayConfig) -> Plans:
        return compile_plans(config, self._metrics, self._targets.update(config), self._decider.limiter, self._upstream)

    def _upstream(self, url: str) -> Upstream:
        """The upstream of `url`: the one a config in use names (a retiring one too, which
        this keeps), else a new one."""
        self._retiring.pop(url, None)  # named again before it closed: kept
        upstream = self._upstreams.get(url)
        if upstream is None:
            upstream = self._upstreams[url] = Upstream(url, self._connections, self._tls_of(url), self._head_bounds)
        return upstream

    def _tls_of(self, url: str) -> ssl.SSLContext | None:
        """The TLS context of an https `url`, the proxy's and its health checks' (None for http)."""
        if url[:6].lower() != "https:":
            return None
        if self._tls is None:
            # The system's trust store (SSL_CERT_FILE too), verified, with each target's
            # host name for SNI and the certificate check.
            self._tls = ssl.create_default_context()
        return self._tls

    async def start(self) -> None:
        self._health.update(self._plans.pool_targets)

    def reload(self, config: GatewayConfig) -> None:
        """Serve `config` from the next request on. A request in flight read the old plans
        once, at its start, and finishes on them; the connections of upstreams it may still
        use stay open until no request begun before this reload is in flight."""
        plans = self._compile(config)
        self._generation += 1
        kept = set(plans.upstreams)
        for url in self._upstreams:
            if url not in kept:
                self._retiring.setdefault(url, self._generation)
        self._plans = plans
        self._metrics.keep_targets(frozenset(t.name for t in plans.pool_targets))
        self._metrics.keep_routes(plans.route_labels, plans.limit_names)
        self._health.update(plans.pool_targets)
        self._close_retired()

    def _close_retired(self) -> None:
        """Close the upstreams dropped by a config that every request still in flight began
        on (or after): no request can send to them any more."""
        oldest = min(self._in_flight_by_generation, default=self._generation)
        doomed = [url for url, generation in self._retiring.items() if generation <= oldest]
        for url in doomed:
            del self._retiring[url]
            task = asyncio.ensure_future(self._upstreams.pop(url).close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    @property
    def plans(self) -> Plans:
        """The plans of the config being served; a request reads them once, at its start."""
        return self._plans

    @property
    def in_flight(self) -> int:
        """Requests being handled now: a drain waits for this to reach 0."""
        return self._in_flight

    async def close(self) -> None:
        await self._health.close()
        if self._closing:
            await asyncio.wait(self._closing)
        for upstream in self._upstreams.values():
            await upstream.close()
        self._upstreams.clear()

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        """Every request on the public listener comes here, whatever its target."""
        plans = self._plans
        generation = self._generation
        self._in_flight += 1
        by_generation = self._in_flight_by_generation
        by_generation[generation] = by_generation.get(generation, 0) + 1
        self._metrics.in_flight.inc()
        requests = plans.unmatched
        response: web.StreamResponse | None = None
        record = AccessRecord(request_id(request.headers.get("X-Request-ID")), plans.identity, plans.log_secret)
        request[ACCESS_RECORD] = record
        try:
            host = checked_host(request)
            if not isinstance(host, str):
                response = host
                return response
            raw_path = _raw_path(request)
            if raw_path is None:
                # CONNECT (whatever its target) and asterisk-form (OPTIONS *) targets name no
                # resource of ours: this is a reverse proxy, never a tunnel. What follows a
                # CONNECT was meant as tunnel data, so the connection closes rather than
                # reading it as requests; and this comes before any Expect is answered, so
                # neither a 100 Continue nor a 417 invites that data.
                response = problem(400, "Bad Request", "Only origin-form request targets such as /path are served.")
                response.force_close()
                return response
            if "Expect" in request.headers:
                response = expectation(request)
                if response is not None:
                    return response
            try:
                path = normalize_path(raw_path, plans.path_rule)
            except PathRejected as exc:
                response = problem(400, "Bad Request", str(exc))
                return response
            try:
                plan = plans.router.find(request.method, host, path.match, request.headers, request.rel_url)
            except ConditionRejected as exc:
                response = problem(400, "Bad Request", str(exc))
                return response
            if plan is None:
                response = plans.not_found.response()
                return response
            requests = plan.requests
            record.route = plan.label
            if path.parameters and not plan.allow_path_parameters:
                response = problem(400, "Bad Request", "This route does not accept ';' parameters in the path.")
                return response
            if self._in_flight > plans.max_in_flight:
                # Overload, answered at once: neither the limiter nor the upstream hears of it.
                self._metrics.shed.inc()
                response = plans.shed.response(RETRY_AFTER_ONE)
                return response
            if plan.max_body_size is not None and (request.content_length or 0) > plan.max_body_size:
                response = body_too_large(plan)  # the declared length says so: nothing is read or charged
                return response
            if (request.body_exists or request.method != "GET") and is_websocket_upgrade(request):
                response = not_a_handshake()
                return response
            response = await self._limited(request, plan, plans, path, record)
            return response
        finally:
            if response is not None and not response.prepared:
                response.headers["X-Request-ID"] = record.request_id
                if awaiting_continue(request):
                    # Answered without the body, which the client was never invited to send:
                    # closing is the one way its next bytes cannot be misread as a request.
                    response.force_close()
            self._in_flight -= 1
            if by_generation[generation] == 1:
                del by_generation[generation]
                if self._retiring:
                    self._close_retired()
            else:
                by_generation[generation] -= 1
            self._metrics.in_flight.dec()
            status = response.status if response is not None else 500
            requests(method_label(request.method), STATUS_CLASSES[status // 100]).inc()

    async def _limited(
        self, request: web.BaseRequest, plan: RoutePlan, plans: Plans, path: NormalPath, record: AccessRecord
    ) -> web.StreamResponse:
        decision = plan.decision
        if not decision.limits and not decision.concurrency:
            # Nothing to decide: nothing asked, nothing timed.
            return await self._proxy_for_client(request, plan, plans, path, decision.fields.fixed, record, None)
        try:
            identities, held = rate_identities(request, plan, plans.identity, record)
            leases = lease_identities(request, plan, plans.identity, record) if decision.concurrency else None
        except IdentityRejected as exc:
            # Nothing was charged, and the upstream never hears of it.
            return problem(exc.status, exc.title, exc.detail, headers=exc.headers)
        verdict = await self._decider.decide(
            decision, identities, held=held, max_delayed=plans.max_delayed, lease_identities=leases
        )
        if decision.limits:
            record.checks, record.decision = verdict.checks, verdict.decision
        admission = verdict.admission
        if admission is not None and leases is not None:
            record.admission, record.lease_identities = admission, leases
        if verdict.refusal is not None:
            return refused(verdict.refusal)
        if not decision.metered:
            return await self._admitted(request, plan, plans, path, verdict.fields, record, admission, None)
        meter = CostMeter(Reservations(decision, verdict, self._decider.limiter.settlements))
        try:
            return await self._admitted(request, plan, plans, path, verdict.fields, record, admission, meter)
        finally:
            # A response relayed to its end was settled before its last bytes; any other end settles here.
            await meter.finish()

    async def _admitted(
        self,
        request: web.BaseRequest,
        plan: RoutePlan,
        plans: Plans,
        path: NormalPath,
        limit_headers: dict[str, str],
        record: AccessRecord,
        admission: Admission | None,
        meter: CostMeter | None,
    ) -> web.StreamResponse:
        if admission is None:
            return await self._proxy_for_client(request, plan, plans, path, limit_headers, record, meter)
        in_flight = [cp.in_flight for cp in plan.decision.concurrency]
        for gauge in in_flight:
            gauge.inc()
        try:
            return await self._proxy_for_client(request, plan, plans, path, limit_headers, record, meter)
        finally:
            # However the response ended: complete, the client gone, the upstream failed, a WebSocket closed.
            admission.release()
            for gauge in in_flight:
                gauge.dec()

    async def _proxy_for_client(
        self,
        request: web.BaseRequest,
        plan: RoutePlan,
        plans: Plans,
        path: NormalPath,
        limit_headers: dict[str, str],
        record: AccessRecord,
        meter: CostMeter | None,
    ) -> web.StreamResponse:
        if request.transport is None:
            return self._client_closed(plan)  # it hung up while the limiter decided: the upstream never hears of it
        rest = _upstream_rest(request, plan, path)
        headers = _forward_headers(request, plan, plans)
        headers["X-Request-ID"] = record.request_id
        if is_websocket_upgrade(request):
            # A WebSocket's end is its own close frame or connection, handled by its relay.
            if meter is not None:
                meter.unread()  # its frames are not read: each limit is charged its `missing`
            attempt = websocket_attempt(request, plan, rest, headers, limit_headers, record)
            try:
                return await forward(plan, attempt, limit_headers, record)
            except ClientLeft:
                return self._client_closed(plan)  # while its handshake waited for the upstream
        # From here on, a client that hangs up cancels this task: the upstream request is
        # abandoned rather than finished for nobody (see gateway.proxy.bounded_protocol).
        task = asyncio.current_task()
        assert task is not None  # a handler runs in its request's task
        request[CANCEL_ON_HANGUP] = task
        try:
            return await self._proxy(request, plan, rest, headers, limit_headers, record, meter)
        except asyncio.CancelledError:
            if not hung_up(request):
                raise  # a shutdown's cancel, not the client's
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            return self._client_closed(plan)
        finally:
            request.pop(CANCEL_ON_HANGUP, None)

    def _client_closed(self, plan: RoutePlan) -> web.Response:
        plan.client_closed().inc()
        return web.Response(status=CLIENT_CLOSED)

    async def _proxy(
        self,
        request: web.BaseRequest,
        plan: RoutePlan,
        rest: str,
        headers: CIMultiDict[str],
        limit_headers: dict[str, str],
        record: AccessRecord,
        meter: CostMeter | None,
    ) -> web.StreamResponse:
        """An HTTP request (not a WebSocket handshake): its body, then the upstream or pool.
        `meter`: reads the response's cost as it is relayed (gateway.proxy.response_cost)."""
        body: RequestBody = request.content if request.body_exists else None
        try:
            if awaiting_continue(request):
                await send_continue(request)
            if body is not None and plan.max_body_size is not None and request.content_length is None:
                # A chunked body declares no length: it is read whole, up to the cap,
                # so a body over the cap never reaches the upstream.
                body = await read_ahead(request.content, plan.max_body_size, cap=True)
                if body is None:
                    return body_too_large(plan, limit_headers)
            elif body is not None and not request.content.is_eof():
                # The body is still arriving: read it ahead before an upstream connection is
                # taken, so a client that trickles it holds none. A body that
                # arrived with its head, as most do, skips this.
                body = await read_ahead(request.content, REQUEST_BUFFER_BYTES, cap=False)
        except ClientLimitExceeded as exc:
            return exc.response()  # client_body_timeout
        except ConnectionError:
            return self._client_closed(plan)  # the connection closed before the request body ended
        if isinstance(body, aiohttp.StreamReader):
            length = request.content_length
            body = body.read_nowait() if body.is_eof() else body.iter_chunked(STREAM_CHUNK_BYTES)
        elif isinstance(body, bytes):
            length = len(body)  # read whole: sent with its length, whatever its framing was
        else:
            length = request.content_length
        host = request.headers.get("Host") if plan.preserve_host else None
        attempt = HttpAttempt(request, plan, rest, headers, host, body, length, limit_headers, record, meter)
        return await forward(plan, attempt, limit_headers, record)


def _raw_path(request: web.BaseRequest) -> str | None:
    """The path of the request target exactly as received, or None for a target that is not a
    path, and for any CONNECT."""
    if request.method == "CONNECT":
        return None  # forwarded, an upstream's 2xx would make the connection a tunnel
    target = request.raw_path  # the whole request target, as the parser read it
    if target[:1] == "/":
        return target.partition("?")[0]  # a "#" stays in, and is refused as no path character
    # Absolute-form: yarl has split the path off as received; an empty one means "/" (RFC 9112 §3.2.2).
    raw_path = request.rel_url.raw_path or "/"
    return raw_path if raw_path[:1] == "/" else None


def _upstream_rest(request: web.BaseRequest, plan: RoutePlan, path: NormalPath) -> str:
    """What follows the upstream's base URL: the path as it was matched (less the prefix
    with strip_prefix), and the query as received."""
    forward = path.forward if plan.strip is None else plan.strip.rest(path.forward)
    query = request.rel_url.raw_query_string
    return forward + ("?" + query if query else "")


def _forward_headers(request: web.BaseRequest, plan: RoutePlan, plans: Plans) -> CIMultiDict[str]:
    headers = end_to_end(request.headers, GATEWAY_WRITTEN)
    # The gateway answered the expectation itself. Passed on, it made aiohttp hold the body
    # until the upstream sent a 100 Continue, which an upstream need not send: the request
    # then waited out its timeout for a 504. nginx clears it too (proxy_set_header Expect "").
    headers.popall("Expect", None)
    original_host = request.headers.get("Host", "")
    # The upstream client writes Host (the client's, with preserve_host) and the body's framing.
    headers.popall("Host", None)
    headers.popall("Content-Length", None)
    drop_cgi_aliases(headers, plan.cgi_written)
    if plan.request_headers is not None:
        rewrite_headers(headers, plan.request_headers)
    remote = request.remote or ""
    peer, trusted = plans.identity.address(remote)  # a dict hit for a returning client
    add_forwarded(
        headers,
        peer=peer or remote,
        proto=request.scheme,
        host=original_host,
        trusted=trusted,
        replace=plans.replace_forwarded,
    )
    return headers
