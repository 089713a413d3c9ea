"""The request path: route, rate-limit, then proxy (or answer 404/429/503).

Knows nothing of Redis: it asks `Limiter.check` for a decision. Trusts the
config; trusts nothing in the request. The upstream contacted always comes
from the matched route, never from the request target or the Host header.
Bodies stream both ways in chunks and are never held whole. aiohttp client
errors are translated here: a refused or failed upstream is 502, a slow one 504.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
from aiohttp import web
from aiohttp.http import HttpVersion11
from multidict import CIMultiDict
from yarl import URL

from gateway.config.model import GatewayConfig, Route
from gateway.limiter.limiter import UNLIMITED, Decision, Limiter
from gateway.limiter.store import LimitCheck
from gateway.metrics import UNMATCHED_ROUTE, Metrics, method_label
from gateway.proxy.client_identity import ClientIdentity
from gateway.proxy.headers import add_forwarded, end_to_end
from gateway.proxy.problem import problem
from gateway.proxy.ratelimit_headers import ratelimit_headers, retry_after_seconds
from gateway.proxy.routing import Router, normalize_path
from gateway.proxy.websocket import is_websocket_upgrade, proxy_websocket

log = logging.getLogger(__name__)

# Big enough to keep syscalls few, small enough that many streams stay within a
# modest RSS: 1000 concurrent streams hold at most ~64 MB of chunks.
STREAM_CHUNK_BYTES = 64 * 1024
# Connections kept per upstream; aiohttp's default of 100 queues the rest.
UPSTREAM_CONNECTION_LIMIT = 1000


class ProxyHandler:
    def __init__(self, config: GatewayConfig, limiter: Limiter, metrics: Metrics) -> None:
        self._router = Router(config.routes)
        self._identity = ClientIdentity(config.trusted_proxies)
        self._limiter = limiter
        self._metrics = metrics
        self._upstreams = sorted({route.upstream for route in config.routes})
        self._sessions: dict[str, aiohttp.ClientSession] = {}

    async def start(self) -> None:
        for upstream in self._upstreams:
            self._sessions[upstream] = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=UPSTREAM_CONNECTION_LIMIT, ttl_dns_cache=60),
                auto_decompress=False,
                cookie_jar=aiohttp.DummyCookieJar(),
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
                trust_env=False,
                timeout=aiohttp.ClientTimeout(total=None),
            )

    async def close(self) -> None:
        for session in self._sessions.values():
            await session.close()
        self._sessions.clear()

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        """Every request on the public listener comes here, whatever its target."""
        self._metrics.in_flight.inc()
        route: Route | None = None
        response: web.StreamResponse | None = None
        try:
            if "Expect" in request.headers:
                response = await _expectation(request)
                if response is not None:
                    return response
            if request.method == "CONNECT" or not request.path.startswith("/"):
                # Authority-form (CONNECT host:port) and asterisk-form (OPTIONS *) targets
                # name no resource of ours: this is a reverse proxy, never a tunnel.
                response = problem(400, "Bad Request", "Only origin-form request targets such as /path are served.")
                return response
            route = self._router.find(request.method, _request_host(request), normalize_path(request.path))
            if route is None:
                response = problem(404, "Not Found", "No route matches this request.")
                return response
            response = await self._limited(request, route)
            return response
        finally:
            self._metrics.in_flight.dec()
            status = response.status if response is not None else 500
            self._metrics.requests.labels(
                route=route.label if route else UNMATCHED_ROUTE,
                method=method_label(request.method),
                status_class=f"{status // 100}xx",
            ).inc()

    async def _limited(self, request: web.BaseRequest, route: Route) -> web.StreamResponse:
        decision = await self._decide(request, route)
        limit_headers = ratelimit_headers(decision.statuses)
        if not decision.allowed:
            return self._rejection(decision, limit_headers)
        if is_websocket_upgrade(request):
            return await proxy_websocket(
                request,
                self._sessions[route.upstream],
                self._upstream_url(request, route),
                self._forward_headers(request, route),
                limit_headers,
            )
        return await self._forward(request, route, limit_headers)

    async def _decide(self, request: web.BaseRequest, route: Route) -> Decision:
        if not route.limits:
            return UNLIMITED
        started = time.perf_counter()
        client_ip = self._identity.client_ip(request)
        checks = [
            LimitCheck(limit=rl.limit, identity=self._identity.identity(request, rl.limit.key, client_ip), cost=rl.cost)
            for rl in route.limits
        ]
        decision = await self._limiter.check(checks)
        self._metrics.limiter_latency.observe(time.perf_counter() - started)
        for status in decision.statuses:
            self._metrics.decisions.labels(route=route.label, limit=status.limit.name, decision=status.outcome).inc()
        return decision

    @staticmethod
    def _rejection(decision: Decision, limit_headers: dict[str, str]) -> web.Response:
        if decision.store_failed:
            names = [s.limit.name for s in decision.statuses if s.outcome == "fail_closed"]
            return problem(
                503,
                "Service Unavailable",
                "The rate-limit store is unavailable and this limit fails closed.",
                headers={"Retry-After": "1"},
                limits=names,
            )
        denied = [s.limit.name for s in decision.statuses if s.outcome in ("deny", "fail_local")]
        retry_after = retry_after_seconds(decision.retry_after)
        return problem(
            429,
            "Too Many Requests",
            f"Rate limit {', '.join(repr(n) for n in denied)} exceeded; retry in {retry_after} s.",
            headers={**limit_headers, "Retry-After": str(retry_after)},
            limits=denied,
        )

    def _upstream_url(self, request: web.BaseRequest, route: Route) -> URL:
        raw_path = request.rel_url.raw_path
        if route.strip_prefix and route.match.path != "/":
            raw_path = _strip_prefix(raw_path, request.path, route.match.path)
        query = request.rel_url.raw_query_string
        return URL(route.upstream + raw_path + (f"?{query}" if query else ""), encoded=True)

    def _forward_headers(self, request: web.BaseRequest, route: Route) -> CIMultiDict[str]:
        headers = end_to_end(request.headers)
        original_host = request.headers.get("Host", "")
        if not route.preserve_host:
            headers.popall("Host", None)
        add_forwarded(headers, peer=request.remote or "", proto=request.scheme, host=original_host)
        return headers

    async def _forward(self, request: web.BaseRequest, route: Route, limit_headers: dict[str, str]) -> web.StreamResponse:
        session = self._sessions[route.upstream]
        headers = self._forward_headers(request, route)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=route.timeout.connect, sock_read=route.timeout.read)
        sent = time.perf_counter()
        try:
            async with session.request(
                request.method,
                self._upstream_url(request, route),
                headers=headers,
                data=request.content if request.body_exists else None,
                allow_redirects=False,
                timeout=timeout,
                compress=None,
            ) as upstream:
                self._metrics.upstream_latency.labels(route=route.label).observe(time.perf_counter() - sent)
                response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
                response.headers.extend(end_to_end(upstream.headers))
                response.headers.update(limit_headers)
                await response.prepare(request)
                try:
                    async for chunk in upstream.content.iter_chunked(STREAM_CHUNK_BYTES):
                        await response.write(chunk)
                except ConnectionResetError:
                    return response  # the client went away; closing the upstream response frees it
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    # The status line is gone; all that is left is to cut the connection.
                    log.warning("upstream %s failed mid-response: %s", route.upstream, exc or type(exc).__name__)
                    if request.transport is not None:
                        request.transport.close()
                    return response
                await response.write_eof()
                return response
        # Every response on a limited route carries the RateLimit fields, errors included.
        except asyncio.TimeoutError:
            return problem(
                504,
                "Gateway Timeout",
                f"The upstream did not answer in time (connect {route.timeout.connect:g} s, read {route.timeout.read:g} s).",
                headers=limit_headers,
            )
        except aiohttp.ClientConnectorError as exc:
            return problem(
                502, "Bad Gateway", f"Cannot connect to the upstream: {exc.os_error.strerror or exc}.", headers=limit_headers
            )
        except aiohttp.ClientError as exc:
            return problem(502, "Bad Gateway", f"The upstream failed: {type(exc).__name__}.", headers=limit_headers)


async def _expectation(request: web.BaseRequest) -> web.Response | None:
    """Answer `Expect` as aiohttp's router did before the handler ran: `100-continue` gets
    its interim response, so the client sends the body; any other expectation gets 417
    (RFC 9110 §10.1.1). HTTP/1.0 has no interim responses, so there it is ignored."""
    if request.version != HttpVersion11:
        return None
    expect = request.headers["Expect"]
    if expect.lower() != "100-continue":
        return problem(417, "Expectation Failed", f"Only 100-continue is understood, not {expect!r}.")
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # the interim response is not part of the response's size
    await request.writer.drain()
    return None


def _strip_prefix(raw_path: str, path: str, prefix: str) -> str:
    """The raw path after the route's `prefix`. When the decoded `path` is already normal,
    the rest keeps the client's own encoding, so an encoded slash (`group%2Fproject`)
    stays inside its segment; otherwise the rest is rebuilt from the normalised path."""
    raw_prefix = URL.build(path=prefix).raw_path
    if normalize_path(path) == path and (raw_path == raw_prefix or raw_path.startswith(raw_prefix + "/")):
        return raw_path[len(raw_prefix) :] or "/"
    rest = normalize_path(path)[len(prefix) :]
    return URL.build(path=rest if rest.startswith("/") else "/" + rest).raw_path


def _request_host(request: web.BaseRequest) -> str:
    """The Host header as routes match it: lower case, without its port, and without the
    trailing dot of a fully qualified name, which names the same host (`api.example.com.`)."""
    host = request.headers.get("Host", "").lower()
    if host.startswith("["):
        return host.partition("]")[0] + "]"
    host = host.rpartition(":")[0] if ":" in host else host
    return host[:-1] if host.endswith(".") else host
