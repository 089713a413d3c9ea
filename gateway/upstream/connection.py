"""One keep-alive HTTP/1.1 connection to an upstream, as an `asyncio.Protocol`: the
request's head and body written with backpressure (gateway.upstream.flow_control), the
response parsed by llhttp (httptools), its body held in bounded chunks (`HIGH_WATER`),
and the errors every failure leaves as. `gateway.upstream.client` keeps the idle ones.

Each request and its response are one `Exchange`: the connection holds the current one,
so readying it for the next is one assignment, and a late callback of an earlier
exchange (its body's sender, a timer) finds it is no longer current and does nothing.

Trusts nothing an upstream sends: a response head past its bounds (`HeadBounds`), a
framing gateway.upstream.framing refuses, or bytes llhttp refuses fail the attempt with
UpstreamFailed, and bytes that arrive when no response is expected close the connection.
A failed connection keeps no exception: each is raised fresh, so no traceback holds the
connection in a reference cycle that only a full collection would free.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterable
from dataclasses import dataclass
from functools import partial

import httptools
from multidict import CIMultiDict

from gateway.config.http_names import HOP_BY_HOP
from gateway.config.model import DEFAULT_UPSTREAM_MAX_HEADER_LINES, DEFAULT_UPSTREAM_MAX_HEADER_SIZE
from gateway.upstream.body import RequestBody
from gateway.upstream.errors import BodyFailed, UpstreamError, UpstreamFailed, UpstreamTimeout
from gateway.upstream.flow_control import FlowControl
from gateway.upstream.framing import Framing, body_framing, check_status_line, keep_alive, transfer_codings

# Bytes of response body held unread before the upstream is paused: as many as one stream
# chunk, so 1,000 slow clients hold ~64 MB at most (plus one read each).
HIGH_WATER = 64 * 1024
# RFC 9110 §7.6.1: fields of one connection, never relayed (gateway.config.http_names.HOP_BY_HOP as bytes).
_HOP_BY_HOP = frozenset(name.encode() for name in HOP_BY_HOP)
_LAST_CHUNK = b"0\r\n\r\n"
_REASON_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_CLOSE, _NO_BODY = Framing.CLOSE, Framing.NONE


@dataclass(frozen=True, slots=True)
class HeadBounds:
    """What one response head may take: bytes (status line and header lines, interim
    heads included) and header lines. Past either, the attempt fails."""

    max_size: int = DEFAULT_UPSTREAM_MAX_HEADER_SIZE
    max_lines: int = DEFAULT_UPSTREAM_MAX_HEADER_LINES


DEFAULT_BOUNDS = HeadBounds()


class UpstreamResponse:
    """The status line and end-to-end headers of an upstream's answer (hop-by-hop fields,
    and those its Connection names, removed), and its body as it arrives."""

    __slots__ = ("_connection", "_exchange", "headers", "reason", "status")

    def __init__(self, status: int, reason: str, headers: CIMultiDict[str], connection: UpstreamConnection, exchange: Exchange) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        self._connection = connection
        self._exchange = exchange

    @property
    def arrived(self) -> bool:
        """Whether the whole body is here already, as a small answer's usually is."""
        return self._exchange.complete

    def take(self) -> bytes:
        """Every body byte received and not yet taken."""
        return self._connection.take(self._exchange)

    async def read(self) -> bytes:
        """The next body bytes, as many as have arrived (at most about HIGH_WATER plus one
        read); b"" once the body has ended. Raises UpstreamTimeout or UpstreamFailed."""
        exchange = self._exchange
        if not exchange.buffered and not exchange.complete:
            await self._connection.wait(exchange)
        return self._connection.take(exchange)


class Exchange:
    """One request and its response: everything that is reset between two of them."""

    __slots__ = (
        "answering", "buffered", "chunks", "complete", "framing", "head", "head_only", "head_received",
        "interim", "interim_size", "keep_alive", "names_values", "read_timeout", "reason", "sender", "version", "waiter",
    )

    def __init__(self, head_only: bool, read_timeout: float) -> None:
        self.head_only = head_only  # a HEAD request: its response has no body, whatever it says
        self.read_timeout = read_timeout
        self.answering = False  # some byte of the answer has arrived
        self.complete = False  # the response's body has ended
        # The final head once parsed: status, reason, end-to-end headers. Not the response,
        # which holds the connection: the connection holds this, and a cycle would outlive it.
        self.head: tuple[int, str, CIMultiDict[str]] | None = None
        self.framing = _CLOSE
        self.keep_alive = False
        self.interim = False  # the head being parsed is a 1xx to skip
        # "1.1" when the answer's first read begins "HTTP/1.1 ", until an interim head ends:
        # llhttp's get_http_version formats a string, the dearest call of a response.
        self.version: str | None = None
        self.reason = b""
        self.names_values: list[tuple[bytes, bytes]] = []
        self.head_received = 0  # bytes of the reads that ended inside a head, interim heads included
        self.interim_size = 0  # bytes of the interim heads parsed, and of the final one once summed
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.waiter: asyncio.Future[None] | None = None
        self.sender: asyncio.Task[None] | None = None


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive connection, carrying one exchange at a time. llhttp calls the
    `on_*` methods as the response's bytes are fed to it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, bounds: HeadBounds = DEFAULT_BOUNDS) -> None:
        self._loop = loop
        self._bounds = bounds
        self._transport: asyncio.Transport | None = None
        self._flow: FlowControl | None = None
        # llhttp calls this connection's bound methods: a cycle, made once connected and
        # broken when the connection is lost.
        self._parser: httptools.HttpResponseParser | None = None
        self.open = False
        self._exchange: Exchange | None = None
        # Why the connection broke, as (kind, message): an exception kept here would hold,
        # through its traceback, the frame that raised it and so this connection.
        self._failure: tuple[type[UpstreamError], str] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._last_progress = 0.0
        self._read_size = 0  # bytes of the read being parsed

    @property
    def answering(self) -> bool:
        """Some byte of the current exchange's answer has arrived."""
        return self._exchange is not None and self._exchange.answering

    # asyncio's side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._flow = FlowControl(self._transport)  # type: ignore[arg-type]
        self._parser = httptools.HttpResponseParser(self)
        self.open = True

    def data_received(self, data: bytes) -> None:
        self._last_progress = self._loop.time()
        exchange = self._exchange
        if exchange is None or exchange.complete or (exchange.head is None and exchange.waiter is None):
            # Bytes nobody asked for (an idle connection, or past a response): never reuse it.
            self._fail(UpstreamFailed, "the upstream sent bytes outside a response")
            return
        if not exchange.answering:
            exchange.answering = True
            if data.startswith(b"HTTP/1.1 "):
                exchange.version = "1.1"
        self._read_size = len(data)
        try:
            self._parser.feed_data(data)  # type: ignore[union-attr]  # None only once the connection is lost
        except httptools.HttpParserError as exc:
            # A callback's own refusal is the context of llhttp's "User callback error".
            self._fail(UpstreamFailed, f"invalid response: {exc.__context__ or exc}")
            return
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamFailed, "the upstream switched protocols")
            return
        if exchange.head is None:
            # Every byte of this read was head: llhttp holds a line's unfinished part, and the
            # lines parsed so far are held too, so the bounds are checked here as well, at
            # most one read past them.
            exchange.head_received += len(data)
            bounds = self._bounds
            if exchange.head_received > bounds.max_size:
                self._fail(UpstreamFailed, f"the response head is past upstream_max_header_size ({bounds.max_size} bytes)")
            elif len(exchange.names_values) > bounds.max_lines:
                self._fail(UpstreamFailed, f"the response head is past upstream_max_header_lines ({bounds.max_lines} lines)")

    def eof_received(self) -> bool:
        return False  # a half-closed connection is closed: HTTP/1.1 has no use for it

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        self._parser = None
        exchange = self._exchange
        if exchange is not None and exchange.head is not None and exchange.framing is _CLOSE and not exchange.complete:
            exchange.complete = True  # a body delimited by the close of the connection (RFC 9112 §6.3)
            self._wake(exchange)
        elif exchange is None or not exchange.complete or exchange.head is None:
            self._fail(UpstreamFailed, str(exc) if exc else "the upstream closed the connection")
        if self._flow is not None:
            self._flow.resume_writing()
        self._cancel_timer()

    def pause_writing(self) -> None:
        if self._flow is not None:
            self._flow.pause_writing()

    def resume_writing(self) -> None:
        self._last_progress = self._loop.time()
        if self._flow is not None:
            self._flow.resume_writing()

    # llhttp's side: data_received feeds it only while an exchange is current (hence the ignores).

    def on_message_begin(self) -> None:
        if self._exchange.complete:  # type: ignore[union-attr]
            # A second response to one request (llhttp would parse it as the next) desyncs the connection.
            raise UpstreamFailed("bytes past the end of a response")

    def on_status(self, reason: bytes) -> None:
        self._exchange.reason += reason  # type: ignore[union-attr]

    def on_header(self, name: bytes, value: bytes) -> None:
        self._exchange.names_values.append((name, value))  # type: ignore[union-attr]  # counted in _check_head

    def on_headers_complete(self) -> None:
        exchange: Exchange = self._exchange  # type: ignore[assignment]
        parser: httptools.HttpResponseParser = self._parser  # type: ignore[assignment]
        status = parser.get_status_code()
        version = exchange.version or parser.get_http_version()
        if status < 200:
            check_status_line(version, status)
            self._check_head(exchange, interim=True)
            # Interim answers (100 Continue, 103 Early Hints) are dropped, as nginx and Envoy drop them.
            exchange.interim = True
            exchange.names_values.clear()
            exchange.reason = b""
            exchange.version = None  # the next head's is read from llhttp
            return
        bounds = self._bounds
        if len(exchange.names_values) > bounds.max_lines or exchange.head_received + self._read_size > bounds.max_size:
            self._check_head(exchange, interim=False)
        pairs = []
        codings: list[bytes] | None = None
        content_length = False
        tokens: list[bytes] = []  # what Connection names, lower-cased
        for name, value in exchange.names_values:
            lowered = name.lower()
            if lowered in _HOP_BY_HOP:
                if lowered == b"transfer-encoding":
                    codings = (codings or []) + transfer_codings((value,))
                elif lowered == b"connection":
                    tokens += [token.strip().lower() for token in value.split(b",")]
                continue
            if lowered == b"content-length":
                content_length = True
            # As aiohttp decodes them: the bytes go back out unchanged.
            pairs.append((name.decode("latin-1"), value.decode("utf-8", "surrogateescape")))
        exchange.names_values.clear()
        framing = exchange.framing = body_framing(exchange.head_only, status, version, codings, content_length)
        exchange.keep_alive = keep_alive(version, tokens, framing)
        headers: CIMultiDict[str] = CIMultiDict(pairs)
        for token in tokens:
            if token:
                headers.popall(token.decode("latin-1"), None)
        reason = exchange.reason
        if not reason.isalpha() and _REASON_CONTROL.search(reason) is not None:
            # llhttp lets control bytes through in a reason phrase and nowhere else in a head;
            # relayed, CR or LF would end the line (RFC 9112 §4: HTAB, SP, VCHAR, obs-text).
            raise UpstreamFailed("a control byte in the reason phrase")
        exchange.head = (status, reason.decode("latin-1"), headers)
        if framing is _NO_BODY:
            exchange.complete = True
            # llhttp would wait for the body a HEAD response's Content-Length announces.
            self._parser = httptools.HttpResponseParser(self)
        self._wake(exchange)

    def _check_head(self, exchange: Exchange, *, interim: bool) -> None:
        """Refuse a parsed head past its bounds, interim heads before it counted. Its size is
        summed only when it might be past them: the reads that ended inside the heads, and
        the one this head ended in, hold at least as many bytes."""
        bounds = self._bounds
        names_values = exchange.names_values
        if len(names_values) > bounds.max_lines:
            raise UpstreamFailed(f"the response head is past upstream_max_header_lines ({bounds.max_lines} lines)")
        if interim or exchange.head_received + self._read_size > bounds.max_size:
            # ": " and CRLF after each line; the status line's "HTTP/1.1 200 " and CRLF.
            size = len(exchange.reason) + 15 + sum(len(name) + len(value) + 4 for name, value in names_values)
            exchange.interim_size += size
            if exchange.interim_size > bounds.max_size:
                raise UpstreamFailed(f"the response head is past upstream_max_header_size ({bounds.max_size} bytes)")

    def on_body(self, body: bytes) -> None:
        exchange: Exchange = self._exchange  # type: ignore[assignment]
        if exchange.complete:
            raise UpstreamFailed("bytes past the end of a response")
        exchange.chunks.append(body)
        exchange.buffered += len(body)
        if exchange.buffered >= HIGH_WATER:
            assert self._flow is not None
            self._flow.pause_reading()  # the caller is slower than the upstream
        self._wake(exchange)

    def on_message_complete(self) -> None:
        exchange: Exchange = self._exchange  # type: ignore[assignment]
        if exchange.interim:
            exchange.interim = False
            return
        exchange.complete = True
        self._wake(exchange)

    # the exchange

    async def exchange(
        self,
        method: str,
        head: bytes,
        body: RequestBody,
        length: int | None,
        read_timeout: float,
    ) -> UpstreamResponse:
        if self._failure is not None or not self.open:
            raise UpstreamFailed("the connection closed while idle")
        transport = self._transport
        assert transport is not None
        exchange = self._exchange = Exchange(method == "HEAD", read_timeout)
        self._last_progress = self._loop.time()
        if isinstance(body, bytes):
            if length is not None:
                transport.write(head + body)
            else:
                transport.write(b"%s%x\r\n%s\r\n%s" % (head, len(body), body, _LAST_CHUNK) if body else head + _LAST_CHUNK)
        else:
            transport.write(head)
            if body is not None:
                sender = exchange.sender = asyncio.ensure_future(self._send(body, chunked=length is None))
                sender.add_done_callback(partial(self._sent, exchange))
        try:
            while exchange.head is None:
                await self.wait(exchange)
        except BaseException:
            self.close()
            raise
        status, reason, headers = exchange.head
        return UpstreamResponse(status, reason, headers, self, exchange)

    async def _send(self, body: AsyncIterable[bytes], *, chunked: bool) -> None:
        transport = self._transport
        flow = self._flow
        assert transport is not None and flow is not None
        async for chunk in body:
            if not self.open:
                return  # the response ended the exchange: the rest is not wanted
            if not chunk:
                continue
            transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
            self._last_progress = self._loop.time()
            if flow.write_paused:
                await flow.drain()  # the upstream is slower than the client: stop reading the client
        if chunked and self.open:
            transport.write(_LAST_CHUNK)

    def _sent(self, exchange: Exchange, task: asyncio.Task[None]) -> None:
        exchange.sender = None
        if task.cancelled():
            return
        failure = task.exception()
        if failure is not None and exchange is self._exchange:
            self._fail(BodyFailed, f"the request body failed: {failure or type(failure).__name__}")

    def wait(self, exchange: Exchange) -> asyncio.Future[None]:
        """Wait for the upstream to send more, for at most the read timeout between its reads."""
        if self._failure is not None:
            kind, message = self._failure
            raise kind(message)
        waiter = exchange.waiter = self._loop.create_future()
        self._last_progress = max(self._last_progress, self._loop.time())
        deadline = self._last_progress + exchange.read_timeout
        timer = self._timer
        if timer is None or timer.when() > deadline:
            # One timer a connection, re-armed when it fires early, rather than one a wait;
            # a later one is left from an exchange with a longer read timeout.
            if timer is not None:
                timer.cancel()
            self._timer = self._loop.call_at(deadline, self._check_timeout)
        flow = self._flow
        if flow is not None and flow.read_paused:
            flow.resume_reading()
        return waiter

    def take(self, exchange: Exchange) -> bytes:
        chunks = exchange.chunks
        if not chunks:
            return b""
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        exchange.buffered = 0
        flow = self._flow
        if flow is not None and flow.read_paused and exchange is self._exchange:
            flow.resume_reading()
        return data

    def reusable(self) -> bool:
        exchange = self._exchange
        return (
            self.open
            and self._failure is None
            and exchange is not None
            and exchange.complete
            and exchange.keep_alive
            and not exchange.chunks
            and (exchange.sender is None or exchange.sender.done())
        )

    def close(self) -> None:
        self.open = False
        exchange = self._exchange
        if exchange is not None and exchange.sender is not None:
            exchange.sender.cancel()
        if self._transport is not None:
            self._transport.close()
        self._cancel_timer()

    def reset(self) -> None:
        """Ready the connection for its next exchange."""
        self._exchange = None

    def _check_timeout(self) -> None:
        self._timer = None
        exchange = self._exchange
        if exchange is None or exchange.waiter is None or exchange.waiter.done():
            return  # the next wait arms it again
        deadline = self._last_progress + exchange.read_timeout
        if self._loop.time() < deadline:
            self._timer = self._loop.call_at(deadline, self._check_timeout)
            return
        self._fail(UpstreamTimeout, f"no answer within {exchange.read_timeout:g} s")

    @staticmethod
    def _wake(exchange: Exchange) -> None:
        waiter = exchange.waiter
        if waiter is not None:
            exchange.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _fail(self, kind: type[UpstreamError], message: str) -> None:
        if self._failure is None:
            self._failure = (kind, message)
        self.open = False
        self._cancel_timer()
        exchange = self._exchange
        if exchange is not None and exchange.waiter is not None:
            waiter, exchange.waiter = exchange.waiter, None
            if not waiter.done():
                first_kind, first_message = self._failure
                waiter.set_exception(first_kind(first_message))
        if self._transport is not None:
            self._transport.close()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
