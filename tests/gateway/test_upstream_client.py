"""The gateway's own HTTP/1.1 client, `UpstreamClient`, against real TCP upstreams on
free ports that write exact bytes, including bytes no well-behaved server would send.

What the tests prove:
- a connection is reused only after its response was read to the end and both sides
  meant to keep it; a response released unread closes its connection;
- a response whose framing is ambiguous or invalid (Content-Length twice, beside
  Transfer-Encoding, a transfer coding other than chunked, a control byte in a header)
  fails with UpstreamFailed, and so does its connection for good; bytes past the end of
  a response, or on an idle connection, end that connection;
- bodies framed by Content-Length, by chunks and by the close of the connection arrive
  whole; HEAD, 204 and 304 have none and keep the connection; 100 and 103 are skipped;
- the request reaches the upstream with the exact framing, Host and Authorization;
- a request that a kept connection lost before any byte of the answer is sent once more
  on a new connection only when it is idempotent and its body can be sent again;
- backpressure holds both ways: a response nobody reads stops being read from the
  upstream, and a body the upstream does not take stops being pulled from its source;
- connect, read and body failures surface as ConnectFailed, UpstreamTimeout, BodyFailed;
- close() closes idle connections, and those in use as they are released.

Nothing is mocked: the upstreams are asyncio servers, the client's parser is llhttp.
The tests wait on what the upstream observes (`eventually`), never on the clock."""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import gzip
import re
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest
from multidict import CIMultiDict

from gateway.upstream import client as upstream_client
from gateway.upstream.client import UpstreamClient
from gateway.upstream.connection import HIGH_WATER, UpstreamResponse
from gateway.upstream.errors import BodyFailed, ConnectFailed, UpstreamFailed, UpstreamTimeout
from tests.processes import eventually, free_port

# Timeouts that never fire on a loaded 2-core machine, for tests that are not about them.
RELAXED = 10.0
# asyncio reads at most this much per data_received (selector_events' max_size).
ONE_READ = 256 * 1024
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


@dataclass(frozen=True)
class Cut:
    """An answer: write `data` (possibly nothing), then close the connection."""

    data: bytes = b""


CLOSE = Cut()  # read the request, then close without answering
SILENT = object()  # read the request and never answer
Answer = bytes | Cut | object | Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    """One request as its bytes arrived, head and body; None if the client closed first.
    Only the framings UpstreamClient writes are understood: Content-Length or chunks."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    lowered = head.lower()
    if b"\r\ntransfer-encoding: chunked\r\n" in lowered:
        body = b""
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            body += size_line + await reader.readexactly(size + 2)
            if size == 0:  # the client sends no trailers: the last chunk is 0\r\n\r\n
                return head + body
    length = re.search(rb"\r\ncontent-length: *(\d+)\r\n", lowered)
    return head + await reader.readexactly(int(length[1]) if length else 0)


class RawUpstream:
    """A TCP server answering each request it reads, on whichever connection, with the
    next of `answers`: bytes written as given, a `Cut`, SILENT, or a coroutine function
    given the connection's reader and writer. Records every request byte for byte."""

    def __init__(self, *answers: Answer) -> None:
        self.answers = collections.deque(answers)
        self.connections = 0
        self.hung_up = 0  # connections the client closed (the server read EOF on them)
        self.requests: list[bytes] = []
        self._writers: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> RawUpstream:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        for writer in self._writers:
            writer.close()  # a handler still reading sees EOF and ends
        await asyncio.gather(*self._handlers)
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        self._handlers.add(asyncio.current_task())  # type: ignore[arg-type]
        try:
            while (request := await read_request(reader)) is not None:
                self.requests.append(request)
                answer = self.answers.popleft()
                if answer is SILENT:
                    await reader.read()  # until the client gives up
                    break
                if isinstance(answer, Cut):
                    writer.write(answer.data)
                    writer.close()
                    return
                if callable(answer):
                    await answer(reader, writer)
                else:
                    writer.write(answer)
                    await writer.drain()
            self.hung_up += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            self.hung_up += 1  # the client closed the connection mid-request
        finally:
            writer.close()


async def send(
    client: UpstreamClient,
    method: str = "GET",
    target: str = "/",
    body: bytes | AsyncIterator[bytes] | None = None,
    *,
    length: int | None = None,
    host: str | None = None,
    headers: CIMultiDict[str] | None = None,
    connect_timeout: float = RELAXED,
    read_timeout: float = RELAXED,
) -> UpstreamResponse:
    return await client.request(
        method, target, headers if headers is not None else CIMultiDict(), body,
        length=length, host=host, connect_timeout=connect_timeout, read_timeout=read_timeout,
    )


async def read_all(response: UpstreamResponse) -> bytes:
    chunks = []
    while chunk := await response.read():
        chunks.append(chunk)
    return b"".join(chunks)


async def fetch(client: UpstreamClient, *args, **kwargs) -> tuple[int, bytes]:
    """One whole exchange, released as the proxy releases it: (status, body)."""
    response = await send(client, *args, **kwargs)
    try:
        return response.status, await read_all(response)
    finally:
        client.release(response)


async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


def client_of(upstream: RawUpstream) -> contextlib.closing[UpstreamClient]:
    return contextlib.closing(UpstreamClient(upstream.url, None))


# Keep-alive


async def test_sequential_requests_reuse_one_connection() -> None:
    async with RawUpstream(OK, OK) as upstream:
        with client_of(upstream) as client:
            assert await fetch(client) == (200, b"ok")
            assert await fetch(client, "GET", "/second") == (200, b"ok")
        assert upstream.connections == 1
        assert len(upstream.requests) == 2


@pytest.mark.parametrize(
    "answer, reads",
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", 0),  # all arrived, none taken
        (b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (4 << 20, b"x" * (4 << 20)), 1),
    ],
    ids=["small body not taken", "large body read once"],
)
async def test_response_released_before_its_end_is_not_reused(answer: bytes, reads: int) -> None:
    async with RawUpstream(answer, OK) as upstream:
        with client_of(upstream) as client:
            response = await send(client)
            for _ in range(reads):
                assert await response.read()
            client.release(response)
            await eventually(lambda: upstream.hung_up == 1, what="the unfinished connection to be closed")
            assert await fetch(client) == (200, b"ok")
        assert upstream.connections == 2


async def test_response_with_connection_close_is_not_reused() -> None:
    closing_answer = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"
    async with RawUpstream(closing_answer, OK) as upstream:
        with client_of(upstream) as client:
            assert await fetch(client) == (200, b"ok")
            assert await fetch(client) == (200, b"ok")
        assert upstream.connections == 2


async def test_connection_idle_past_idle_seconds_is_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    async with RawUpstream(OK, OK) as upstream:
        with client_of(upstream) as client:
            assert await fetch(client) == (200, b"ok")
            monkeypatch.setattr(upstream_client, "IDLE_SECONDS", 0.0)  # every idle connection is now too old
            assert await fetch(client) == (200, b"ok")
            await eventually(lambda: upstream.hung_up == 1, what="the stale connection to be closed")
        assert upstream.connections == 2


# Strict framing of responses

GZIPPED = gzip.compress(b"ok")
AMBIGUOUS = {
    "Content-Length twice, same value": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nok",
    "Content-Length twice, different values": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok!",
    "Content-Length then chunked": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    "chunked then Content-Length": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    "Transfer-Encoding: gzip": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n" + GZIPPED,
    "Transfer-Encoding: gzip, chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
    % (len(GZIPPED), GZIPPED),
    "a control byte in a header value": b"HTTP/1.1 200 OK\r\nX-Note: a\x01b\r\nContent-Length: 2\r\n\r\nok",
    "a status line that is not HTTP": b"HTTP/9 OK\r\nContent-Length: 2\r\n\r\nok",
}


@pytest.mark.parametrize("answer", AMBIGUOUS.values(), ids=AMBIGUOUS.keys())
async def test_ambiguous_or_invalid_response_fails_and_its_connection_is_closed(answer: bytes) -> None:
    async with RawUpstream(answer, OK) as upstream:
        with client_of(upstream) as client:
            with pytest.raises(UpstreamFailed):
                await send(client)
            await eventually(lambda: upstream.hung_up == 1, what="the failed connection to be closed")
            assert await fetch(client) == (200, b"ok")
        assert upstream.connections == 2


PAST_THE_END = {
    "stray bytes": ("GET", OK + b"EXTRA", (200, b"ok")),
    "a second response": ("GET", OK + b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", (200, b"ok")),
    "a second response after a 204": (
        "GET", b"HTTP/1.1 204 No Content\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", (204, b""),
    ),
    "a body after a 304": ("GET", b"HTTP/1.1 304 Not Modified\r\n\r\nhello", (304, b"")),
    "a body after a HEAD response": ("HEAD", b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", (200, b"")),
}


@pytest.mark.parametrize("method, answer, announced", PAST_THE_END.values(), ids=PAST_THE_END.keys())
async def test_bytes_past_the_end_of_a_response_end_its_connection(
    method: str, answer: bytes, announced: tuple[int, bytes]
) -> None:
    """The response as framed may still be relayed, or fail: but nothing past its end
    reaches the caller, and the connection that carried it is never used again."""
    async with RawUpstream(answer, OK) as upstream:
        with client_of(upstream) as client:
            try:
                answered = await fetch(client, method)
            except UpstreamFailed:
                pass
            else:
                assert answered == announced
            assert await fetch(client) == (200, b"ok")
            assert upstream.connections == 2
            await eventually(lambda: upstream.hung_up == 1, what="the connection with extra bytes to be closed")


async def test_unsolicited_response_on_an_idle_connection_closes_it() -> None:
    later = asyncio.Event()

    async def answer_then_speak_unasked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(OK)
        await later.wait()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")

    async with RawUpstream(answer_then_speak_unasked, OK) as upstream:
        with client_of(upstream) as client:
            assert await fetch(client) == (200, b"ok")
            later.set()
            await eventually(lambda: upstream.hung_up == 1, what="the idle connection that spoke to be closed")
            assert await fetch(client) == (200, b"ok")
        assert upstream.connections == 2


# Response bodies

LARGE = bytes(range(256)) * 1200  # 300 KiB: more than one read


@pytest.mark.parametrize(
    "answer, body",
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(LARGE), LARGE), LARGE),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5\r\nhello\r\n6;note=1\r\n world\r\n%x\r\n%s\r\n0\r\nX-Trailer: t\r\n\r\n" % (len(LARGE), LARGE),
            b"hello world" + LARGE,
        ),
    ],
    ids=["Content-Length", "chunked"],
)
async def test_framed_body_is_read_whole_and_its_connection_kept(answer: bytes, body: bytes) -> None:
    async with RawUpstream(answer, OK) as upstream:
        with client_of(upstream) as client:
            assert await fetch(client) == (200, body)
            assert await fetch(client) == (200, b"ok")
        assert upstream.connections == 1


async def test_body_delimited_by_the_close_of_the_connection_is_read_whole() -> None:
    async with RawUpstream(Cut(b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n\r\n" + LARGE)) as upstream:
        with client_of(upstream) as client:
            assert await fetch(client) == (200, LARGE)


async def test_body_cut_short_of_its_content_length_fails() -> None:
    async with RawUpstream(Cut(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort")) as upstream:
        with client_of(upstream) as client:
            response = await send(client)
            with pytest.raises(UpstreamFailed):
                await read_all(response)
            client.release(response)


async def test_head_response_has_no_body_and_keeps_its_connection() -> None:
    async with RawUpstream(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nafter") as upstream:
        with client_of(upstream) as client:
            response = await send(client, "HEAD")
            assert response.headers["Content-Length"] == "1000"
            assert await read_all(response) == b""
            client.release(response)
            assert await fetch(client) == (200, b"after")
        assert upstream.connections == 1


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 204 No Content\r\n\r\n",
        b'HTTP/1.1 304 Not Modified\r\nETag: "v1"\r\n\r\n',
        b'HTTP/1.1 304 Not Modified\r\nETag: "v1"\r\nContent-Length: 5\r\n\r\n',  # the length of the cached body
    ],
    ids=["204", "304", "304 with Content-Length"],
)
async def test_204_and_304_have_no_body_and_keep_their_connection(answer: bytes) -> None:
    async with RawUpstream(answer, OK) as upstream:
        with client_of(upstream) as client:
            status, body = await fetch(client)
            assert status in (204, 304) and body == b""
            assert await fetch(client) == (200, b"ok")
        assert upstream.connections == 1


async def test_interim_responses_are_skipped() -> None:
    answer = (
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"
        b"HTTP/1.1 201 Created\r\nContent-Length: 4\r\n\r\nmade"
    )
    async with RawUpstream(answer, OK) as upstream:
        with client_of(upstream) as client:
            response = await send(client, "PUT", "/thing", b"data", length=4)
            assert (response.status, response.reason) == (201, "Created")
            assert "Link" not in response.headers
            assert await read_all(response) == b"made"
            client.release(response)
            assert await fetch(client) == (200, b"ok")
        assert upstream.connections == 1


async def test_interim_responses_in_separate_writes_are_skipped() -> None:
    async def hints_then_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for part in (b"HTTP/1.1 103 Early Hints\r\nLink: </a.js>; rel=preload\r\n\r\n", b"HTTP/1.1 100 Continue\r\n\r\n", OK):
            writer.write(part)
            await writer.drain()

    async with RawUpstream(hints_then_answer) as upstream:
        with client_of(upstream) as client:
            assert await fetch(client) == (200, b"ok")


# Request framing, as the upstream receives it


def authority(upstream: RawUpstream) -> bytes:
    return b"Host: 127.0.0.1:%d\r\n" % upstream.port


FRAMINGS = {
    "bytes with a length": ("POST", lambda: b"hello", 5, b"Content-Length: 5\r\n\r\nhello"),
    "streamed with a length": ("PUT", lambda: chunks(b"he", b"", b"llo"), 5, b"Content-Length: 5\r\n\r\nhello"),
    # The empty part must not be written as a chunk: 0\r\n\r\n would end the body early.
    "streamed without a length": (
        "POST", lambda: chunks(b"he", b"", b"llo"), None,
        b"Transfer-Encoding: chunked\r\n\r\n2\r\nhe\r\n3\r\nllo\r\n0\r\n\r\n",
    ),
    "empty bytes without a length": ("POST", lambda: b"", None, b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
    "bytes without a length": ("PATCH", lambda: b"hello", None, b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"),
    "POST without a body": ("POST", lambda: None, None, b"Content-Length: 0\r\n\r\n"),
    "GET without a body": ("GET", lambda: None, None, b"\r\n"),
    "DELETE without a body": ("DELETE", lambda: None, None, b"\r\n"),
}


@pytest.mark.parametrize("method, body, length, framing", FRAMINGS.values(), ids=FRAMINGS.keys())
async def test_request_body_framing_on_the_wire(method: str, body, length: int | None, framing: bytes) -> None:
    async with RawUpstream(OK) as upstream:
        with client_of(upstream) as client:
            assert await fetch(client, method, "/p?q=1", body(), length=length) == (200, b"ok")
        assert upstream.requests == [b"%s /p?q=1 HTTP/1.1\r\n%s%s" % (method.encode(), authority(upstream), framing)]


async def test_request_head_carries_headers_in_order_and_the_given_host() -> None:
    headers = CIMultiDict([("Accept", "text/plain"), ("X-Two", "1"), ("X-Two", "2"), ("X-Name", "caf\udcc3\udca9")])
    async with RawUpstream(OK) as upstream:
        with client_of(upstream) as client:
            assert await fetch(client, "GET", "/", headers=headers, host="api.example.com") == (200, b"ok")
        # A header value the server decoded with surrogateescape leaves as the bytes it came as.
        assert upstream.requests == [
            b"GET / HTTP/1.1\r\nHost: api.example.com\r\nAccept: text/plain\r\nX-Two: 1\r\nX-Two: 2\r\nX-Name: caf\xc3\xa9\r\n\r\n"
        ]


async def test_url_base_path_and_user_information_reach_the_upstream() -> None:
    async with RawUpstream(OK) as upstream:
        url = f"http://alice:s%3Acret@127.0.0.1:{upstream.port}/base/"
        with contextlib.closing(UpstreamClient(url, None)) as client:
            assert await fetch(client, "GET", "/items") == (200, b"ok")
        credentials = base64.b64encode(b"alice:s:cret")
        assert upstream.requests == [
            b"GET /base/items HTTP/1.1\r\n%sAuthorization: Basic %s\r\n\r\n" % (authority(upstream), credentials)
        ]


async def test_the_urls_user_information_replaces_the_requests_authorization() -> None:
    headers = CIMultiDict([("authorization", "Bearer client"), ("X-One", "1"), ("Authorization", "Basic bWU6eA==")])
    async with RawUpstream(OK) as upstream:
        with contextlib.closing(UpstreamClient(f"http://alice:pw@127.0.0.1:{upstream.port}", None)) as client:
            assert await fetch(client, "GET", "/", headers=headers) == (200, b"ok")
        credentials = base64.b64encode(b"alice:pw")
        assert upstream.requests == [
            b"GET / HTTP/1.1\r\n%sX-One: 1\r\nAuthorization: Basic %s\r\n\r\n" % (authority(upstream), credentials)
        ]


def test_default_port_is_left_out_of_the_host_header() -> None:
    assert upstream_client.Endpoint.of("http://example.com:80/", None).authority == "example.com"
    assert upstream_client.Endpoint.of("https://example.com/", None).authority == "example.com"
    assert upstream_client.Endpoint.of("https://example.com:8443", None).authority == "example.com:8443"
    assert upstream_client.Endpoint.of("http://[::1]:8080", None).authority == "[::1]:8080"


# The retry rule: once more on a new connection, only when the request may be sent twice


@pytest.mark.parametrize("method, body", [("GET", None), ("PUT", b"hello"), ("DELETE", None)])
async def test_idempotent_request_lost_by_a_kept_connection_is_sent_once_more(method: str, body: bytes | None) -> None:
    async with RawUpstream(OK, CLOSE, OK) as upstream:
        with client_of(upstream) as client:
            assert await fetch(client) == (200, b"ok")
            length = None if body is None else len(body)
            assert await fetch(client, method, "/again", body, length=length) == (200, b"ok")
        assert upstream.connections == 2
        assert len(upstream.requests) == 3
        assert upstream.requests[1] == upstream.requests[2]


async def test_idempotent_request_is_sent_at_most_twice() -> None:
    async with RawUpstream(OK, CLOSE, CLOSE) as upstream:
        with client_of(upstream) as client:
            assert await fetch(client) == (200, b"ok")
            with pytest.raises(UpstreamFailed):
                await send(client, "GET", "/again")
        assert upstream.connections == 2
        assert len(upstream.requests) == 3


async def test_post_lost_by_a_kept_connection_is_not_resent() -> None:
    async with RawUpstream(OK, CLOSE) as upstream:
        with client_of(upstream) as client:
            assert await fetch(client) == (200, b"ok")
            with pytest.raises(UpstreamFailed):
                await send(client, "POST", "/order", b"one", length=3)
        assert upstream.connections == 1
        assert len(upstream.requests) == 2


async def test_streamed_body_lost_by_a_kept_connection_is_not_resent() -> None:
    pulled = 0

    async def body() -> AsyncIterator[bytes]:
        nonlocal pulled
        for part in (b"he", b"llo"):
            pulled += 1
            yield part

    async with RawUpstream(OK, CLOSE) as upstream:
        with client_of(upstream) as client:
            assert await fetch(client) == (200, b"ok")
            with pytest.raises(UpstreamFailed):
                await send(client, "PUT", "/file", body(), length=5)
        assert upstream.connections == 1
        assert len(upstream.requests) == 2
        assert pulled == 2


async def test_request_lost_after_the_answer_began_is_not_resent() -> None:
    async with RawUpstream(OK, Cut(b"HTTP/1.1 200 OK\r\nContent-")) as upstream:
        with client_of(upstream) as client:
            assert await fetch(client) == (200, b"ok")
            with pytest.raises(UpstreamFailed):
                await send(client, "GET", "/again")
        assert upstream.connections == 1


async def test_request_lost_by_a_new_connection_is_not_resent() -> None:
    async with RawUpstream(CLOSE) as upstream:
        with client_of(upstream) as client:
            with pytest.raises(UpstreamFailed):
                await send(client, "GET")
        assert upstream.connections == 1


# Backpressure


class Flood(asyncio.Protocol):
    """Answers its one request with `total` body bytes, handed to its transport one 64 KiB
    piece per loop iteration: a client that keeps reading keeps the write buffer near
    empty, so a large buffer means the client stopped reading."""

    PIECE = b"x" * (64 * 1024)

    def __init__(self, total: int) -> None:
        self.total = total
        self.handed = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.handed == 0 and data.endswith(b"\r\n\r\n"):
            assert self.transport is not None
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % self.total)
            self._hand()

    def _hand(self) -> None:
        assert self.transport is not None
        if self.handed < self.total and not self.transport.is_closing():
            self.transport.write(self.PIECE)
            self.handed += len(self.PIECE)
            asyncio.get_running_loop().call_soon(self._hand)


async def test_unread_response_stops_being_read_from_the_upstream() -> None:
    total = 32 * 1024 * 1024
    flood = Flood(total)
    server = await asyncio.get_running_loop().create_server(lambda: flood, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        with contextlib.closing(UpstreamClient(f"http://127.0.0.1:{port}", None)) as client:
            response = await send(client)

            def upstream_blocked() -> bool:
                # Loopback's socket buffers hold a few MiB (tcp_wmem's ceiling is 4 MiB):
                # the rest can only be waiting because the client stopped reading.
                assert flood.transport is not None
                return flood.handed == total and flood.transport.get_write_buffer_size() >= 8 * 1024 * 1024

            await eventually(upstream_blocked, what="the upstream's writes to back up")
            held = response.take()
            assert len(held) <= HIGH_WATER + ONE_READ
            received = len(held) + len(await read_all(response))
            assert received == total
            client.release(response)
    finally:
        server.close()
        await server.wait_closed()


class Deaf(asyncio.Protocol):
    """Accepts a connection and never reads from it, nor answers."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.pause_reading()  # type: ignore[attr-defined]


async def test_body_the_upstream_does_not_take_stops_being_pulled() -> None:
    piece = b"y" * (64 * 1024)
    total_pieces = 1024  # 64 MiB: far more than the socket buffers between the two hold
    pulled = 0

    async def body() -> AsyncIterator[bytes]:
        nonlocal pulled
        for _ in range(total_pieces):
            pulled += 1
            yield piece

    server = await asyncio.get_running_loop().create_server(Deaf, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        with contextlib.closing(UpstreamClient(f"http://127.0.0.1:{port}", None)) as client:
            # The read timeout counts from the last byte sent: it fires once the sender has
            # been paused for that long, which is the moment to count what was pulled.
            with pytest.raises(UpstreamTimeout):
                await send(client, "PUT", "/upload", body(), length=total_pieces * len(piece), read_timeout=1.0)
        assert 0 < pulled * len(piece) <= 16 * 1024 * 1024
    finally:
        server.close()
        await server.wait_closed()


# Timeouts and failures


async def test_connect_to_a_full_backlog_times_out() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        # Linux queues one connection for a backlog of 0 and drops the SYNs of the next ones.
        with socket.create_connection(listener.getsockname()):
            with contextlib.closing(UpstreamClient(f"http://127.0.0.1:{listener.getsockname()[1]}", None)) as client:
                with pytest.raises(ConnectFailed) as failed:
                    await send(client, connect_timeout=0.3)
    assert failed.value.timed_out


async def test_refused_connection_fails_without_timing_out() -> None:
    with contextlib.closing(UpstreamClient(f"http://127.0.0.1:{free_port()}", None)) as client:
        with pytest.raises(ConnectFailed) as failed:
            await send(client)
    assert not failed.value.timed_out


async def test_upstream_that_never_answers_times_out() -> None:
    async with RawUpstream(SILENT) as upstream:
        with client_of(upstream) as client:
            with pytest.raises(UpstreamTimeout):
                await send(client, read_timeout=0.2)
            await eventually(lambda: upstream.hung_up == 1, what="the timed-out connection to be closed")


async def test_upstream_that_stops_mid_body_times_out() -> None:
    async def start_then_stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nab")
        await reader.read()

    async with RawUpstream(start_then_stall) as upstream:
        with client_of(upstream) as client:
            response = await send(client, read_timeout=0.2)
            with pytest.raises(UpstreamTimeout):
                await read_all(response)
            client.release(response)
            await eventually(lambda: upstream.hung_up == 1, what="the stalled connection to be closed")


async def test_body_source_that_fails_gives_body_failed() -> None:
    async def body() -> AsyncIterator[bytes]:
        yield b"first"
        raise ConnectionResetError("the client went away")

    async with RawUpstream() as upstream:
        with client_of(upstream) as client:
            with pytest.raises(BodyFailed):
                await send(client, "POST", "/upload", body())
            await eventually(lambda: upstream.hung_up == 1, what="the connection with half a body to be closed")
        assert upstream.requests == []


# close()


async def test_close_closes_idle_connections() -> None:
    async with RawUpstream(OK) as upstream:
        client = UpstreamClient(upstream.url, None)
        assert await fetch(client) == (200, b"ok")
        assert upstream.hung_up == 0
        client.close()
        assert client.closed
        await eventually(lambda: upstream.hung_up == 1, what="the idle connection to be closed")


async def test_connection_in_use_at_close_is_closed_on_release() -> None:
    async with RawUpstream(OK) as upstream:
        client = UpstreamClient(upstream.url, None)
        response = await send(client)
        client.close()
        assert await read_all(response) == b"ok"
        client.release(response)
        await eventually(lambda: upstream.hung_up == 1, what="the released connection to be closed")
