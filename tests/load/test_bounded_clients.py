"""Bounded clients: what one client connection may hold of the gateway.

Each reproduction of the original report, scaled down so it runs in seconds: timeouts are
configured short (0.3-0.5 s) and each test asserts the connection ends within a
bound, with 408 problem+json where a request had begun. Slow and unfinished
clients are raw sockets; the gateway and the upstream are real.

- An idle, unfinished head lasted over 100 s (nginx: 60 s): client_header_timeout.
- 126 headers of 8 KB (~1 MB) were accepted and forwarded: max_header_size, 431.
  (300 such unfinished heads took RSS from 232 MB to 649 MB: see tests/gateway/test_header_memory.py.)
- 1,000 chunked POSTs at one byte every 5 s took all 1,000 upstream connections
  and every other route on that upstream stopped answering: client_body_timeout
  and a bounded wait for an upstream connection (503, counted as
  gateway_upstream_unavailable_total{reason="queue_full"}).
- max_body_size per route, 413 before the upstream is contacted.
- A per-connection request cap (keepalive_requests).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import aiohttp
import pytest
from aiohttp import web
from yarl import URL

from gateway.testing import running_gateway
from tests.processes import eventually
from tests.scrape import scrape, value
from tests.upstream import RecordingUpstream

pytestmark = pytest.mark.timing  # measures time, load or memory: one such module runs at a time

# How late a timeout may fire and its close reach the test, on a busy 2-core machine.
SLACK = 2.0
GET = b"GET /echo HTTP/1.1\r\nHost: gateway.test\r\n\r\n"


def _config(upstream: str, top: str = "", route: str = "") -> str:
    return f"""
{top}
routes:
  - match: {{path: /}}
    upstream: {upstream}
    {route}
"""


@contextlib.asynccontextmanager
async def _connection(url: str):
    target = URL(url)
    reader, writer = await asyncio.open_connection(target.host, target.port)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def _read_until_closed(reader: asyncio.StreamReader, deadline: float) -> tuple[bytes, float]:
    """Everything the gateway sends until it closes the connection, and the seconds that took.
    Fails if the connection is still open after `deadline` seconds."""
    started = time.monotonic()
    data = bytearray()
    while True:
        try:
            chunk = await asyncio.wait_for(reader.read(65536), deadline - (time.monotonic() - started))
        except ConnectionResetError:
            break
        except TimeoutError:
            raise AssertionError(f"the connection was still open after {deadline} s; got {bytes(data[:200])!r}") from None
        if not chunk:
            break
        data += chunk
    return bytes(data), time.monotonic() - started


def _responses(data: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """The responses in `data`, each with a Content-Length body (as problem+json and the echo have)."""
    out = []
    while data:
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {n.strip().lower(): v.strip() for n, _, v in (line.partition(":") for line in lines[1:])}
        length = int(headers.get("content-length", "0"))
        out.append((int(lines[0].split()[1]), headers, rest[:length]))
        data = rest[length:]
    return out


def _problem(response: tuple[int, dict[str, str], bytes], status: int) -> dict:
    code, headers, body = response
    assert code == status
    assert headers["content-type"].startswith("application/problem+json")
    assert headers.get("connection", "").lower() == "close"
    problem = json.loads(body)
    assert problem["status"] == status
    return problem


# --- client_header_timeout and keepalive_timeout --------------------------------


async def _408_after_300ms(upstream: str, setting: str, sent: bytes) -> None:
    """`sent` and then nothing, against a 300 ms `setting`: a 408 naming 0.3 s, and the
    connection closed no sooner."""
    async with running_gateway(_config(upstream, setting)) as gw:
        async with _connection(gw.url) as (reader, writer):
            writer.write(sent)
            data, elapsed = await _read_until_closed(reader, 0.3 + SLACK)
    assert elapsed >= 0.25
    (response,) = _responses(data)
    problem = _problem(response, 408)
    assert "0.3 s" in problem["detail"]


async def test_an_unfinished_head_gets_408_and_is_closed_at_client_header_timeout(upstream):
    await _408_after_300ms(upstream, "client_header_timeout: 300ms", b"GET /echo HTTP/1.1\r\nHost: gateway.test\r\nX-Half: ")


async def test_a_head_sent_a_byte_at_a_time_is_timed_from_its_first_byte_not_between_bytes(upstream):
    """The slow loris keeps every read within the timeout; its head still has to end in time."""
    head = b"GET /echo HTTP/1.1\r\nHost: gateway.test\r\n" + b"X-Slow: " + b"a" * 200 + b"\r\n\r\n"
    async with running_gateway(_config(upstream, "client_header_timeout: 500ms")) as gw:
        async with _connection(gw.url) as (reader, writer):
            closed = asyncio.ensure_future(_read_until_closed(reader, 0.5 + SLACK))
            sent = 0
            for byte in head:
                if closed.done():
                    break
                writer.write(bytes([byte]))
                sent += 1
                await asyncio.sleep(0.05)  # the client's pace, 10 times within the timeout
            data, _ = await closed
    assert sent < len(head)  # cut off mid-head, though no gap between its bytes came near the timeout
    (response,) = _responses(data)
    _problem(response, 408)


async def test_a_connection_that_sends_nothing_is_closed_silently_at_client_header_timeout(upstream):
    async with running_gateway(_config(upstream, "client_header_timeout: 300ms\nkeepalive_timeout: 1h")) as gw:
        async with _connection(gw.url) as (reader, _):
            data, elapsed = await _read_until_closed(reader, 0.3 + SLACK)
    assert data == b""
    assert elapsed >= 0.25


async def test_an_idle_connection_between_requests_is_closed_at_keepalive_timeout_not_header_timeout(upstream):
    top = "client_header_timeout: 300ms\nkeepalive_timeout: 1500ms"
    async with running_gateway(_config(upstream, top)) as gw:
        async with _connection(gw.url) as (reader, writer):
            writer.write(GET)
            first = await reader.readuntil(b"}")  # the echo's JSON body
            assert first.startswith(b"HTTP/1.1 200")
            data, elapsed = await _read_until_closed(reader, 1.5 + SLACK)
    assert data == b""  # an idle connection just closes
    assert elapsed >= 1.2  # not the head's 0.3 s: no head had begun


async def test_a_keepalive_connection_serves_requests_after_an_idle_gap_shorter_than_keepalive_timeout(upstream):
    async with running_gateway(_config(upstream, "client_header_timeout: 300ms\nkeepalive_timeout: 5s")) as gw:
        async with _connection(gw.url) as (reader, writer):
            for _ in range(3):
                writer.write(GET)
                assert (await reader.readuntil(b"}")).startswith(b"HTTP/1.1 200")
                await asyncio.sleep(0.5)  # idle longer than the head timeout, shorter than keep-alive
            writer.write(GET)
            assert (await reader.readuntil(b"}")).startswith(b"HTTP/1.1 200")


async def test_heads_refused_for_their_size_or_time_are_counted_and_carry_no_server_banner(upstream, client):
    async with running_gateway(_config(upstream, "client_header_timeout: 300ms\nmax_header_size: 16KiB")) as gw:
        for request in (_big_head(3, 8000), b"GET /echo HTTP/1.1\r\nHost: gateway.test\r\n"):
            async with _connection(gw.url) as (reader, writer):
                writer.write(request)
                data, _ = await _read_until_closed(reader, 0.3 + SLACK)
            ((status, headers, _),) = _responses(data)
            assert status in (431, 408)
            assert "server" not in headers
        _, samples = await scrape(client, gw.admin_url)
    assert value(samples, "gateway_requests_total", route="unmatched", method="OTHER", status_class="4xx") == 2


# --- max_header_size --------------------------------------------------------------


def _big_head(lines: int, size: int, *, finished: bool = True) -> bytes:
    head = b"GET /echo HTTP/1.1\r\nHost: gateway.test\r\n" + b"".join(
        b"X-Big-%d: " % i + b"v" * size + b"\r\n" for i in range(lines)
    )
    return head + (b"Connection: close\r\n\r\n" if finished else b"")


async def test_the_issue_s_126_headers_of_8_kb_get_431_not_forwarded(upstream):
    async with running_gateway(_config(upstream)) as gw:  # the default cap, 32 KiB
        async with _connection(gw.url) as (reader, writer):
            writer.write(_big_head(126, 8000))
            data, _ = await _read_until_closed(reader, SLACK * 2)
    (response,) = _responses(data)
    problem = _problem(response, 431)
    assert "32768 bytes" in problem["detail"]


async def test_an_unfinished_head_past_the_cap_gets_431_before_it_ends(upstream):
    async with running_gateway(_config(upstream, "max_header_size: 16KiB")) as gw:
        async with _connection(gw.url) as (reader, writer):
            writer.write(_big_head(4, 8000, finished=False))  # 32 KB, and never finished
            data, _ = await _read_until_closed(reader, SLACK)
    (response,) = _responses(data)
    _problem(response, 431)


@pytest.mark.parametrize("lines, status", [(3, 200), (5, 431)])
async def test_heads_under_the_cap_pass_and_over_it_do_not(upstream, lines, status):
    """max_header_size 40000: three 8 KB lines (~24 KB) pass whole, five (~40 KB and more) do not."""
    async with running_gateway(_config(upstream, "max_header_size: 40000")) as gw:
        async with _connection(gw.url) as (reader, writer):
            writer.write(_big_head(lines, 8000))
            data, _ = await _read_until_closed(reader, SLACK * 2)
    ((code, _, body),) = _responses(data)
    assert code == status
    if status == 200:
        echo = json.loads(body)
        assert [v for n, v in echo["headers"] if n == "X-Big-2"] == ["v" * 8000]


async def test_a_pipelined_head_past_the_cap_behind_a_small_request_gets_431_after_its_answer(upstream):
    """The second head shares a read with the first: it is measured exactly, not by the read."""
    async with running_gateway(_config(upstream, "max_header_size: 16KiB")) as gw:
        async with _connection(gw.url) as (reader, writer):
            writer.write(GET + _big_head(3, 8000))
            data, _ = await _read_until_closed(reader, SLACK * 2)
    first, second = _responses(data)
    assert first[0] == 200
    _problem(second, 431)


async def test_a_head_that_begins_in_the_read_that_ends_a_body_is_measured_too(upstream):
    body = b"x" * 100
    post = b"POST /echo HTTP/1.1\r\nHost: gateway.test\r\nContent-Length: 100\r\n\r\n"
    async with running_gateway(_config(upstream, "max_header_size: 16KiB")) as gw:
        async with _connection(gw.url) as (reader, writer):
            writer.write(post + body[:50])
            await writer.drain()
            writer.write(body[50:] + _big_head(3, 8000))
            data, _ = await _read_until_closed(reader, SLACK * 2)
    first, second = _responses(data)
    assert first[0] == 200
    assert json.loads(first[2])["body_length"] == 100
    _problem(second, 431)


async def test_websocket_traffic_past_the_header_cap_is_not_a_head(upstream, client):
    async with running_gateway(_config(upstream, "max_header_size: 16KiB")) as gw:
        async with client.ws_connect(gw.url + "/ws", protocols=("chat",)) as ws:
            for _ in range(4):
                payload = bytes(range(256)) * 200  # 51 KB a message
                await ws.send_bytes(payload)
                assert (await ws.receive()).data == payload[::-1]


# --- client_body_timeout ----------------------------------------------------------


@pytest.mark.parametrize(
    "head, first_piece",
    [
        (b"Content-Length: 10\r\n", b"ab"),
        (b"Transfer-Encoding: chunked\r\n", b"2\r\nab\r\n"),
    ],
    ids=["content-length", "chunked"],
)
async def test_a_stalled_body_gets_408_at_client_body_timeout(upstream, head, first_piece):
    request = b"POST /sink HTTP/1.1\r\nHost: gateway.test\r\n" + head + b"\r\n" + first_piece
    await _408_after_300ms(upstream, "client_body_timeout: 300ms", request)


async def test_the_body_timeout_is_measured_between_reads_not_over_the_whole_body(upstream):
    """Ten pieces, 0.1 s apart, take a second in all against a 0.4 s timeout: the body arrives whole."""
    pieces = [b"%d\r\n" % 1 + bytes([65 + i]) + b"\r\n" for i in range(10)]
    async with running_gateway(_config(upstream, "client_body_timeout: 400ms")) as gw:
        async with _connection(gw.url) as (reader, writer):
            writer.write(b"POST /echo HTTP/1.1\r\nHost: gateway.test\r\nTransfer-Encoding: chunked\r\n\r\n")
            for piece in pieces:
                writer.write(piece)
                await asyncio.sleep(0.1)  # the client's pace
            writer.write(b"0\r\n\r\n")
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
            echo = json.loads(await reader.readuntil(b"}"))
    assert echo["body"] == "ABCDEFGHIJ"


# --- a bounded wait for an upstream connection -------------------------------------


SLOW_CHUNKED = b"POST /sink HTTP/1.1\r\nHost: gateway.test\r\nTransfer-Encoding: chunked\r\n\r\n"


def _two_routes(upstream: str, top: str) -> str:
    return f"""
{top}
routes:
  - match: {{path: /sink}}
    upstream: {upstream}
  - match: {{path: /}}
    upstream: {upstream}
    timeout: {{queue: 300ms}}
"""


async def test_slow_bodies_hold_no_upstream_connection_while_they_trickle(counting_upstream):
    """The reported 1,000 chunked POSTs at one byte every 5 s took all 1,000 upstream connections.
    Here 4 such bodies against 2 connections: a body still arriving is read ahead before an
    upstream connection is taken, so the upstream never hears of them, and another route on
    it answers at once. A slow body that does end is forwarded whole."""
    counter, url = counting_upstream
    async with running_gateway(_two_routes(url, "upstream_connections: 2")) as gw:
        async with contextlib.AsyncExitStack() as stack:
            slow = [await stack.enter_async_context(_connection(gw.url)) for _ in range(4)]
            for _, writer in slow:
                writer.write(SLOW_CHUNKED + b"1\r\nx\r\n")
            async with aiohttp.ClientSession() as client:
                for _ in range(5):
                    async with client.get(gw.url + "/other", timeout=aiohttp.ClientTimeout(total=SLACK)) as response:
                        assert response.status == 200
            assert counter.requests == 5  # the slow bodies have not reached the upstream
            reader, writer = slow[0]
            writer.write(b"2\r\nyz\r\n0\r\n\r\n")
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
            assert json.loads(await reader.readuntil(b"}"))["body"] == "xyz"


async def test_large_slow_bodies_holding_every_upstream_connection_leave_a_503_then_time_out(upstream):
    """Bodies past the read ahead (64 KiB) stream, holding a connection while they do: another
    route on that upstream then answers 503 within timeout.queue instead of hanging, and once
    client_body_timeout ends the stalled bodies, it is served again."""
    config = _two_routes(upstream, "upstream_connections: 2\nclient_body_timeout: 1500ms")
    piece = b"%x\r\n" % 70000 + b"x" * 70000 + b"\r\n"
    async with running_gateway(config) as gw, aiohttp.ClientSession() as client:
        async with _connection(gw.url) as (r1, w1), _connection(gw.url) as (r2, w2):
            w1.write(SLOW_CHUNKED + piece)
            w2.write(SLOW_CHUNKED + piece)

            async def other_route() -> tuple[int, float]:
                started = time.monotonic()
                async with client.get(gw.url + "/echo", timeout=aiohttp.ClientTimeout(total=10)) as response:
                    await response.read()
                    return response.status, time.monotonic() - started

            results: list[tuple[int, float]] = []

            async def refused() -> bool:
                results.append(await other_route())
                return results[-1][0] == 503

            await eventually(refused, what="the slow bodies to hold both upstream connections", deadline=1.2)
            assert results[-1][1] < 0.3 + SLACK
            # The stalled bodies end at client_body_timeout with 408; the upstream is free again.
            for reader in (r1, r2):
                data, _ = await _read_until_closed(reader, 1.5 + SLACK)
                _problem(_responses(data)[0], 408)
            assert (await other_route())[0] == 200


async def test_the_queue_503_is_problem_json_with_retry_after_and_comes_at_timeout_queue(upstream, client):
    config = f"""
upstream_connections: 1
routes:
  - match: {{path: /}}
    upstream: {upstream}
    timeout: {{queue: 200ms}}
"""
    async with running_gateway(config) as gw:
        held = asyncio.ensure_future(client.get(gw.url + "/held"))
        try:

            async def arrived() -> bool:  # asked of the upstream itself: the gateway's one slot is taken
                async with client.get(upstream + "/held/arrived") as response:
                    return (await response.json())["arrived"] == 1

            await eventually(arrived, what="the held request to take the one upstream connection")
            started = time.monotonic()
            async with client.get(gw.url + "/echo") as response:
                elapsed = time.monotonic() - started
                assert response.status == 503
                assert response.headers["Retry-After"] == "1"
                assert response.content_type == "application/problem+json"
                assert "0.2 s" in (await response.json())["detail"]
            assert elapsed >= 0.15  # a timer never fires early; on time, not when the slot frees:
            assert not held.done()  # the request holding the slot is still waiting for its answer
            more = await asyncio.gather(*(client.get(gw.url + "/echo") for _ in range(3)))
            assert [response.status for response in more] == [503] * 3
            for response in more:
                response.release()
            # Each of the four counted once, and nothing else as unavailable.
            samples = (await scrape(client, gw.admin_url))[1]
            unavailable = {(s.labels["route"], s.labels["reason"]): s.value
                           for s in samples if s.name == "gateway_upstream_unavailable_total"}
            assert unavailable == {("/", "queue_full"): 4}
        finally:
            async with client.post(upstream + "/held/release") as response:
                assert response.status == 200
            response = await held
            assert response.status == 200
            response.release()
        async with client.get(gw.url + "/echo") as response:
            assert response.status == 200  # the slot came back


# --- max_body_size ---------------------------------------------------------------


async def body_echo(request: web.BaseRequest) -> web.Response:
    """Each body's length, and the body itself."""
    body = await request.read()
    return web.json_response({"length": len(body), "body": body.decode("latin-1")})


@pytest.fixture
async def counting_upstream():
    counter = RecordingUpstream(body_echo)
    app = web.Application(client_max_size=1 << 24)
    app.router.add_route("*", "/{tail:.*}", counter.handle)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield counter, f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def _upload(body: bytes, *, chunked: bool) -> bytes:
    head = b"POST /upload HTTP/1.1\r\nHost: gateway.test\r\nConnection: close\r\n"
    if chunked:
        framed = b"".join(b"%x\r\n" % len(body[i : i + 100]) + body[i : i + 100] + b"\r\n" for i in range(0, len(body), 100))
        return head + b"Transfer-Encoding: chunked\r\n\r\n" + framed + b"0\r\n\r\n"
    return head + b"Content-Length: %d\r\n\r\n" % len(body) + body


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("size, status", [(1000, 200), (1001, 413), (50000, 413)])
async def test_max_body_size_refuses_larger_bodies_with_413_before_the_upstream_hears_of_them(
    counting_upstream, chunked, size, status
):
    counter, url = counting_upstream
    body = bytes(range(256)) * (size // 256) + b"z" * (size % 256)
    async with running_gateway(_config(url, route="max_body_size: 1000")) as gw:
        async with _connection(gw.url) as (reader, writer):
            writer.write(_upload(body, chunked=chunked))
            data, _ = await _read_until_closed(reader, SLACK * 2)
    (response,) = _responses(data)
    if status == 413:
        problem = _problem(response, 413)
        assert "1000 bytes" in problem["detail"]
        assert counter.requests == 0
    else:
        assert response[0] == 200
        assert json.loads(response[2])["body"].encode("latin-1") == body
        assert counter.requests == 1


async def test_a_route_without_max_body_size_streams_any_size(counting_upstream):
    _counter, url = counting_upstream
    body = b"q" * 300_000
    async with running_gateway(_config(url)) as gw:
        async with _connection(gw.url) as (reader, writer):
            writer.write(_upload(body, chunked=True))
            data, _ = await _read_until_closed(reader, SLACK * 2)
    ((status, _, answer),) = _responses(data)
    assert status == 200
    assert json.loads(answer)["length"] == len(body)


# --- keepalive_requests -----------------------------------------------------------


async def test_a_connection_is_closed_after_keepalive_requests_with_connection_close_on_the_last(counting_upstream):
    counter, url = counting_upstream
    async with running_gateway(_config(url, "keepalive_requests: 3")) as gw:
        async with _connection(gw.url) as (reader, writer):
            writer.write(GET * 5)  # pipelined: the last two are never read
            data, _ = await _read_until_closed(reader, SLACK * 2)
    responses = _responses(data)
    assert [status for status, _, _ in responses] == [200, 200, 200]
    assert responses[-1][1]["connection"].lower() == "close"
    assert counter.requests == 3


async def test_keepalive_requests_counts_requests_sent_one_at_a_time(counting_upstream):
    counter, url = counting_upstream
    async with running_gateway(_config(url, "keepalive_requests: 2")) as gw:
        async with _connection(gw.url) as (reader, writer):
            writer.write(GET)
            first = await reader.readuntil(b"}")
            assert b"connection: close" not in first.lower()
            writer.write(GET)
            data, _ = await _read_until_closed(reader, SLACK)
    ((status, headers, _),) = _responses(data)
    assert status == 200
    assert headers["connection"].lower() == "close"
    assert counter.requests == 2


async def test_the_last_request_a_connection_takes_still_gets_its_whole_body(counting_upstream):
    counter, url = counting_upstream
    body = bytes(range(256)) * 400  # 100 KiB: past the 64 KiB read ahead, so the upstream is sent it streaming
    post = b"POST /upload HTTP/1.1\r\nHost: gateway.test\r\nContent-Length: %d\r\n\r\n" % len(body)
    async with running_gateway(_config(url, "keepalive_requests: 1")) as gw:
        async with _connection(gw.url) as (reader, writer):
            writer.write(post + body[:80000])
            await eventually(lambda: counter.requests == 1, what="the upstream to be sent the request")
            writer.write(body[80000:] + GET)  # the rest of the body, in a later read, and a request past the cap
            data, _ = await _read_until_closed(reader, SLACK * 2)
    ((status, headers, answer),) = _responses(data)
    assert status == 200
    assert json.loads(answer)["body"].encode("latin-1") == body
    assert headers["connection"].lower() == "close"
    assert counter.requests == 1
