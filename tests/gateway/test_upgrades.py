"""Requests that ask to switch protocols. The gateway proxies one upgrade, WebSocket, and
only as RFC 6455 makes its handshake: a GET without a body. Any other `Upgrade` (h2c,
TLS/1.0, ...) is declined: the request is answered as plain HTTP/1.1, the upstream never
sees the Upgrade, and every request pipelined behind it is answered too.

The gateway runs as users run it (GatewayProcess); the upstream is the tests' aiohttp
app, whose /echo reports the request head it received. Bytes go over a raw socket. The
tests share one gateway and upstream: each has connections of its own, and nothing is limited."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest
from yarl import URL

from tests.processes import GatewayProcess
from tests.raw_client import RAW_TIMEOUT

HANDSHAKE = (
    b"GET /ws HTTP/1.1\r\nHost: gw\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
    b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
)
H2C = b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"


@pytest.fixture(scope="module")
def gw(module_upstream) -> Iterator[GatewayProcess]:
    config = f"""
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
shutdown_grace: 1s
routes:
  - match: {{path: /}}
    upstream: {module_upstream}
    timeout: {{read: 3s}}
"""
    with GatewayProcess(config) as process:
        yield process


async def exchange(url: str, data: bytes, count: int) -> list[tuple[list[bytes], dict]]:
    """Send `data` in one write and read `count` responses: each one's head lines and JSON
    body (the echo's view of the request, or a problem)."""
    target = URL(url)
    reader, writer = await asyncio.open_connection(target.host, target.port)
    try:
        writer.write(data)
        await writer.drain()
        return [await read_response(reader) for _ in range(count)]
    finally:
        writer.close()


async def read_response(reader: asyncio.StreamReader) -> tuple[list[bytes], dict]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), RAW_TIMEOUT)
    lines = head.split(b"\r\n")[:-2]
    lengths = [int(v) for n, _, v in (line.partition(b":") for line in lines[1:]) if n.lower() == b"content-length"]
    assert len(lengths) == 1, lines  # a 101 has none
    return lines, json.loads(await asyncio.wait_for(reader.readexactly(lengths[0]), RAW_TIMEOUT))


@pytest.mark.parametrize(
    "framing",
    [b"Content-Length: 5\r\n\r\n", b"Content-Length: 5\r\n\r\nhello", b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"],
    ids=["length-without-body", "length-and-body", "chunked"],
)
async def test_a_websocket_handshake_with_a_body_gets_400_and_the_connection_closes(gw, framing):
    """Forwarded, the announced body never came and the upstream waited for it until
    timeout.read; or its bytes were read as the first frames."""
    ((lines, problem),) = await exchange(gw.url, HANDSHAKE + framing, 1)
    assert lines[0] == b"HTTP/1.1 400 Bad Request"
    assert b"Connection: close" in lines  # its body is never read as frames or requests
    assert problem["detail"] == "A WebSocket handshake must be a GET request without a body."


async def test_a_websocket_handshake_by_another_method_gets_400_and_an_empty_length_is_no_body(gw):
    ((lines, _),) = await exchange(gw.url, HANDSHAKE.replace(b"GET ", b"POST ", 1) + b"Content-Length: 0\r\n\r\n", 1)
    assert lines[0] == b"HTTP/1.1 400 Bad Request"
    target = URL(gw.url)
    reader, writer = await asyncio.open_connection(target.host, target.port)
    try:
        writer.write(HANDSHAKE + b"Content-Length: 0\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), RAW_TIMEOUT)
    finally:
        writer.close()
    assert head.startswith(b"HTTP/1.1 101 Switching Protocols\r\n")


async def test_every_request_pipelined_behind_a_declined_upgrade_is_answered(gw):
    """llhttp stops at a request with Connection: upgrade, and aiohttp dropped the rest of
    the read: b and c were never answered, and the connection waited out keepalive_timeout."""
    pipelined = (
        b"GET /echo/a HTTP/1.1\r\nHost: gw\r\n" + H2C + b"\r\n"
        b"GET /echo/b HTTP/1.1\r\nHost: gw\r\n\r\n"
        b"GET /echo/c HTTP/1.1\r\nHost: gw\r\nConnection: upgrade\r\nUpgrade: TLS/1.0\r\n\r\n"
        b"GET /echo/d HTTP/1.1\r\nHost: gw\r\n\r\n"
    )
    answered = await exchange(gw.url, pipelined, 4)
    # On a connection kept alive: the declined upgrade alone, then one more request.
    target = URL(gw.url)
    reader, writer = await asyncio.open_connection(target.host, target.port)
    try:
        writer.write(b"GET /echo/e HTTP/1.1\r\nHost: gw\r\n" + H2C + b"\r\n")
        answered.append(await read_response(reader))
        writer.write(b"GET /echo/f HTTP/1.1\r\nHost: gw\r\n\r\n")
        answered.append(await read_response(reader))
    finally:
        writer.close()
    assert [lines[0] for lines, _ in answered] == [b"HTTP/1.1 200 OK"] * 6
    assert [echo["path"] for _, echo in answered] == ["/echo/a", "/echo/b", "/echo/c", "/echo/d", "/echo/e", "/echo/f"]
    for _, echo in answered:
        names = {name.lower() for name, _ in echo["headers"]}
        assert not names & {"upgrade", "http2-settings", "connection"}, echo["headers"]


async def test_a_declined_upgrade_with_a_body_is_answered_and_then_its_connection_closes(gw):
    """Where llhttp resumes after such a request is not known for sure, so nothing behind it
    is read as a request: the connection closes after its answer (a pipelining client sends
    the rest again), rather than staying silent until keepalive_timeout."""
    upgrade_with_body = (
        b"POST /echo/a HTTP/1.1\r\nHost: gw\r\nContent-Length: 5\r\n" + H2C + b"\r\nhello"
        b"GET /echo/b HTTP/1.1\r\nHost: gw\r\n\r\n"
    )
    target = URL(gw.url)
    reader, writer = await asyncio.open_connection(target.host, target.port)
    try:
        writer.write(upgrade_with_body)
        lines, echo = await read_response(reader)
        rest = await asyncio.wait_for(reader.read(), RAW_TIMEOUT)
    finally:
        writer.close()
    assert lines[0] == b"HTTP/1.1 200 OK" and b"Connection: close" in lines
    assert (echo["path"], echo["body"]) == ("/echo/a", "hello")
    assert rest == b""
