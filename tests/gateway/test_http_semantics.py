"""The gateway as an HTTP/1.1 intermediary (RFC 9110, RFC 9112), seen from raw sockets on
both legs: message framing that depends on the method or status (HEAD, 204, 304, 1xx),
bodies that end with the connection or end too soon, transfer codings, and the gateway's
own answers on a kept-alive connection.

The upstream is a bare asyncio server whose answers are written out byte for byte below,
so that it can send what aiohttp's server never would (a 103, a short body, a gzip transfer
coding); requests with a body go to a real aiohttp echo upstream. Each exchange is pipelined
and ends with `Connection: close`, so every read ends at the gateway's close, and a response
that framed its body wrongly shows up as the next response's garbled head."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator

import pytest
from yarl import URL

from gateway.testing import running_gateway
from tests.raw_client import RAW_TIMEOUT, _dechunk
from tests.upstream import echo, serving

ANSWERS = {
    b"/length": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Type: text/plain\r\n\r\nhello",
    b"/no-content": b"HTTP/1.1 204 No Content\r\nX-Seen: 1\r\n\r\n",
    b"/not-modified": b'HTTP/1.1 304 Not Modified\r\nETag: "v1"\r\n\r\n',
    b"/early-hints": (
        b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    ),
    b"/until-close": b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nended by the close",
    b"/short": b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly 17 bytes here",
    b"/short-chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
    b"/cookies": (
        b"HTTP/1.1 200 OK\r\nSet-Cookie: a=1\r\nX-Between: 1\r\nSet-Cookie: b=2; Path=/\r\n"
        b"Set-Cookie: c=3\r\nServer: upstream/1.0\r\nDate: Mon, 01 Jan 2001 00:00:00 GMT\r\n"
        b"Content-Length: 0\r\n\r\n"
    ),
    b"/gzip-coded": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n4\r\n\x1f\x8b\x08\x00\r\n0\r\n\r\n"
    ),
}


@contextlib.asynccontextmanager
async def canned_upstream() -> AsyncIterator[tuple[str, list[bytes]]]:
    """Answers each request with ANSWERS[path] (its head alone to a HEAD), then closes;
    records every path asked for."""
    seen: list[bytes] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            path = head.split(b" ")[1]
            seen.append(path)
            answer = ANSWERS[path]
            if head.startswith(b"HEAD "):
                answer = answer.partition(b"\r\n\r\n")[0] + b"\r\n\r\n"
            writer.write(answer)
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", seen
    finally:
        server.close()
        await server.wait_closed()


@pytest.fixture
async def gw():
    async with canned_upstream() as (canned, seen), serving(echo) as echoing:
        config = f"""
limits:
  once: {{rate: 1/hour, burst: 1}}
routes:
  - match: {{path: /echo}}
    upstream: {echoing}
  - match: {{path: /limited}}
    upstream: {echoing}
    limits: [once]
  - match: {{path: /}}
    upstream: {canned}
"""
        async with running_gateway(config) as gateway:
            yield gateway.url, seen


async def exchange(url: str, data: bytes) -> bytes:
    """Send `data` and read until the gateway closes the connection."""
    target = URL(url)
    reader, writer = await asyncio.open_connection(target.host, target.port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), RAW_TIMEOUT)
    finally:
        writer.close()
        await writer.wait_closed()


def request(method: str, path: str, *, close: bool = False, extra: str = "") -> bytes:
    """A request head; `extra` is header lines, each ending in CRLF."""
    if close:
        extra += "Connection: close\r\n"
    return f"{method} {path} HTTP/1.1\r\nHost: gw\r\n{extra}\r\n".encode()


def split_head(data: bytes) -> tuple[int, dict[str, list[str]], bytes]:
    """The first response's status and headers (by lower-case name), and every byte after its head."""
    head, sep, rest = data.partition(b"\r\n\r\n")
    assert sep, data
    lines = head.decode("latin-1").split("\r\n")
    headers: dict[str, list[str]] = {}
    for name, _, value in (line.partition(":") for line in lines[1:]):
        headers.setdefault(name.strip().lower(), []).append(value.strip())
    return int(lines[0].split()[1]), headers, rest


async def test_a_head_response_keeps_its_content_length_and_relays_no_body(gw):
    url, _ = gw
    data = await exchange(url, request("HEAD", "/length") + request("GET", "/no-content", close=True))
    status, headers, rest = split_head(data)
    assert (status, headers["content-length"]) == (200, ["5"])
    assert "transfer-encoding" not in headers
    assert rest.startswith(b"HTTP/1.1 204 ")  # no body between the two heads


@pytest.mark.parametrize(("path", "status"), [("/no-content", 204), ("/not-modified", 304)])
async def test_a_204_or_304_is_relayed_with_no_body_and_no_chunked_framing(gw, path, status):
    url, _ = gw
    data = await exchange(url, request("GET", path) + request("GET", "/no-content", close=True))
    answered, headers, rest = split_head(data)
    assert answered == status
    assert "transfer-encoding" not in headers and headers.get("content-length", ["0"]) == ["0"]
    assert rest.startswith(b"HTTP/1.1 204 ")


async def test_an_early_hints_interim_response_is_dropped_and_the_final_one_relayed(gw):
    # aiohttp's client reads past any 1xx but 101, as nginx before 1.29 and Envoy do by default.
    url, _ = gw
    status, headers, rest = split_head(await exchange(url, request("GET", "/early-hints", close=True)))
    assert (status, rest) == (200, b"ok")
    assert "link" not in headers


async def test_a_response_ended_by_the_upstreams_close_reaches_the_client_whole_and_chunked(gw):
    url, _ = gw
    status, headers, rest = split_head(await exchange(url, request("GET", "/until-close", close=True)))
    assert status == 200 and headers["transfer-encoding"] == ["chunked"]
    assert rest.endswith(b"\r\n0\r\n\r\n")  # a clean end the client can tell from a cut
    assert _dechunk(rest) == b"ended by the close"


async def test_a_body_short_of_its_content_length_is_cut_for_the_client_too(gw):
    url, _ = gw
    status, headers, rest = split_head(await exchange(url, request("GET", "/short")))
    # Asked to keep the connection alive, the gateway closed it instead: the client holds
    # fewer bytes than Content-Length promised and can tell the response was cut.
    assert status == 200 and headers["content-length"] == ["100"]
    assert len(rest) < 100


async def test_a_chunked_body_cut_before_its_last_chunk_is_cut_for_the_client_too(gw):
    url, _ = gw
    status, headers, rest = split_head(await exchange(url, request("GET", "/short-chunked")))
    assert status == 200 and headers["transfer-encoding"] == ["chunked"]
    assert b"hello" in rest and not rest.endswith(b"0\r\n\r\n")  # no last chunk: not a clean end


async def test_set_cookie_lines_keep_their_order_and_the_upstreams_date_is_kept(gw):
    url, _ = gw
    status, headers, _ = split_head(await exchange(url, request("GET", "/cookies", close=True)))
    assert status == 200
    assert headers["set-cookie"] == ["a=1", "b=2; Path=/", "c=3"]
    assert headers["date"] == ["Mon, 01 Jan 2001 00:00:00 GMT"]
    assert "server" not in headers  # dropped, as documented (gateway.proxy.protocol)


async def test_a_request_in_gzip_transfer_coding_gets_501_and_reaches_no_upstream(gw):
    # Accepted, its body reached the upstream still gzipped under `Transfer-Encoding: chunked`.
    url, seen = gw
    coded = request("POST", "/echo", extra="Transfer-Encoding: gzip, chunked\r\n") + b"4\r\n\x1f\x8b\x08\x00\r\n0\r\n\r\n"
    status, headers, rest = split_head(await exchange(url, coded + request("GET", "/no-content", close=True)))
    assert status == 501 and headers["connection"] == ["close"]
    assert json.loads(rest)["status"] == 501  # and no response follows: the GET behind it was not read
    assert seen == []


async def test_an_upstream_response_in_gzip_transfer_coding_is_a_502(gw):
    # Relayed, the client got gzip bytes labelled as neither a transfer nor a content coding.
    url, _ = gw
    status, _headers, rest = split_head(await exchange(url, request("GET", "/gzip-coded", close=True)))
    assert status == 502
    assert json.loads(rest)["title"] == "Bad Gateway"


async def test_chunk_extensions_and_trailers_are_read_and_the_body_forwarded(gw):
    url, _ = gw
    body = '3;name=value;q="x y"\r\nabc\r\n2;bare\r\nde\r\n0\r\nX-Trailer: t\r\n\r\n'
    data = await exchange(url, request("POST", "/echo", close=True, extra="Transfer-Encoding: chunked\r\n") + body.encode())
    status, _, rest = split_head(data)
    assert status == 200 and json.loads(rest)["body"] == "abcde"


async def test_a_rejected_request_with_an_unread_body_leaves_the_connection_usable(gw):
    url, _ = gw
    post = request("POST", "/limited", extra="Content-Length: 5\r\n") + b"first"
    refused = request("POST", "/limited", extra="Content-Length: 6\r\n") + b"second"
    head = request("HEAD", "/limited")
    data = await exchange(url, post + refused + head + request("GET", "/no-content", close=True))
    assert re.findall(rb"HTTP/1\.1 (\d{3}) ", data) == [b"200", b"429", b"429", b"204"]
    # The HEAD's 429 declares its problem+json's length and sends none of it.
    head_429 = data[data.index(b"HTTP/1.1 429", data.index(b"HTTP/1.1 429") + 1) :]
    _, headers, rest = split_head(head_429)
    assert int(headers["content-length"][0]) > 0 and rest.startswith(b"HTTP/1.1 204 ")


async def test_no_via_is_added_on_either_leg(gw):
    # docs/proxying.md: nginx and Envoy add none by default, and an nginx upstream stops gzipping for one.
    url, _ = gw
    status, headers, rest = split_head(await exchange(url, request("GET", "/echo", close=True)))
    assert status == 200 and "via" not in headers
    assert not [name for name, _ in json.loads(rest)["headers"] if name.lower() == "via"]
