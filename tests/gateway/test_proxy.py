"""The proxy carries requests and responses faithfully: bytes, status codes,
repeated headers, bodies both ways, hop-by-hop headers removed, X-Forwarded-*
set, no open proxying, WebSockets, and errors as problem+json.

Everything runs against the real gateway (in-process) in front of the real
aiohttp upstream in tests/upstream.py. Where the exact bytes on the wire matter
(request targets, Host headers, framing), requests go over a raw socket."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import aiohttp
import pytest
from aiohttp import web
from yarl import URL

from gateway.testing import running_gateway
from tests.helpers import refused_handshake
from tests.processes import eventually, free_port
from tests.raw_client import RAW_TIMEOUT, raw_exchange, values
from tests.scrape import scrape, value
from tests.upstream import GZIP_TEXT, serving


def passthrough_config(upstream: str, **route: str) -> str:
    """One catch-all route to `upstream`, with no limits unless `limits` is given."""
    extra = "".join(f"\n    {key}: {value}" for key, value in route.items())
    return f"""
limits:
  one_handshake: {{rate: 1/hour, burst: 1}}
routes:
  - match: {{path: /}}
    upstream: {upstream}{extra}
"""


def seen_headers(echo: dict, name: str) -> list[str]:
    """Every value of `name` as the echo upstream received it."""
    return [v for n, v in echo["headers"] if n.lower() == name.lower()]


@pytest.fixture
async def gw(upstream):
    async with running_gateway(passthrough_config(upstream)) as gateway:
        yield gateway



# --- bytes pass through unchanged -------------------------------------------


async def test_gzip_response_is_passed_through_compressed_with_its_content_encoding(gw, client):
    async with client.get(gw.url + "/gzip", headers={"Accept-Encoding": "gzip"}) as response:
        raw = await response.read()
        assert response.status == 200
        assert response.headers["Content-Encoding"] == "gzip"
        assert response.headers["Content-Length"] == str(len(raw))
    assert len(raw) == len(gzip.compress(GZIP_TEXT)) < len(GZIP_TEXT)  # still compressed: not inflated
    assert gzip.decompress(raw) == GZIP_TEXT


async def test_every_value_of_a_repeated_response_header_reaches_the_client(gw, client):
    async with client.get(gw.url + "/set-cookie") as response:
        assert response.status == 200
        assert response.headers.getall("Set-Cookie") == ["a=1; Path=/", "b=2; Path=/; HttpOnly"]
        assert response.headers.getall("X-Multi") == ["one", "two"]


async def test_redirects_are_returned_to_the_client_not_followed(gw, client):
    async with client.get(gw.url + "/redirect", allow_redirects=False) as response:
        assert response.status == 302
        assert response.headers["Location"] == "/echo"


@pytest.mark.parametrize("code", [201, 204, 304, 404, 418, 500, 503])
async def test_upstream_status_codes_reach_the_client_unchanged(gw, client, code):
    async with client.get(gw.url + f"/status/{code}") as response:
        assert response.status == code
        assert await response.read() == b""
        assert response.headers.get("Content-Type") != "application/problem+json"


async def test_head_gets_the_headers_of_get_and_no_body(gw):
    status, headers, body = await raw_exchange(
        gw.url, b"HEAD /stream?size=5000&length=1 HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n"
    )
    assert status == 200
    assert values(headers, "Content-Length") == ["5000"]
    assert body == b""


async def test_empty_request_and_response_bodies(gw, client):
    async with client.post(gw.url + "/echo/empty", data=b"") as response:
        echo = await response.json()
    assert echo["method"] == "POST"
    assert echo["body_length"] == 0
    assert seen_headers(echo, "Content-Length") in ([], ["0"])
    async with client.get(gw.url + "/status/200") as response:
        assert response.status == 200
        assert response.headers["Content-Length"] == "0"
        assert await response.read() == b""


# A small body has usually arrived whole when the upstream's headers are read, and leaves
# in one write with them; a large one streams. Either way the framing is kept.
SMALL_AND_STREAMED = pytest.mark.parametrize("size", [100, 300000])


@SMALL_AND_STREAMED
async def test_a_chunked_response_arrives_chunked_and_whole(gw, size):
    status, headers, body = await raw_exchange(
        gw.url, f"GET /stream?size={size} HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n".encode()
    )
    assert status == 200
    # Exactly the gateway's own framing: the upstream's Transfer-Encoding was not copied on top of it.
    assert values(headers, "Transfer-Encoding") == ["chunked"]
    assert values(headers, "Content-Length") == []
    assert body == b"x" * size


@SMALL_AND_STREAMED
async def test_a_response_with_content_length_keeps_it(gw, client, size):
    async with client.get(gw.url + f"/stream?size={size}&length=1") as response:
        assert response.headers["Content-Length"] == str(size)
        assert "Transfer-Encoding" not in response.headers
        assert len(await response.read()) == size


async def test_a_request_body_with_content_length_arrives_intact(gw, client):
    body = bytes(range(256)) * 100
    async with client.post(gw.url + "/echo/upload", data=body) as response:
        echo = await response.json()
    assert echo["body"].encode("latin-1") == body
    assert seen_headers(echo, "Content-Length") == [str(len(body))]


async def test_a_chunked_request_body_arrives_intact(gw, client):
    pieces = [bytes([i]) * (1000 + i) for i in range(40)]

    async def chunks():
        for piece in pieces:
            yield piece

    async with client.put(gw.url + "/echo/chunked", data=chunks()) as response:
        echo = await response.json()
    assert echo["method"] == "PUT"
    assert echo["body"].encode("latin-1") == b"".join(pieces)
    # The upstream sees one framing: the gateway's own, not the client's copied on top.
    assert seen_headers(echo, "Transfer-Encoding") == ["chunked"]


async def test_a_raw_chunked_request_body_arrives_intact(gw):
    request = (
        b"POST /echo/raw-chunked HTTP/1.1\r\nHost: gw\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n1\r\n \r\n6\r\nworld!\r\n0\r\n\r\n"
    )
    status, _, body = await raw_exchange(gw.url, request)
    echo = json.loads(body)
    assert status == 200
    assert echo["body"] == "hello world!"
    assert echo["body_length"] == 12


async def test_a_request_with_expect_100_continue_is_answered(gw):
    target = URL(gw.url)
    reader, writer = await asyncio.open_connection(target.host, target.port)
    try:
        writer.write(
            b"POST /echo/expect HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n"
            b"Content-Length: 5\r\nExpect: 100-continue\r\n\r\n"
        )
        await writer.drain()
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), RAW_TIMEOUT)
        assert interim.startswith(b"HTTP/1.1 100")
        writer.write(b"hello")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), RAW_TIMEOUT)
    finally:
        writer.close()
        await writer.wait_closed()
    assert answer.startswith(b"HTTP/1.1 200")
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["body"] == "hello"


# --- headers ------------------------------------------------------------------


async def test_hop_by_hop_request_headers_are_not_forwarded(gw):
    request = (
        b"GET /echo/hop HTTP/1.1\r\nHost: gw\r\n"
        b"Connection: close, X-Custom-Hop, x-other-hop\r\n"
        b"X-Custom-Hop: secret\r\nX-Other-Hop: secret too\r\n"
        b"Keep-Alive: timeout=5\r\nProxy-Connection: keep-alive\r\nTE: trailers\r\n"
        b"Trailer: X-Checksum\r\nUpgrade: h2c\r\nX-End-To-End: kept\r\n\r\n"
    )
    status, _, body = await raw_exchange(gw.url, request)
    assert status == 200
    received = {name.lower() for name, _ in json.loads(body)["headers"]}
    for hop in ("x-custom-hop", "x-other-hop", "keep-alive", "proxy-connection", "te", "trailer", "upgrade"):
        assert hop not in received
    assert "x-end-to-end" in received
    connection = [v for n, v in json.loads(body)["headers"] if n.lower() == "connection"]
    assert not any("hop" in v.lower() for v in connection)


async def test_hop_by_hop_response_headers_are_not_returned(gw, client):
    async with client.get(gw.url + "/hop") as response:
        assert response.status == 200
        assert await response.text() == "hop"
        for hop in ("X-Secret-Hop", "Keep-Alive", "Proxy-Connection", "TE", "Trailer", "Upgrade"):
            assert hop not in response.headers, hop
        assert "x-secret-hop" not in response.headers.get("Connection", "").lower()
        assert response.headers["X-Kept"] == "yes"


async def test_with_forwarded_headers_append_the_peer_is_appended_and_proto_and_host_are_named(upstream):
    """`append` passes an untrusted peer's chain on; the default, `replace`, is in test_forwarded_headers."""
    request = (
        b"GET /echo/fwd HTTP/1.1\r\nHost: api.example.test:8443\r\nConnection: close\r\n"
        b"X-Forwarded-For: 203.0.113.7\r\nX-Forwarded-For: 198.51.100.2, 192.0.2.9\r\n"
        b"X-Forwarded-Proto: https\r\nX-Forwarded-Host: forged.example\r\n\r\n"
    )
    async with running_gateway("forwarded_headers: append" + passthrough_config(upstream)) as gw:
        status, _, body = await raw_exchange(gw.url, request)
    echo = json.loads(body)
    assert status == 200
    assert seen_headers(echo, "X-Forwarded-For") == ["203.0.113.7, 198.51.100.2, 192.0.2.9, 127.0.0.1"]
    assert seen_headers(echo, "X-Forwarded-Proto") == ["http"]
    assert seen_headers(echo, "X-Forwarded-Host") == ["api.example.test:8443"]


async def test_x_forwarded_for_is_set_when_the_client_sent_none(gw, client):
    async with client.get(gw.url + "/echo/fwd") as response:
        echo = await response.json()
    assert seen_headers(echo, "X-Forwarded-For") == ["127.0.0.1"]


async def test_the_upstream_sees_its_own_host_unless_preserve_host(upstream):
    upstream_authority = URL(upstream).raw_authority
    request = b"GET /echo/host HTTP/1.1\r\nHost: public.example\r\nConnection: close\r\n\r\n"
    async with running_gateway(passthrough_config(upstream)) as gw:
        _, _, body = await raw_exchange(gw.url, request)
    assert seen_headers(json.loads(body), "Host") == [upstream_authority]
    async with running_gateway(passthrough_config(upstream, preserve_host="true")) as gw:
        _, _, body = await raw_exchange(gw.url, request)
    assert seen_headers(json.loads(body), "Host") == ["public.example"]


# --- no open proxy -------------------------------------------------------------


@pytest.fixture
async def decoy():
    """A server the gateway must never contact; counts every request it gets."""
    hits: list[str] = []

    async def record(request: web.BaseRequest) -> web.Response:
        hits.append(request.raw_path)
        return web.Response(text="decoy")

    async with serving(record) as url:
        yield url.removeprefix("http://"), hits


async def test_an_absolute_form_request_target_goes_to_the_routes_upstream(gw, decoy):
    elsewhere, hits = decoy
    for target in (f"http://{elsewhere}/echo/abs?q=1", "http://elsewhere.invalid/echo/abs?q=1"):
        request = f"GET {target} HTTP/1.1\r\nHost: {elsewhere}\r\nConnection: close\r\n\r\n".encode()
        status, _, body = await raw_exchange(gw.url, request)
        assert status == 200
        echo = json.loads(body)
        assert echo["path"] == "/echo/abs?q=1"
    assert hits == []


@pytest.mark.parametrize(
    ("host", "status"),
    [("{decoy}", 200), ("elsewhere.invalid", 200), ("elsewhere.invalid:80", 200), ("[::1]:1", 200),
     ("user@{decoy}", 400), ("", 400)],  # not a host (RFC 9112 §3.2): refused, see tests/gateway/test_self_report.py
)
async def test_an_odd_host_header_never_changes_the_upstream(gw, decoy, host, status):
    elsewhere, hits = decoy
    host_line = f"Host: {host.format(decoy=elsewhere)}\r\n"
    request = f"GET /echo/host-test HTTP/1.1\r\n{host_line}Connection: close\r\n\r\n".encode()
    answer, _, body = await raw_exchange(gw.url, request)
    assert hits == []
    assert answer == status, body
    if status == 200:
        assert json.loads(body)["path"] == "/echo/host-test"


async def test_connect_never_opens_a_tunnel(gw, decoy):
    elsewhere, hits = decoy
    request = f"CONNECT {elsewhere} HTTP/1.1\r\nHost: {elsewhere}\r\nConnection: close\r\n\r\n".encode()
    status, headers, body = await raw_exchange(gw.url, request)
    assert hits == []
    assert status == 400
    assert values(headers, "Content-Type")[0].startswith("application/problem+json")
    assert json.loads(body)["status"] == 400


@pytest.mark.parametrize("expect", ["100-continue", "Zq7"])
async def test_connect_with_an_expectation_gets_one_400_and_its_tunnel_data_is_never_read(gw, decoy, expect):
    """Found by the self-report fuzz: the Expect used to be answered first (a 100 Continue,
    or a 417 on an open connection), and bytes sent after the head were then read as a
    second request, which got an answer of its own."""
    elsewhere, hits = decoy
    request = (
        f"CONNECT {elsewhere} HTTP/1.1\r\nHost: {elsewhere}\r\nExpect: {expect}\r\n\r\n"
        "GET /echo/smuggled HTTP/1.1\r\nHost: gw\r\n\r\n"
    ).encode()
    reader, writer = await asyncio.open_connection(*urlsplit(gw.url)[1].split(":"))
    writer.write(request)
    answer = await asyncio.wait_for(reader.read(), 10)  # to the end: the gateway must close
    writer.close()
    assert hits == []
    assert answer.startswith(b"HTTP/1.1 400 ") and answer.count(b"HTTP/1.") == 1, answer
    assert b"smuggled" not in answer


@pytest.mark.parametrize(
    ("head", "method", "status"),
    [
        ("OPTIONS * HTTP/1.1", "OPTIONS", 400),
        ("CONNECT example.com:443 HTTP/1.1", "CONNECT", 400),
        ("POST /echo/x HTTP/1.1\r\nContent-Length: 0\r\nExpect: 200-ok", "POST", 417),
    ],
)
async def test_targets_and_expectations_the_gateway_refuses_get_a_problem_and_are_counted(
    gw, client, head, method, status
):
    answer, headers, body = await raw_exchange(gw.url, f"{head}\r\nHost: gw\r\nConnection: close\r\n\r\n".encode())
    assert answer == status
    assert values(headers, "Content-Type") == ["application/problem+json; charset=utf-8"]
    assert json.loads(body)["status"] == status
    _, samples = await scrape(client, gw.admin_url)
    assert value(samples, "gateway_requests_total", route="unmatched", method=method, status_class="4xx") == 1


# --- WebSocket --------------------------------------------------------------------


async def test_websocket_text_and_binary_frames_are_proxied_both_ways_with_the_subprotocol(upstream, client):
    async with running_gateway(passthrough_config(upstream)) as gw:
        async with client.ws_connect(gw.url + "/ws", protocols=("chat",)) as ws:
            assert ws.protocol == "chat"
            await ws.send_str("hello")
            assert await ws.receive_str(timeout=RAW_TIMEOUT) == "echo:hello"
            await ws.send_bytes(b"\x00\x01binary\xff")
            assert await ws.receive_bytes(timeout=RAW_TIMEOUT) == b"\xffyranib\x01\x00"
            for i in range(20):  # frames after the handshake are not rate limited
                await ws.send_str(str(i))
                assert await ws.receive_str(timeout=RAW_TIMEOUT) == f"echo:{i}"


async def test_the_limit_applies_to_the_websocket_handshake(upstream, client):
    async with running_gateway(passthrough_config(upstream, limits="[one_handshake]")) as gw:
        async with client.ws_connect(gw.url + "/ws", protocols=("chat",)) as ws:
            await ws.send_str("first")
            assert await ws.receive_str(timeout=RAW_TIMEOUT) == "echo:first"
            assert await refused_handshake(client, gw.url + "/ws", protocols=("chat",)) == 429
            await ws.send_str("still open")
            assert await ws.receive_str(timeout=RAW_TIMEOUT) == "echo:still open"


@contextlib.asynccontextmanager
async def open_websockets(
    client: aiohttp.ClientSession, url: str, count: int
) -> AsyncIterator[list[aiohttp.ClientWebSocketResponse]]:
    """`count` WebSockets open to `url`, each holding one of the upstream's connections;
    the ones still open are closed on the way out."""
    sockets = [await client.ws_connect(url, protocols=("chat",)) for _ in range(count)]
    try:
        yield sockets
    finally:
        for ws in sockets:
            await ws.close()


async def test_open_websockets_and_requests_share_the_upstreams_connections(upstream, client):
    """upstream_connections bounds both: with every connection held by an open WebSocket,
    a plain request and a 21st handshake get their 503 within timeout.queue instead of
    waiting for a WebSocket to close, and one closing frees a connection for a request."""
    config = "upstream_connections: 20\n" + passthrough_config(upstream, timeout="{queue: 200ms}")
    async with running_gateway(config) as gw:
        async with open_websockets(client, gw.url + "/ws", 20) as sockets:
            async with client.get(gw.url + "/echo") as response:
                body = await assert_problem(response, 503)
            assert "No connection to the upstream came free within 0.2 s" in body["detail"]
            assert await refused_handshake(client, gw.url + "/ws", protocols=("chat",)) == 503
            await sockets.pop().close()
            async with client.get(gw.url + "/echo") as response:
                assert response.status == 200
            await sockets[0].send_str("still open")
            assert await sockets[0].receive_str(timeout=RAW_TIMEOUT) == "echo:still open"
        _, samples = await scrape(client, gw.admin_url)
        assert value(samples, "gateway_upstream_unavailable_total", reason="queue_full") == 2


async def test_open_websockets_on_one_route_leave_another_route_of_their_upstream_a_bounded_503(upstream):
    """At the default timeout.queue (1 s), 20 WebSockets holding all of an upstream's 20
    connections: a GET on another route to the same upstream, and a 21st handshake, each
    get their 503 instead of waiting for a WebSocket to close. The client's own timeout
    only keeps a hang from hanging the test."""
    config = f"""
upstream_connections: 20
routes:
  - match: {{path: /ws}}
    upstream: {upstream}
  - match: {{path: /echo}}
    upstream: {upstream}
"""
    bounded = aiohttp.ClientTimeout(total=RAW_TIMEOUT)
    async with running_gateway(config) as gw, aiohttp.ClientSession(timeout=bounded) as client:
        async with open_websockets(client, gw.url + "/ws", 20) as sockets:
            async with client.get(gw.url + "/echo/plain") as response:
                body = await assert_problem(response, 503)
            assert "No connection to the upstream came free within 1 s" in body["detail"]
            assert response.headers["Retry-After"] == "1"
            assert await refused_handshake(client, gw.url + "/ws", protocols=("chat",)) == 503
            await sockets.pop().close()
            async with client.get(gw.url + "/echo/plain") as response:
                assert response.status == 200


async def test_the_websocket_handshake_response_carries_the_ratelimit_headers(upstream):
    request = (
        b"GET /ws HTTP/1.1\r\nHost: gw\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        b"Sec-WebSocket-Protocol: chat\r\n\r\n"
    )
    async with running_gateway(passthrough_config(upstream, limits="[one_handshake]")) as gw:
        target = URL(gw.url)
        reader, writer = await asyncio.open_connection(target.host, target.port)
        try:
            writer.write(request)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), RAW_TIMEOUT)
        finally:
            writer.close()
            await writer.wait_closed()
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].startswith("HTTP/1.1 101")
    headers = {n.strip().lower(): v.strip() for n, _, v in (line.partition(":") for line in lines[1:] if line)}
    assert headers["sec-websocket-protocol"] == "chat"
    assert headers["ratelimit-policy"] == '"one_handshake";q=1;w=3600'
    assert headers["ratelimit"].startswith('"one_handshake";r=0;')


async def test_a_websocket_handshake_the_upstream_refuses_gives_502(upstream, client):
    async with running_gateway(passthrough_config(upstream)) as gw:
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await client.ws_connect(gw.url + "/echo/not-a-websocket")
    assert refused.value.status == 502


# --- errors as problem+json ----------------------------------------------------------


async def assert_problem(response: aiohttp.ClientResponse, status: int) -> dict:
    assert response.status == status
    assert response.headers["Content-Type"].split(";")[0] == "application/problem+json"
    body = json.loads(await response.read())
    assert body["status"] == status
    assert isinstance(body["type"], str) and body["type"]
    assert isinstance(body["title"], str) and body["title"]
    assert isinstance(body["detail"], str) and body["detail"]
    return body


async def test_an_upstream_that_refuses_the_connection_gives_502(client):
    nothing_listening = f"http://127.0.0.1:{free_port()}"
    async with running_gateway(passthrough_config(nothing_listening)) as gw:
        async with client.get(gw.url + "/anything") as response:
            body = await assert_problem(response, 502)
    assert body["title"] == "Bad Gateway"


async def test_an_upstream_that_does_not_answer_in_time_gives_504(upstream, client):
    async with running_gateway(passthrough_config(upstream, timeout="{read: 200ms}")) as gw:
        async with client.get(gw.url + "/slow?seconds=5") as response:
            body = await assert_problem(response, 504)
    assert body["title"] == "Gateway Timeout"


async def test_an_upstream_error_on_a_limited_route_still_carries_the_ratelimit_headers(client):
    nothing_listening = f"http://127.0.0.1:{free_port()}"
    async with running_gateway(passthrough_config(nothing_listening, limits="[one_handshake]")) as gw:
        async with client.get(gw.url + "/anything") as response:
            await assert_problem(response, 502)
            assert response.headers["RateLimit-Policy"] == '"one_handshake";q=1;w=3600'
            assert response.headers["RateLimit"].startswith('"one_handshake";r=0;')


async def test_a_request_that_matches_no_route_gives_404(upstream, client):
    config = f"""
routes:
  - match: {{path: /api}}
    upstream: {upstream}
"""
    async with running_gateway(config) as gw:
        async with client.get(gw.url + "/elsewhere") as response:
            body = await assert_problem(response, 404)
        async with client.get(gw.url + "/apix") as response:
            await assert_problem(response, 404)
    assert body["title"] == "Not Found"


# --- timeout.total ------------------------------------------------------------


async def test_timeout_total_bounds_the_wait_for_the_answer_and_the_relay_of_the_body(client):
    """Before the status line, timeout.total gives 504; once the body has begun, it cuts
    the client's connection and the upstream's, whatever timeout.read still allows."""
    streaming: list[asyncio.BaseTransport] = []  # the gateway's connection to the upstream
    finished = asyncio.Event()  # lets the upstream's held handlers end, so it shuts down at once

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        if request.path == "/silent":
            await finished.wait()  # never answers in time
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(b"first chunk")
        streaming.append(request.transport)
        await finished.wait()  # the rest never comes in time
        return response

    async with serving(handler) as upstream:
        async with running_gateway(passthrough_config(upstream, timeout="{total: 300ms, read: 60s}")) as gw:
            async with client.get(gw.url + "/silent") as response:
                body = await assert_problem(response, 504)
            assert "total 0.3 s" in body["detail"]
            async with client.get(gw.url + "/streaming") as response:
                assert response.status == 200
                assert await response.content.readexactly(len(b"first chunk")) == b"first chunk"
                with pytest.raises(aiohttp.ClientPayloadError):
                    await response.read()
            # The gateway closed its side: aiohttp's server sees the connection lost.
            await eventually(lambda: streaming[0].is_closing(), what="the upstream connection to close")
            finished.set()
