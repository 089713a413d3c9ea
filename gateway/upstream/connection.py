"""One keep-alive HTTP/1.1 connection to an upstream, as an `asyncio.Protocol`: the
request's head and body written with backpressure, the response parsed by llhttp
(httptools), its body held in bounded chunks (`HIGH_WATER`), and the errors every
failure leaves as. `gateway.upstream.client` pools these.

Trusts nothing an upstream sends: a response whose framing is ambiguous (Content-Length
twice, or beside Transfer-Encoding; a transfer coding other than chunked) or that llhttp
refuses fails the attempt, and its connection is never reused.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable

import httptools
from multidict import CIMultiDict

from gateway.config.http_names import HOP_BY_HOP
from gateway.upstream.errors import BodyFailed, UpstreamError, UpstreamFailed, UpstreamTimeout

# Bytes of response body held unread before the upstream is paused: as many as one stream
# chunk, so 1,000 slow clients hold ~64 MB at most (plus one read each).
HIGH_WATER = 64 * 1024
_RELAYED_CODINGS = frozenset({b"chunked", b"identity"})
# RFC 9110 §7.6.1: fields of one connection, never relayed (gateway.config.http_names.HOP_BY_HOP as bytes).
_HOP_BY_HOP = frozenset(name.encode() for name in HOP_BY_HOP)
_LAST_CHUNK = b"0\r\n\r\n"



class UpstreamResponse:
    """The status line and end-to-end headers of an upstream's answer (hop-by-hop fields,
    and those its Connection names, removed), and its body as it arrives."""

    __slots__ = ("_connection", "headers", "reason", "status")

    def __init__(self, status: int, reason: str, headers: CIMultiDict[str], connection: UpstreamConnection) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        self._connection = connection

    @property
    def arrived(self) -> bool:
        """Whether the whole body is here already, as a small answer's usually is."""
        return self._connection.complete

    def take(self) -> bytes:
        """Every body byte received and not yet taken."""
        return self._connection.take()

    async def read(self) -> bytes:
        """The next body bytes, as many as have arrived (at most about HIGH_WATER plus one
        read); b"" once the body has ended. Raises UpstreamTimeout or UpstreamFailed."""
        connection = self._connection
        if not connection.buffered and not connection.complete:
            await connection.wait()
        return connection.take()


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive connection, carrying one exchange at a time. llhttp calls the
    `on_*` methods as the response's bytes are fed to it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.open = False
        self.idle_since = 0.0
        self.answering = False  # some byte of the current answer has arrived
        self.complete = False  # the current response's body has ended
        self.buffered = 0
        self._chunks: list[bytes] = []
        self._names_values: list[tuple[bytes, bytes]] = []
        self._reason = b""
        self._response: UpstreamResponse | None = None
        self._keep_alive = False
        self._until_close = False  # the body ends with the connection
        self._head_only = False  # a HEAD request: its response has no body, whatever it says
        self._interim = False  # the head being parsed is a 1xx to skip
        self._broken: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._read_timeout = 0.0
        self._last_progress = 0.0
        self._paused_reading = False
        self._drain: asyncio.Future[None] | None = None
        self._sender: asyncio.Task[None] | None = None

    # asyncio's side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self.open = True

    def data_received(self, data: bytes) -> None:
        self._last_progress = self._loop.time()
        if self._response is None and not self.answering:
            if not self._waiter:
                # Bytes nobody asked for (an idle connection, or past a response): never reuse it.
                self._fail(UpstreamFailed("the upstream sent bytes outside a response"))
                return
            self.answering = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            # A callback's own refusal is the context of llhttp's "User callback error".
            self._fail(UpstreamFailed(f"invalid response: {exc.__context__ or exc}"))
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamFailed("the upstream switched protocols"))

    def eof_received(self) -> bool:
        return False  # a half-closed connection is closed: HTTP/1.1 has no use for it

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        if self._response is not None and self._until_close and not self.complete:
            self.complete = True  # a body delimited by the close of the connection (RFC 9112 §6.3)
            self._wake()
        elif not self.complete or self._response is None:
            self._fail(UpstreamFailed(str(exc) if exc else "the upstream closed the connection"))
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    def pause_writing(self) -> None:
        self._drain = self._loop.create_future()

    def resume_writing(self) -> None:
        self._last_progress = self._loop.time()
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    # llhttp's side

    def on_message_begin(self) -> None:
        if self.complete:
            # A second response to one request (llhttp would parse it as the next) desyncs the connection.
            raise httptools.HttpParserError("bytes past the end of a response")

    def on_status(self, reason: bytes) -> None:
        self._reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self._names_values.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self._parser
        status = parser.get_status_code()
        if 100 <= status < 200:
            # Interim answers (100 Continue, 103 Early Hints) are dropped, as nginx and Envoy drop them.
            self._interim = True
            self._names_values.clear()
            self._reason = b""
            return
        pairs = []
        framed = False
        named: list[bytes] | None = None  # what Connection names, hop-by-hop too
        for name, value in self._names_values:
            lowered = name.lower()
            if lowered in _HOP_BY_HOP:
                if lowered == b"transfer-encoding":
                    framed = True
                    for coding in value.split(b","):
                        coding = coding.partition(b";")[0].strip().lower()
                        if coding and coding not in _RELAYED_CODINGS:
                            # Relayed undecoded and unlabelled, it would look like a plain body.
                            raise httptools.HttpParserError("sent a transfer coding other than chunked")
                elif lowered == b"connection":
                    named = (named or []) + [token.strip() for token in value.split(b",")]
                continue
            if lowered == b"content-length":
                framed = True
            # As aiohttp decodes them: the bytes go back out unchanged.
            pairs.append((name.decode("latin-1"), value.decode("utf-8", "surrogateescape")))
        self._names_values.clear()
        headers: CIMultiDict[str] = CIMultiDict(pairs)
        if named:
            for token in named:
                headers.popall(token.decode("latin-1"), None)
        self._keep_alive = parser.should_keep_alive()
        no_body = self._head_only or status in (204, 304)
        self._until_close = not framed and not no_body
        self._response = UpstreamResponse(status, self._reason.decode("latin-1"), headers, self)
        if no_body:
            self.complete = True
            # llhttp would wait for the body a HEAD response's Content-Length announces.
            self._parser = httptools.HttpResponseParser(self)
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self.complete:
            raise httptools.HttpParserError("bytes past the end of a response")
        self._chunks.append(body)
        self.buffered += len(body)
        if self.buffered >= HIGH_WATER and not self._paused_reading and self._transport is not None:
            self._paused_reading = True
            self._transport.pause_reading()  # the client is slower than the upstream
        self._wake()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self.complete = True
        self._wake()

    # the exchange

    async def exchange(
        self,
        method: str,
        head: bytes,
        body: bytes | AsyncIterable[bytes] | None,
        length: int | None,
        read_timeout: float,
    ) -> UpstreamResponse:
        if self._broken is not None or not self.open:
            raise UpstreamFailed("the connection closed while idle")
        transport = self._transport
        assert transport is not None
        self._read_timeout = read_timeout
        self._head_only = method == "HEAD"
        self._last_progress = self._loop.time()
        if isinstance(body, bytes):
            if length is not None:
                transport.write(head + body)
            else:
                transport.write(b"%s%x\r\n%s\r\n%s" % (head, len(body), body, _LAST_CHUNK) if body else head + _LAST_CHUNK)
        else:
            transport.write(head)
            if body is not None:
                self._sender = asyncio.ensure_future(self._send(body, chunked=length is None))
                self._sender.add_done_callback(self._sent)
        try:
            while self._response is None:
                await self.wait()
        except BaseException:
            self.close()
            raise
        return self._response

    async def _send(self, body: AsyncIterable[bytes], *, chunked: bool) -> None:
        transport = self._transport
        assert transport is not None
        async for chunk in body:
            if not self.open:
                return  # the response ended the exchange: the rest is not wanted
            if not chunk:
                continue
            transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
            self._last_progress = self._loop.time()
            if self._drain is not None:
                await self._drain  # the upstream is slower than the client: stop reading the client
        if chunked and self.open:
            transport.write(_LAST_CHUNK)

    def _sent(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        failure = task.exception()
        if failure is not None:
            self._fail(BodyFailed(f"the request body failed: {failure or type(failure).__name__}"))

    def wait(self) -> asyncio.Future[None]:
        """Wait for the upstream to send more, for at most the read timeout between its reads."""
        if self._broken is not None:
            raise self._broken
        waiter = self._waiter = self._loop.create_future()
        self._last_progress = max(self._last_progress, self._loop.time())
        deadline = self._last_progress + self._read_timeout
        timer = self._timer
        if timer is None or timer.when() > deadline:
            # One timer a connection, re-armed when it fires early, rather than one a wait;
            # a later one is left from an exchange with a longer read timeout.
            if timer is not None:
                timer.cancel()
            self._timer = self._loop.call_at(deadline, self._check_timeout)
        if self._paused_reading:
            self._resume()
        return waiter

    def take(self) -> bytes:
        chunks = self._chunks
        if not chunks:
            return b""
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.buffered = 0
        if self._paused_reading:
            self._resume()
        return data

    def reusable(self) -> bool:
        return (
            self.open
            and self.complete
            and self._keep_alive
            and self._broken is None
            and not self._chunks
            and (self._sender is None or self._sender.done())
        )

    def close(self) -> None:
        self.open = False
        if self._sender is not None and not self._sender.done():
            self._sender.cancel()
        if self._transport is not None:
            self._transport.close()
        self._cancel_timer()

    def reset(self) -> None:
        """Ready the connection for its next exchange."""
        self._response = None
        self.answering = self.complete = self._until_close = False
        self._reason = b""
        self._sender = None

    def _resume(self) -> None:
        self._paused_reading = False
        if self._transport is not None and self.open:
            self._transport.resume_reading()

    def _check_timeout(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # the next wait arms it again
        deadline = self._last_progress + self._read_timeout
        if self._loop.time() < deadline:
            self._timer = self._loop.call_at(deadline, self._check_timeout)
            return
        self._fail(UpstreamTimeout(f"no answer within {self._read_timeout:g} s"))

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        if self._broken is None:
            self._broken = error
        waiter = self._waiter
        self._waiter = None
        self._cancel_timer()
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)
        self.open = False
        if self._transport is not None:
            self._transport.close()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
