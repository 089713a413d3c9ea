"""A client that hangs up: its request is logged and counted as 499, never
as a 5xx, and its upstream request is cancelled at once instead of run to completion.
Every request a client abandoned is still decided and counted exactly once.

The gateway runs as users run it (`gateway run --access-log json`); the upstream is
a real aiohttp server that notices when the gateway abandons a request (aiohttp's
`handler_cancellation` cancels its handler when the connection closes)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import time
from urllib.parse import urlsplit

import aiohttp
import pytest
from aiohttp import web

from tests.processes import GatewayProcess, eventually
from tests.scrape import decisions, scrape, value

pytestmark = pytest.mark.timing  # measures time, load or memory: one such module runs at a time

UPSTREAM_HOLD_SECONDS = 20.0  # far longer than any test waits: finishing it would fail the test


class NoticingUpstream:
    """/slow holds its answer; /stream sends its headers and one chunk, then holds the
    rest. Each records whether it ran to the end or was cancelled by the gateway's hangup."""

    def __init__(self) -> None:
        self.started = 0
        self.cancelled = 0
        self.finished = 0

    async def _held(self, respond) -> web.StreamResponse:
        self.started += 1
        try:
            response = await respond()
            self.finished += 1
            return response
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def slow(self, _: web.Request) -> web.StreamResponse:
        async def respond() -> web.Response:
            await asyncio.sleep(UPSTREAM_HOLD_SECONDS)
            return web.Response(text="late")

        return await self._held(respond)

    async def stream(self, request: web.Request) -> web.StreamResponse:
        async def respond() -> web.StreamResponse:
            response = web.StreamResponse()
            await response.prepare(request)
            await response.write(b"first chunk\n")
            await asyncio.sleep(UPSTREAM_HOLD_SECONDS)
            await response.write_eof(b"rest\n")
            return response

        return await self._held(respond)

    async def fast(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")


@contextlib.asynccontextmanager
async def noticing_upstream():
    upstream = NoticingUpstream()
    app = web.Application()
    app.router.add_get("/slow", upstream.slow)
    app.router.add_get("/stream", upstream.stream)
    app.router.add_get("/fast", upstream.fast)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield upstream, f"http://{host}:{port}"
    finally:
        await runner.cleanup()


def config(upstream: str, store: str = "") -> str:
    return f"""
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
{store}
limits:
  per_key: {{rate: 1/hour, burst: 50, key: header:X-API-Key}}
routes:
  - match: {{path: /}}
    upstream: {upstream}
    limits: [per_key]
"""


async def hang_up_after(url: str, path: str, ready) -> None:
    """Send GET `path` on a connection of its own, wait until `ready()`, then close it."""
    parts = urlsplit(url)
    _reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: api\r\nX-API-Key: k\r\n\r\n".encode())
    await writer.drain()
    await eventually(ready, what="the upstream to have the request")
    writer.close()
    await writer.wait_closed()


def access_lines(gw: GatewayProcess) -> list[dict]:
    return [json.loads(line) for line in gw.stdout_lines if line.startswith("{")]


async def test_a_client_hanging_up_cancels_the_upstream_request_and_is_logged_as_499():
    async with noticing_upstream() as (upstream, upstream_url), aiohttp.ClientSession() as http:
        with GatewayProcess(config(upstream_url), args=("--access-log", "json")) as gw:
            await hang_up_after(gw.url, "/slow", lambda: upstream.started == 1)
            hung_up = time.monotonic()
            await eventually(lambda: upstream.cancelled == 1, what="the upstream request to be cancelled")
            cancelled_within = time.monotonic() - hung_up

            await eventually(lambda: len(access_lines(gw)) == 1, what="the access line")
            _, samples = await scrape(http, gw.admin_url)
            line = access_lines(gw)[0]
            assert line["status"] == 499
            assert line["decision"] == "allow"
            assert value(samples, "gateway_client_closed_requests_total", route="/") == 1
            assert value(samples, "gateway_requests_total", route="/", method="GET", status_class="4xx") == 1
            assert not [s for s in samples if s.name == "gateway_requests_total" and s.labels.get("status_class") == "5xx"]
            # A second client on the same connection pool is served as usual.
            async with http.get(gw.url + "/fast", headers={"X-API-Key": "k"}) as response:
                assert response.status == 200
        assert upstream.finished == 0  # /slow never ran to its end
        assert cancelled_within < UPSTREAM_HOLD_SECONDS / 4, cancelled_within
        assert "Traceback" not in "".join(gw.stderr_lines)


async def test_a_client_hanging_up_mid_response_is_logged_with_the_status_it_was_sent():
    async with noticing_upstream() as (upstream, upstream_url), aiohttp.ClientSession() as http:
        with GatewayProcess(config(upstream_url), args=("--access-log", "json")) as gw:
            parts = urlsplit(gw.url)
            reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
            writer.write(b"GET /stream HTTP/1.1\r\nHost: api\r\nX-API-Key: k\r\n\r\n")
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200")
            writer.close()
            await writer.wait_closed()
            await eventually(lambda: upstream.cancelled == 1, what="the upstream stream to be cancelled")
            await eventually(lambda: len(access_lines(gw)) == 1, what="the access line")
            _, samples = await scrape(http, gw.admin_url)
            assert access_lines(gw)[0]["status"] == 200
            assert value(samples, "gateway_requests_total", route="/", method="GET", status_class="2xx") == 1
            assert not [s for s in samples if s.name == "gateway_client_closed_requests_total" and s.value]
        assert upstream.finished == 0
        assert "Traceback" not in "".join(gw.stderr_lines)


async def test_clients_hanging_up_under_load_are_each_decided_and_counted_once(dedicated_redis):
    """200 concurrent clients send and hang up at once, at the default store timeout: the
    bucket is charged exactly for the requests counted allowed, and every request is
    counted once, as allowed or limited. The old handler cancellation broke this: a
    request cancelled inside the limiter's check was charged and never counted."""
    store = f"store: {{url: '{dedicated_redis.url}'}}"
    clients = 200
    async with noticing_upstream() as (upstream, upstream_url), aiohttp.ClientSession() as http:
        with GatewayProcess(config(upstream_url, store), args=("--access-log", "json")) as gw:
            parts = urlsplit(gw.url)

            async def send_and_hang_up() -> None:
                _, writer = await asyncio.open_connection(parts.hostname, parts.port)
                writer.write(b"GET /slow HTTP/1.1\r\nHost: api\r\nX-API-Key: shared\r\n\r\n")
                await writer.drain()
                writer.close()
                await writer.wait_closed()

            await asyncio.gather(*(send_and_hang_up() for _ in range(clients)))
            await eventually(lambda: len(access_lines(gw)) == clients, what="an access line per request")
            counted = await decisions(http, gw.admin_url)
            decided = {outcome: counted["per_key", outcome] for outcome in ("allow", "deny", "fail_open")}
            statuses = collections.Counter(line["status"] for line in access_lines(gw))
            redis = dedicated_redis.client()
            (bucket,) = [key for key in redis.scan_iter("rl:*") if redis.type(key) == "hash"]
            tokens = redis.hget(bucket, "tokens")
        assert decided["fail_open"] == 0
        assert decided["allow"] + decided["deny"] == clients
        assert decided["allow"] == 50  # exactly the burst, each one charged and counted
        assert float(tokens) < 1  # and the bucket was charged for exactly those 50
        assert statuses == {499: 50, 429: 150}  # the allowed hung up before their answer: none is a 5xx
        assert upstream.finished == 0
        assert "Traceback" not in "".join(gw.stderr_lines)
