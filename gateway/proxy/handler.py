"""The request path: route, shed past max_in_flight, rate-limit, then proxy (or answer 404/429/503).

Knows nothing of Redis: it asks `Limiter.check` for a decision. Trusts the
config; trusts nothing in the request. The upstream contacted always comes
from the matched route, never from the request target or the Host header.
Bodies stream both ways in chunks and are never held whole, except that a
request body still arriving is read ahead up to 64 KiB (a chunked one up to the
route's max_body_size) before an upstream connection is taken, so a client that
trickles its body holds none. aiohttp client errors are translated here: a
refused or failed upstream is 502, a slow one 504; no free upstream connection
within timeout.queue is 503.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web
from aiohttp.http import HttpVersion11
from multidict import CIMultiDict
from yarl import URL

from gateway.access_log import ACCESS_RECORD, AccessRecord, request_id
from gateway.bounded_protocol import ClientLimitExceeded
from gateway.config.model import GatewayConfig
from gateway.limiter.limiter import DENY, FAIL_CLOSED, FAIL_LOCAL, UNLIMITED, Decision, Limiter
from gateway.limiter.store import LimitCheck
from gateway.metrics import STATUS_CLASSES, Metrics, method_label
from gateway.proxy.client_identity import ClientIdentity, IdentityRejected
from gateway.proxy.headers import GATEWAY_WRITTEN, add_forwarded, end_to_end
from gateway.proxy.paths import NormalPath, PathRejected, normalize_path
from gateway.proxy.problem import problem, problem_response
from gateway.proxy.protocol import request_line_problem
from gateway.proxy.ratelimit_headers import ratelimit_headers, retry_after_seconds
from gateway.proxy.route_plan import Plans, RoutePlan, compile_plans
from gateway.proxy.upstream_slots import UpstreamSlots
from gateway.proxy.websocket import is_websocket_upgrade, proxy_websocket

log = logging.getLogger(__name__)

# A request body as forwarded: as it streams, whole, or read ahead and then streaming.
_Body = aiohttp.StreamReader | bytes | AsyncIterator[bytes] | None

# Big enough to keep syscalls few, small enough that many streams stay within a
# modest RSS: 1000 concurrent streams hold at most ~64 MB of chunks.
STREAM_CHUNK_BYTES = 64 * 1024
# A request body still arriving is read ahead up to this before an upstream connection is
# taken (nginx buffers request bodies too, 16 KiB in memory); larger bodies then stream.
# 1,000 requests reading ahead hold at most ~64 MB.
REQUEST_BUFFER_BYTES = 64 * 1024
_RETRY_AFTER_ONE = {"Retry-After": "1"}  # shared safely: a Response copies the headers it is given


class ProxyHandler:
    def __init__(self, config: GatewayConfig, limiter: Limiter, metrics: Metrics) -> None:
        # Everything compiled from the config sits behind this one reference.
        self._plans = compile_plans(config, metrics)
        self._limiter = limiter
        self._metrics = metrics
        self._sessions: dict[str, aiohttp.ClientSession] = {}
        self._connections = config.upstream_connections
        self._slots = {upstream: UpstreamSlots(self._connections) for upstream in self._plans.upstreams}
        self._in_flight = 0  # requests in handle() now, this one included

    async def start(self) -> None:
        for upstream in self._plans.upstreams:
            self._sessions[upstream] = self._session()

    def _session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            # Requests wait for a slot in UpstreamSlots, boundedly; the connector's own
            # limit, the same, only ever queues WebSockets, which hold no slot.
            connector=aiohttp.TCPConnector(limit=self._connections, ttl_dns_cache=60),
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            trust_env=False,
            timeout=aiohttp.ClientTimeout(total=None),
        )

    def reload(self, config: GatewayConfig) -> None:
        """Serve `config` from the next request on. A request in flight read the old plans
        once, at its start, and finishes on them; the sessions of upstreams it may still
        use stay open until close()."""
        plans = compile_plans(config, self._metrics)
        for upstream in plans.upstreams:
            if upstream not in self._sessions:
                self._sessions[upstream] = self._session()
                self._slots[upstream] = UpstreamSlots(self._connections)
        self._plans = plans

    @property
    def in_flight(self) -> int:
        """Requests being handled now: a drain waits for this to reach 0."""
        return self._in_flight

    async def close(self) -> None:
        for session in self._sessions.values():
            await session.close()
        self._sessions.clear()

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        """Every request on the public listener comes here, whatever its target."""
        plans = self._plans
        self._in_flight += 1
        self._metrics.in_flight.inc()
        requests = plans.unmatched
        response: web.StreamResponse | None = None
        record = AccessRecord(request_id(request.headers.get("X-Request-ID")), plans.identity, plans.log_secret)
        request[ACCESS_RECORD] = record
        try:
            response = request_line_problem(request)
            if response is not None:
                return response
            if "Expect" in request.headers:
                response = await _expectation(request)
                if response is not None:
                    return response
            raw_path = _raw_path(request)
            if raw_path is None:
                # CONNECT (whatever its target) and asterisk-form (OPTIONS *) targets name no
                # resource of ours: this is a reverse proxy, never a tunnel. What follows a
                # CONNECT was meant as tunnel data, so the connection closes rather than
                # reading it as requests.
                response = problem(400, "Bad Request", "Only origin-form request targets such as /path are served.")
                response.force_close()
                return response
            try:
                path = normalize_path(raw_path, plans.path_rule)
            except PathRejected as exc:
                response = problem(400, "Bad Request", str(exc))
                return response
            plan = plans.router.find(request.method, _request_host(request), path.match)
            if plan is None:
                response = problem(404, "Not Found", "No route matches this request.")
                return response
            requests = plan.requests
            record.route = plan.label
            if path.parameters and not plan.allow_path_parameters:
                response = problem(400, "Bad Request", "This route does not accept ';' parameters in the path.")
                return response
            if self._in_flight > plans.max_in_flight:
                # Overload, answered at once: neither the limiter nor the upstream hears of it.
                self._metrics.shed.inc()
                response = problem_response(503, plans.shed, headers=_RETRY_AFTER_ONE)
                return response
            if plan.max_body_size is not None and (request.content_length or 0) > plan.max_body_size:
                response = _body_too_large(plan)  # the declared length says so: nothing is read or charged
                return response
            response = await self._limited(request, plan, plans, path, record)
            return response
        finally:
            if response is not None and not response.prepared:
                response.headers["X-Request-ID"] = record.request_id
            self._in_flight -= 1
            self._metrics.in_flight.dec()
            status = response.status if response is not None else 500
            requests(method_label(request.method), STATUS_CLASSES[status // 100]).inc()

    async def _limited(
        self, request: web.BaseRequest, plan: RoutePlan, plans: Plans, path: NormalPath, record: AccessRecord
    ) -> web.StreamResponse:
        try:
            decision = await self._decide(request, plan, plans.identity, record)
        except IdentityRejected as exc:
            # Nothing was charged, and the upstream never hears of it.
            return problem(exc.status, exc.title, exc.detail, headers=exc.headers)
        limit_headers = ratelimit_headers(decision.statuses, plan.policies)
        if not decision.allowed:
            return _rejection(plan, decision, limit_headers)
        url = _upstream_url(request, plan, path)
        headers = _forward_headers(request, plan, plans)
        headers["X-Request-ID"] = record.request_id
        if is_websocket_upgrade(request):
            ws_headers = {**limit_headers, "X-Request-ID": record.request_id}
            return await proxy_websocket(request, self._sessions[plan.upstream], url, headers, ws_headers)
        body: _Body = request.content if request.body_exists else None
        try:
            if body is not None and plan.max_body_size is not None and request.content_length is None:
                # A chunked body declares no length: it is read whole, up to the cap,
                # so a body over the cap never reaches the upstream.
                body = await _read_ahead(request.content, plan.max_body_size, cap=True)
                if body is None:
                    return _body_too_large(plan, limit_headers)
            elif body is not None and not request.content.is_eof():
                # The body is still arriving: read it ahead before an upstream connection is
                # taken, so a client that trickles it holds none (issue 8 §3). A body that
                # arrived with its head, as most do, skips this.
                body = await _read_ahead(request.content, REQUEST_BUFFER_BYTES, cap=False)
        except ClientLimitExceeded as exc:
            return exc.response()  # client_body_timeout
        except ConnectionError:
            return problem(400, "Bad Request", "The connection closed before the request body ended.")
        slots = self._slots[plan.upstream]
        if not slots.try_take() and not await slots.take(plan.queue_timeout):
            return problem_response(503, plan.queue_full, headers={**limit_headers, **_RETRY_AFTER_ONE})
        try:
            return await self._forward(request, plan, url, headers, limit_headers, body, record)
        finally:
            slots.give_back()

    async def _decide(
        self, request: web.BaseRequest, plan: RoutePlan, identity: ClientIdentity, record: AccessRecord
    ) -> Decision:
        if not plan.limits:
            return UNLIMITED
        started = time.perf_counter()
        client_ip = record.client = identity.client_ip(request)
        identities = identity.identities(request, plan.identity, client_ip)
        checks = [
            LimitCheck(limit=lp.limit, identity=who, cost=lp.cost) for lp, who in zip(plan.limits, identities)
        ]
        if plan.shadowed:
            decision = await self._limiter.check_with_shadow(checks)
        else:
            decision = await self._limiter.check(checks)
        record.checks, record.decision = checks, decision
        self._metrics.limiter_latency.observe(time.perf_counter() - started)
        for lp, status in zip(plan.limits, decision.statuses):
            lp.decisions(status.outcome).inc()
        return decision

    async def _forward(
        self,
        request: web.BaseRequest,
        plan: RoutePlan,
        url: URL,
        headers: CIMultiDict[str],
        limit_headers: dict[str, str],
        body: _Body,
        record: AccessRecord,
    ) -> web.StreamResponse:
        session = self._sessions[plan.upstream]
        sent = time.perf_counter()
        try:
            async with session.request(
                request.method,
                url,
                headers=headers,
                data=body,
                allow_redirects=False,
                timeout=plan.timeout,
                compress=None,
            ) as upstream:
                latency = time.perf_counter() - sent
                plan.upstream_latency().observe(latency)
                record.upstream_status, record.upstream_ms = upstream.status, round(latency * 1000, 3)
                # A small upstream answer usually arrives in one read, body and end included.
                arrived = upstream.content.is_eof()
                response = (_ArrivedResponse if arrived else web.StreamResponse)(
                    status=upstream.status, reason=upstream.reason
                )
                response.headers.extend(end_to_end(upstream.headers))
                response.headers.update(limit_headers)
                response.headers["X-Request-ID"] = record.request_id
                await response.prepare(request)
                try:
                    if arrived:
                        await response.write_eof(await upstream.content.read())
                        return response
                    async for chunk in upstream.content.iter_chunked(STREAM_CHUNK_BYTES):
                        await response.write(chunk)
                except ConnectionResetError:
                    return response  # the client went away; closing the upstream response frees it
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    # The status line is gone; all that is left is to cut the connection.
                    log.warning("upstream %s failed mid-response: %s", plan.upstream, exc or type(exc).__name__)
                    if request.transport is not None:
                        request.transport.close()
                    return response
                await response.write_eof()
                return response
        # Every response on a limited route carries the RateLimit fields, errors included.
        except asyncio.TimeoutError:
            stalled = request.content.exception()
            if isinstance(stalled, ClientLimitExceeded):
                return stalled.response()
            return problem_response(504, plan.upstream_timeout, headers=limit_headers)
        # The client learns what failed, never where: the upstream's address stays in the log.
        except aiohttp.ClientConnectorError as exc:
            log.warning("cannot connect to upstream %s: %s", plan.upstream, exc.os_error.strerror or exc)
            return problem(502, "Bad Gateway", "Cannot connect to the upstream.", headers=limit_headers)
        except aiohttp.ClientError as exc:
            stalled = request.content.exception()
            if isinstance(stalled, ClientLimitExceeded):
                return stalled.response()  # the client's body stalled (client_body_timeout), not the upstream
            log.warning("upstream %s failed: %s: %s", plan.upstream, type(exc).__name__, exc)
            return problem(502, "Bad Gateway", "The upstream failed.", headers=limit_headers)


class _ArrivedResponse(web.StreamResponse):
    """For an upstream response whose body has already arrived whole: its status line and
    headers wait for that body and leave with it in one write, as aiohttp's own Response
    does, instead of a write each. The client waits for nothing, since nothing is left to
    wait for; a body still arriving streams through StreamResponse, headers first."""

    _send_headers_immediately = False  # aiohttp's switch, False in its Response class


async def _expectation(request: web.BaseRequest) -> web.Response | None:
    """Answer `Expect` as aiohttp's router did before the handler ran: `100-continue` gets
    its interim response, so the client sends the body; any other expectation gets 417
    (RFC 9110 §10.1.1). HTTP/1.0 has no interim responses, so there it is ignored."""
    if request.version != HttpVersion11:
        return None
    expect = request.headers["Expect"]
    if expect.lower() != "100-continue":
        return problem(417, "Expectation Failed", "Only the expectation 100-continue is understood.")
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # the interim response is not part of the response's size
    await request.writer.drain()
    return None


def _body_too_large(plan: RoutePlan, headers: dict[str, str] | None = None) -> web.Response:
    response = problem_response(413, plan.body_too_large, headers=headers)
    response.force_close()  # the rest of the body is never read
    return response


async def _read_ahead(content: aiohttp.StreamReader, limit: int, *, cap: bool) -> _Body:
    """Read the body until it ends or passes `limit` bytes. A body that ended is returned
    whole. Past the limit: None with `cap` (a body too large), or else the bytes read so far
    followed by the rest as it streams in."""
    parts: list[bytes] = []
    size = 0
    while size <= limit:
        chunk = await content.readany()
        if not chunk:
            return b"".join(parts)
        size += len(chunk)
        parts.append(chunk)
    return None if cap else _stream_on(parts, content)


async def _stream_on(parts: list[bytes], content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    for part in parts:
        yield part
    parts.clear()
    async for chunk in content.iter_chunked(STREAM_CHUNK_BYTES):
        yield chunk


def _rejection(plan: RoutePlan, decision: Decision, limit_headers: dict[str, str]) -> web.Response:
    if decision.store_failed:
        names = tuple(s.limit.name for s in decision.statuses if s.outcome == FAIL_CLOSED and not s.limit.shadow)
        return problem_response(503, plan.rejection(503, names).body(), headers=_RETRY_AFTER_ONE)
    denied = tuple(s.limit.name for s in decision.statuses if s.outcome in (DENY, FAIL_LOCAL) and not s.limit.shadow)
    retry_after = str(retry_after_seconds(decision.retry_after))
    return problem_response(
        429, plan.rejection(429, denied).body(retry_after), headers={**limit_headers, "Retry-After": retry_after}
    )


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


def _upstream_url(request: web.BaseRequest, plan: RoutePlan, path: NormalPath) -> URL:
    """The route's upstream, the path as it was matched (less the prefix with strip_prefix),
    and the query as received."""
    forward = path.forward if plan.strip is None else plan.strip.rest(path.forward)
    query = request.rel_url.raw_query_string
    return URL(plan.upstream + forward + ("?" + query if query else ""), encoded=True)


def _forward_headers(request: web.BaseRequest, plan: RoutePlan, plans: Plans) -> CIMultiDict[str]:
    headers = end_to_end(request.headers, GATEWAY_WRITTEN)
    original_host = request.headers.get("Host", "")
    if not plan.preserve_host:
        headers.popall("Host", None)
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


def _request_host(request: web.BaseRequest) -> str:
    """The Host header as routes match it: lower case, without its port, and without the
    trailing dot of a fully qualified name, which names the same host (`api.example.com.`)."""
    host = request.headers.get("Host", "").lower()
    if host.startswith("["):
        return host.partition("]")[0] + "]"
    host = host.rpartition(":")[0] if ":" in host else host
    return host[:-1] if host.endswith(".") else host
