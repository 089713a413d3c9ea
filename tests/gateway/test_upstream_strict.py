"""The upstream client against raw-socket upstreams that write exact bytes a malicious or
broken server would: framing it refuses, heads past their bounds, bytes when no
response is expected, and that a failed connection is freed at once.

What the tests prove:
- a transfer-coding list that is not exactly `chunked`, a status outside 100–599, a
  version other than HTTP/1.0 and HTTP/1.1 and a control byte in the reason phrase fail
  with UpstreamFailed, and their
  connection is closed, never reused;
- a response head past `HeadBounds` (bytes or header lines) fails at once, however the
  upstream goes on, and its connection is closed; a head at the bounds is read whole;
- bytes arriving when no response is expected (after a HEAD or 204 response, released
  or not) close the connection, and the next request goes out on a new one;
- after each kind of failure, the connection is freed by reference counting alone,
  with the gateway's gc settings (gateway.server), not at some later full collection.

The upstreams and helpers are test_upstream_client.py's; nothing is mocked."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from types import TracebackType

import pytest

from gateway.server import GC_YOUNG_THRESHOLD
from gateway.upstream.client import UpstreamClient
from gateway.upstream.connection import HeadBounds, UpstreamConnection
from gateway.upstream.errors import BodyFailed, ConnectFailed, UpstreamError, UpstreamFailed, UpstreamTimeout
from tests.gateway.test_upstream_client import OK, SILENT, Cut, RawUpstream, client_of, fetch, read_all, send
from tests.processes import eventually, free_port

CHUNKED_OK = b"2\r\nok\r\n0\r\n\r\n"
REFUSED = {
    "Transfer-Encoding: chunked, identity": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, identity\r\n\r\n" + CHUNKED_OK,
    "Transfer-Encoding: identity": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: identity\r\n\r\n" + CHUNKED_OK,
    "Transfer-Encoding: chunked, then a line of identity": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n\r\n" + CHUNKED_OK
    ),
    "Transfer-Encoding: chunked, chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, chunked\r\n\r\n" + CHUNKED_OK,
    "Transfer-Encoding in HTTP/1.0": b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + CHUNKED_OK,
    "status 000": b"HTTP/1.1 000 Zero\r\nContent-Length: 2\r\n\r\nok",
    "status 099": b"HTTP/1.1 099 Low\r\nContent-Length: 2\r\n\r\nok",
    "status 600": b"HTTP/1.1 600 High\r\nContent-Length: 2\r\n\r\nok",
    "HTTP/2.0": b"HTTP/2.0 200 OK\r\nContent-Length: 2\r\n\r\nok",
    "HTTP/2.0 after an interim HTTP/1.1 head": b"HTTP/1.1 100 Continue\r\n\r\nHTTP/2.0 200 OK\r\nContent-Length: 2\r\n\r\nok",
    "HTTP/1.2": b"HTTP/1.2 200 OK\r\nContent-Length: 2\r\n\r\nok",
    "HTTP/0.9 status line": b"HTTP/0.9 200 OK\r\nContent-Length: 2\r\n\r\nok",
    # llhttp lets control bytes through in a reason phrase, and nowhere else in a head.
    "a control byte in the reason phrase": b"HTTP/1.1 200 O\x01K\r\nContent-Length: 2\r\n\r\nok",
    "DEL in the reason phrase, no body": b"HTTP/1.1 204 No\x7fContent\r\n\r\n",
}


@pytest.mark.parametrize("answer", REFUSED.values(), ids=REFUSED.keys())
async def test_strictly_refused_response_fails_and_its_connection_is_closed(answer: bytes) -> None:
    async with RawUpstream(answer, OK) as upstream:
        with client_of(upstream) as client:
            with pytest.raises(UpstreamFailed):
                await fetch(client)  # never the raw chunks as a body, never a status of 0
            await eventually(lambda: upstream.hung_up == 1, what="the refused connection to be closed")
            assert await fetch(client) == (200, b"ok")
        assert upstream.connections == 2


async def test_http_1_0_response_is_read_and_kept_only_with_keep_alive() -> None:
    kept = b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok"
    closing = b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok"
    async with RawUpstream(kept, closing, OK) as upstream:
        with client_of(upstream) as client:
            for _ in range(3):
                assert await fetch(client) == (200, b"ok")
        assert upstream.connections == 2


# Bounded heads

LINES_OF = {n: b"".join(b"X-H%d: v\r\n" % i for i in range(n)) for n in (100, 101, 100_000)}


def head(lines: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\n" + lines + b"Content-Length: 2\r\n\r\nok"


PAST_THE_BOUNDS = {
    "a 1 MB header value": head(b"X-Big: " + b"v" * 1_000_000 + b"\r\n"),
    "100,000 header lines": head(LINES_OF[100_000]),
    "101 header lines": b"HTTP/1.1 200 OK\r\n" + LINES_OF[101] + b"\r\n",
    "64 KiB of header lines": head(b"".join(b"X-H%d: " % i + b"v" * 1000 + b"\r\n" for i in range(66))),
    "100,000 interim heads": b"HTTP/1.1 100 Continue\r\n\r\n" * 100_000 + OK,
}


@pytest.mark.parametrize("answer", PAST_THE_BOUNDS.values(), ids=PAST_THE_BOUNDS.keys())
async def test_head_past_its_bounds_fails_and_its_connection_is_closed(answer: bytes) -> None:
    async with RawUpstream(answer, OK) as upstream:
        with client_of(upstream) as client:
            with pytest.raises(UpstreamFailed, match="upstream_max_header"):
                await send(client)
            await eventually(lambda: upstream.hung_up == 1, what="the connection past the bounds to be closed")
            assert await fetch(client) == (200, b"ok")
        assert upstream.connections == 2


async def test_head_at_its_bounds_is_read_whole() -> None:
    # 99 lines here and Content-Length: 100 lines; 63 of 1,009 bytes and the rest: 63,965 bytes.
    lines = b"".join(b"X-H%02d: " % i + b"v" * 1000 + b"\r\n" for i in range(63))
    lines += b"".join(b"X-S%02d: v\r\n" % i for i in range(36))
    async with RawUpstream(head(lines)) as upstream:
        with client_of(upstream) as client:
            response = await send(client)
            assert len(response.headers) == 100
            assert await read_all(response) == b"ok"
            client.release(response)


async def test_bounds_are_the_clients_own() -> None:
    async with RawUpstream(head(b"X-A: 1\r\nX-B: 2\r\n"), head(b"X-" + b"v" * 200 + b": 1\r\n")) as upstream:
        with contextlib.closing(UpstreamClient(upstream.url, None, HeadBounds(max_size=100, max_lines=2))) as client:
            with pytest.raises(UpstreamFailed, match="upstream_max_header_lines"):
                await send(client)
            with pytest.raises(UpstreamFailed, match="upstream_max_header_size"):
                await send(client)


async def endless_header_lines(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Header lines until the client hangs up."""
    writer.write(b"HTTP/1.1 200 OK\r\n")
    with contextlib.suppress(ConnectionError):
        for i in range(100_000):
            writer.write(b"".join(b"X-Endless-%d-%d: %s\r\n" % (i, j, b"v" * 100) for j in range(100)))
            await writer.drain()
            await asyncio.sleep(0)  # drain() does not yield while the socket takes it all


async def test_endless_head_fails_before_the_read_timeout_and_the_upstream_is_cut_off() -> None:
    async with RawUpstream(endless_header_lines) as upstream:
        with client_of(upstream) as client:
            with pytest.raises(UpstreamFailed, match="upstream_max_header"):
                await send(client, read_timeout=3600)  # the bound answers, not the timeout
            await eventually(lambda: upstream.hung_up == 1, what="the endless upstream to be cut off")


# Bytes when no response is expected


def late(first: bytes, later_bytes: bytes, go: asyncio.Event) -> Callable:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(first)
        await go.wait()
        writer.write(later_bytes)

    return answer


LATE = {
    "a body after a HEAD response": ("HEAD", b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", b"hello"),
    "a body after a 204": ("GET", b"HTTP/1.1 204 No Content\r\n\r\n", b"hello"),
    "a second response": ("GET", OK, b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nevil"),
}


@pytest.mark.parametrize("released", [True, False], ids=["released", "not yet released"])
@pytest.mark.parametrize("method, first, later_bytes", LATE.values(), ids=LATE.keys())
async def test_bytes_after_a_response_close_its_connection(method: str, first: bytes, later_bytes: bytes, released: bool) -> None:
    go = asyncio.Event()
    async with RawUpstream(late(first, later_bytes, go), OK) as upstream:
        with client_of(upstream) as client:
            response = await send(client, method)
            await read_all(response)
            if released:
                client.release(response)
            go.set()
            await eventually(lambda: upstream.hung_up == 1, what="the connection that spoke unasked to be closed")
            if not released:
                client.release(response)
            assert await fetch(client) == (200, b"ok")  # not "evil", not "hello"
        assert upstream.connections == 2


# Nothing kept after a failure


@contextlib.contextmanager
def gateway_gc() -> Iterator[None]:
    """The gateway's gc settings (gateway.server.serve: freeze, then a young threshold of
    GC_YOUNG_THRESHOLD), with collection off while the test runs: what is freed then is
    freed by reference counting, as the gateway can count on."""
    threshold = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *threshold[1:])
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.set_threshold(*threshold)
        gc.unfreeze()


def connection_in(traceback: TracebackType | None) -> weakref.ref[UpstreamConnection]:
    """A weak reference to the connection a failure's traceback went through, past the
    catching frame (whose locals, read here, hold the exception: a cycle of the test's own)."""
    traceback = traceback.tb_next if traceback is not None else None
    while traceback is not None:
        for value in traceback.tb_frame.f_locals.values():
            candidate = getattr(value, "_connection", value)
            if isinstance(candidate, UpstreamConnection):
                return weakref.ref(candidate)
        traceback = traceback.tb_next
    raise AssertionError("no connection in the traceback")


async def failed_attempt(upstream: RawUpstream | None, expected: type[UpstreamError], **kwargs) -> weakref.ref[UpstreamConnection]:
    """One request that fails with `expected`, as the proxy makes and releases it."""
    url = upstream.url if upstream is not None else f"http://127.0.0.1:{free_port()}"
    client = UpstreamClient(url, None)
    try:
        response = await send(client, **kwargs)
        try:
            await read_all(response)
        finally:
            client.release(response)
    except expected as exc:
        return connection_in(exc.__traceback__)
    finally:
        client.close()
    raise AssertionError(f"no {expected.__name__}")


async def failing_body() -> AsyncIterator[bytes]:
    yield b"a"
    raise OSError("the client went away")


FAILURES = {
    "bad framing": ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: identity\r\n\r\n" + CHUNKED_OK], UpstreamFailed, {}),
    "invalid response": ([b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok"], UpstreamFailed, {}),
    "reset mid-body": ([Cut(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello")], UpstreamFailed, {}),
    "closed before an answer": ([Cut()], UpstreamFailed, {}),
    "timeout": ([SILENT], UpstreamTimeout, {"read_timeout": 0.05}),
    "head past its bound": ([head(LINES_OF[100_000])], UpstreamFailed, {}),
    "endless head": ([endless_header_lines], UpstreamFailed, {}),
    "body source failed": ([SILENT], BodyFailed, {"method": "POST", "body": "failing"}),
    "connect refused": (None, ConnectFailed, {}),
}


@pytest.mark.parametrize("answers, expected, kwargs", FAILURES.values(), ids=FAILURES.keys())
async def test_failed_connection_is_freed_without_a_collection(answers, expected, kwargs) -> None:
    if kwargs.get("body") == "failing":
        kwargs = {**kwargs, "body": failing_body()}
    with gateway_gc():
        if answers is None:
            connection = await failed_attempt(None, expected, **kwargs)
        else:
            async with RawUpstream(*answers) as upstream:
                connection = await failed_attempt(upstream, expected, **kwargs)
        await eventually(lambda: connection() is None, what="the failed connection to be freed")


async def test_connection_closed_for_bytes_while_idle_is_freed_without_a_collection() -> None:
    go = asyncio.Event()
    with gateway_gc():
        async with RawUpstream(late(OK, b"unasked", go)) as upstream:
            with client_of(upstream) as client:
                response = await send(client)
                connection = weakref.ref(response._connection)
                await read_all(response)
                client.release(response)
                del response
                go.set()
                await eventually(lambda: upstream.hung_up == 1, what="the connection that spoke unasked to be closed")
            # The client's idle list held it, closed, until its next request or its close.
            await eventually(lambda: connection() is None, what="the connection that spoke unasked to be freed")


async def test_connection_closed_after_serving_is_freed_without_a_collection() -> None:
    with gateway_gc():
        async with RawUpstream(OK) as upstream:
            with client_of(upstream) as client:
                response = await send(client)
                connection = weakref.ref(response._connection)
                assert await read_all(response) == b"ok"
                client.release(response)
                del response
            await eventually(lambda: upstream.hung_up == 1, what="the idle connection to be closed")
            await eventually(lambda: connection() is None, what="the closed connection to be freed")
