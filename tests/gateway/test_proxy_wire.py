"""What crosses the wire on each leg that an HTTP library would hide: the
`Expect: 100-continue` exchange with the client and with the upstream, header
fields the gateway must not add to a relayed response, and how a body of unknown
length ends for an HTTP/1.0 client.

The gateway runs as users run it (GatewayProcess). The upstream is a bare
HTTP/1.1 server on asyncio streams, as minimal as RFC 9112 allows: it reads a
body without sending 100 Continue (a server need not send one), answers with
no Content-Type, and echoes the request head it received. The tests share one gateway and
upstream on the module's event loop: only one of them spends the limited route's token."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from yarl import URL

from tests.processes import GatewayProcess
from tests.raw_client import RAW_TIMEOUT, raw_exchange, values

# An upstream that never answers would hold the old gateway for 60 s (timeout.read);
# this is long for loopback and short for a test.
READ_TIMEOUT = "3s"

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def _bare(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Keep-alive HTTP/1.1 with Content-Length request bodies. /bytes?size=N answers N bytes,
    chunked with `chunked=1`; any other path echoes the request's head and body."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            length = next((int(v) for n, _, v in (line.partition(b":") for line in lines) if n.lower() == b"content-length"), 0)
            body = await reader.readexactly(length)
            target = URL(lines[0].split(b" ")[1].decode())
            answer = b"b" * int(target.query["size"]) if target.path == "/bytes" else head + body
            if "chunked" in target.query:
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(answer), answer))
            else:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(answer) + answer)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


@contextlib.asynccontextmanager
async def bare_upstream() -> AsyncIterator[str]:
    server = await asyncio.start_server(_bare, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway():
    async with bare_upstream() as upstream:
        config = f"""
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
shutdown_grace: 1s
limits:
  once: {{rate: 1/hour, burst: 1}}
routes:
  - match: {{path: /once}}
    upstream: {upstream}
    limits: [once]
    timeout: {{read: {READ_TIMEOUT}}}
  - match: {{path: /small}}
    upstream: {upstream}
    max_body_size: 10
  - match: {{path: /}}
    upstream: {upstream}
    timeout: {{read: {READ_TIMEOUT}}}
"""
        with GatewayProcess(config) as process:
            yield process


async def _expect_continue(url: str, path: str, body: bytes) -> tuple[bytes, bytes]:
    """POST `body` with `Expect: 100-continue`, sending the body only once a 100 came.
    Returns the first response head and, after a 100, the final response (head and body).
    The connection stays open: how the gateway frames its answer is part of what is tested."""
    target = URL(url)
    reader, writer = await asyncio.open_connection(target.host, target.port)
    try:
        writer.write(
            b"POST %s HTTP/1.1\r\nHost: gw\r\nContent-Length: %d\r\nExpect: 100-continue\r\n\r\n"
            % (path.encode(), len(body))
        )
        await writer.drain()
        first = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), RAW_TIMEOUT)
        if not first.startswith(b"HTTP/1.1 100 "):
            return first, b""
        writer.write(body)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), RAW_TIMEOUT)
        length = int(next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))[15:])
        rest = head + await asyncio.wait_for(reader.readexactly(length), RAW_TIMEOUT)
    finally:
        writer.close()
        await writer.wait_closed()
    return first, rest


async def test_a_body_sent_after_100_continue_reaches_an_upstream_that_sends_no_100(gateway):
    first, rest = await _expect_continue(gateway.url, "/echo", b"hello")
    assert first.startswith(b"HTTP/1.1 100 Continue")
    head, _, echoed = rest.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), rest[:200]
    upstream_head, _, upstream_body = echoed.partition(b"\r\n\r\n")
    assert upstream_body.startswith(b"hello")
    # The gateway answered the expectation; the upstream is not asked to answer it again.
    assert b"\r\nexpect:" not in upstream_head.lower()


async def test_an_allowed_request_gets_100_continue_and_a_limited_one_its_429_without_one(gateway):
    first, rest = await _expect_continue(gateway.url, "/once", b"first")
    assert first.startswith(b"HTTP/1.1 100 Continue")
    assert rest.startswith(b"HTTP/1.1 200 ") and b"first" in rest

    first, rest = await _expect_continue(gateway.url, "/once", b"second")
    # Refused from the head alone: the client is never invited to send the body, and the
    # connection closes, so bytes it may still send are never read as a request.
    assert first.startswith(b"HTTP/1.1 429 ")
    assert b"\r\nConnection: close\r\n" in first


async def test_a_declared_length_past_max_body_size_gets_413_without_100_continue(gateway):
    first, _ = await _expect_continue(gateway.url, "/small", b"x" * 11)
    assert first.startswith(b"HTTP/1.1 413 ")
    assert b"\r\nConnection: close\r\n" in first

    first, rest = await _expect_continue(gateway.url, "/small", b"x" * 10)
    assert first.startswith(b"HTTP/1.1 100 Continue")
    assert rest.startswith(b"HTTP/1.1 200 ")


# 5 bytes arrive with their head and leave in one write; 1 MiB streams through.
@pytest.mark.parametrize("size", [5, 1 << 20])
async def test_a_response_without_content_type_is_relayed_without_one(gateway, size):
    request = f"GET /bytes?size={size} HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n".encode()
    status, headers, body = await raw_exchange(gateway.url, request)
    assert status == 200
    assert len(body) == size
    assert values(headers, "Content-Type") == []


async def test_an_http_1_0_keep_alive_client_gets_a_body_of_unknown_length_ended_by_the_close(gateway):
    target = URL(gateway.url)
    reader, writer = await asyncio.open_connection(target.host, target.port)
    try:
        # A length the upstream declared is kept, and so is the connection.
        writer.write(b"GET /bytes?size=3 HTTP/1.0\r\nHost: gw\r\nConnection: keep-alive\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), RAW_TIMEOUT)
        assert b"\r\nContent-Length: 3\r\n" in head and b"\r\nConnection: keep-alive\r\n" in head
        assert await asyncio.wait_for(reader.readexactly(3), RAW_TIMEOUT) == b"bbb"
        # A chunked upstream answer has no length HTTP/1.0 can carry: the close ends it.
        writer.write(b"GET /bytes?size=5&chunked=1 HTTP/1.0\r\nHost: gw\r\nConnection: keep-alive\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), RAW_TIMEOUT)
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200 ")
    assert b"keep-alive" not in head.lower() and b"chunked" not in head.lower()
    assert body == b"bbbbb"
