"""What one client connection may hold of the gateway: bounded heads, bodies, idle time and requests.

aiohttp's server bounds each request line and header line (8190 bytes) and the
number of header lines (128), but not their total, so one head may hold about
1 MB. Its one timer, `keepalive_timeout`, also ends an unfinished head, and
nothing times the reads of a request body. So this module adds, at the
protocol level where the bytes arrive:

- **client_header_timeout**: a request head must arrive whole within this of
  its first byte; for a connection's first request, of the connection's start
  (as nginx counts it). A head left unfinished gets `408` problem+json and the
  connection is closed; a new connection that never sent a byte is closed.
- **keepalive_timeout**: an idle connection between requests is closed (aiohttp's
  own timer, which here does not end a head in progress).
- **max_header_size**: the request line and header lines together. A head past
  it gets `431` problem+json as soon as the bytes received show it, finished or
  not, so an unfinished head never holds more than this (plus one read).
- **client_body_timeout**: the longest wait between two reads of a request body
  while the gateway is reading it; the proxy answers `408`. A body the gateway
  has stopped reading (backpressure from a slow upstream) is not the client's stall.
- **keepalive_requests**: after this many requests on one connection, the last
  is answered with `Connection: close`.

Per request this costs a few attribute updates and one clock read: a head is
sized from the bytes received, and summed exactly only when that count passes
the cap or cannot be attributed to one head (pipelined requests, or a head
begun in the read that ended the previous request). Such a head is timed from its
next read, so it is bounded by keepalive_timeout, and at the latest by the two
timeouts together. One timer per connection watches the head and body
deadlines, re-armed lazily, never per request.

A client that hangs up while its request is with the upstream cancels it: the
handler marks that phase with `cancel_on_hangup`, and a lost connection cancels
the handler's task there, so the upstream request is abandoned at once instead
of run to completion for nobody. Nowhere else: a task cancelled inside the
limiter's check could leave a charge that no metric counts.

Trusts nothing a client sends; the bounds are the config's `clients`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import EMPTY_PAYLOAD
from aiohttp.web_protocol import RequestHandler, _ErrInfo

from gateway.config.model import ClientLimits
from gateway.proxy.problem import problem

# Request line: method, space, target, space, "HTTP/1.1", CRLF; header line: name, ": ", value, CRLF.
_REQUEST_LINE_FRAMING = 12
_HEADER_LINE_FRAMING = 4
_END_OF_HEAD = b"\r\n\r\n"
_CLOSE = {"Connection": "close"}
# After refusing a head, how long its connection is read (and the bytes dropped) before it
# closes. Closing with a client's bytes unread makes the kernel send a reset, which can
# destroy the 408 or 431 before the client reads it; nginx lingers the same way (its
# lingering_timeout is 5 s). The answer is followed by a FIN at once, so a client that
# reads it sees the end straight away.
LINGER_SECONDS = 2.0


# Set by the handler on a request while it is with the upstream: the task to cancel should
# the client's connection be lost. HUNG_UP tells the handler that the cancel was ours.
CANCEL_ON_HANGUP = web.RequestKey("gateway.cancel_on_hangup", asyncio.Task)
HUNG_UP = web.RequestKey("gateway.hung_up", bool)


def hung_up(request: web.BaseRequest) -> bool:
    """Whether the client's connection was lost while `request` was with the upstream."""
    return request.get(HUNG_UP, False)


class ClientLimitExceeded(Exception):
    """A client passed one of its bounds; the gateway answers `status` and closes the connection."""

    def __init__(self, status: int, title: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.title = title
        self.detail = detail

    def response(self) -> web.Response:
        # Said outright: a refused head is answered as HTTP/1.0, where closing is otherwise implied.
        response = problem(self.status, self.title, self.detail, headers=_CLOSE)
        response.force_close()
        return response


class BodyStalled(ClientLimitExceeded, TimeoutError):
    """client_body_timeout, set on the request body so that whoever reads it next stops.
    A TimeoutError, because that is what aiohttp expects of a body read: its client passes
    it on as it is rather than as a connection error, and the server's lingering read of a
    body left unread after the answer closes the connection on it quietly."""


def head_size(message: RawRequestMessage) -> int:
    """The bytes of a request's head as sent, near enough: its request line and header lines."""
    size = _REQUEST_LINE_FRAMING + len(message.method) + len(message.path) + 2
    for name, value in message.raw_headers:
        size += len(name) + len(value) + _HEADER_LINE_FRAMING
    return size


class BoundedRequestHandler(RequestHandler):
    __slots__ = (
        "_body",
        "_body_read_at",
        "_head_bytes",
        "_head_since",
        "_limits",
        "_lingering",
        "_refused",
        "_unmeasured",
        "_watch_at",
        "_watchdog",
    )

    def __init__(self, manager: web.Server, *, limits: ClientLimits, **kwargs: Any) -> None:
        super().__init__(manager, keepalive_timeout=limits.keepalive_timeout, **kwargs)
        self._limits = limits
        self._head_since = 0.0  # when the head now due began (its first read, or the connection); 0: none due
        self._head_bytes = 0  # bytes read since, all of them the head's
        self._unmeasured = False  # the head may have begun inside a read that was not counted for it
        self._body: Any = None  # the payload of the last request parsed
        self._body_read_at = 0.0
        self._watchdog: asyncio.TimerHandle | None = None
        self._watch_at = 0.0  # when the watchdog fires
        self._refused = False  # the last request is queued (an error, or the keepalive_requests-th): no new head is read
        self._lingering: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._head_since = self._loop.time()
        self._watch_until(self._head_since + self._limits.header_timeout)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._lingering is not None and not self._lingering.done():
            self._lingering.set_result(None)
        request = self._current_request
        super().connection_lost(exc)
        if request is not None:
            task = request.pop(CANCEL_ON_HANGUP, None)
            if task is not None and not task.done():
                request[HUNG_UP] = True
                task.cancel()

    def data_received(self, data: bytes) -> None:
        if self._upgraded or self._payload_parser is not None:
            super().data_received(data)  # a WebSocket: no longer HTTP requests
            return
        body = self._body
        in_head = body is None or body.is_eof()
        if in_head:
            if self._refused:
                return  # no further request is read; the body of the last one still is
            if not data:
                pass  # aiohttp resuming requests it parsed earlier: no byte arrived
            elif not self._head_since:
                self._head_since = self._loop.time()
                self._watch_by(self._head_since + self._limits.header_timeout)
            self._head_bytes += len(data)
        else:
            self._body_read_at = self._loop.time()
        count = self._request_count
        super().data_received(data)
        if self._request_count != count:
            self._parsed(count, in_head, data)
        elif in_head:
            if self._head_bytes > self._limits.max_header_size:
                self._refuse(self._too_large(), len(self._messages))
        elif body.is_eof():
            # This read ended a body; whatever followed it in the read begins a head uncounted.
            self._unmeasured = True

    def _parsed(self, count: int, in_head: bool, data: bytes) -> None:
        """One or more requests were parsed from the read `data`."""
        messages = self._messages
        new = self._request_count - count
        if self._refused:
            for _ in range(new):
                messages.pop()  # pipelined behind the last request this connection takes
            return
        first = len(messages) - new
        if new > 1 or not in_head or self._unmeasured or self._head_bytes > self._limits.max_header_size:
            # The read count is no exact size for these heads: sum them (rare, see the docstring).
            for i in range(first, len(messages)):
                message = messages[i][0]
                if isinstance(message, RawRequestMessage) and head_size(message) > self._limits.max_header_size:
                    self._refuse(self._too_large(), i)
                    return
        body = messages[-1][1]
        self._body = body
        self._head_since = 0.0
        self._head_bytes = 0
        if body.is_eof():
            # A read that ends exactly with a bodiless head holds nothing of the next one.
            self._unmeasured = not data.endswith(_END_OF_HEAD)
        else:
            self._unmeasured = False
            self._body_read_at = self._loop.time()
            self._watch_by(self._body_read_at + self._limits.body_timeout)
        if self._request_count >= self._limits.keepalive_requests:
            last = first + (self._limits.keepalive_requests - count) - 1
            message, payload = messages[last]
            while len(messages) > last + 1:
                messages.pop()  # pipelined past the cap: never answered
            if isinstance(message, RawRequestMessage):
                messages[last] = (message._replace(should_close=True), payload)
            self._refused = True

    def _too_large(self) -> ClientLimitExceeded:
        return ClientLimitExceeded(
            431,
            "Request Header Fields Too Large",
            f"The request line and header fields may take {self._limits.max_header_size} bytes at most.",
        )

    def _refuse(self, error: ClientLimitExceeded, at: int) -> None:
        """Answer `error` after the requests queued before index `at`, and read nothing more."""
        self._refused = True
        self._parser = None  # and drop the refused head now, not when the connection ends
        while len(self._messages) > at:
            self._messages.pop()
        self._messages.append((_ErrInfo(status=error.status, exc=error, message=error.detail), EMPTY_PAYLOAD))
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _make_error_handler(self, err_info: _ErrInfo) -> Any:
        error = err_info.exc
        if isinstance(error, ClientLimitExceeded):

            async def answer(request: web.BaseRequest) -> web.StreamResponse:
                self.refused()
                response = error.response()
                await response.prepare(request)
                await response.write_eof()
                await self._linger()
                return response

            return answer
        return super()._make_error_handler(err_info)

    async def _linger(self) -> None:
        """Send FIN after the answer, and drop what the client still sends until it closes,
        at most LINGER_SECONDS; aiohttp closes the connection after that."""
        transport = self.transport
        if transport is None:
            return
        if transport.can_write_eof():  # not over TLS, which closes with its own alert
            transport.write_eof()
        self._lingering = self._loop.create_future()
        try:
            async with asyncio.timeout(LINGER_SECONDS):
                await self._lingering
        except TimeoutError:
            pass

    def refused(self) -> None:
        """Called for each request refused before the proxy handler saw it: a place to count it."""

    def _process_keepalive(self) -> None:
        if self._head_since:
            self._keepalive_handle = None  # a head has begun: client_header_timeout governs it
            return
        super()._process_keepalive()

    def _watch_until(self, when: float) -> None:
        self._watchdog = self._loop.call_at(when, self._watch)
        self._watch_at = when

    def _watch_by(self, when: float) -> None:
        """Have the timer look at the connection by `when`. A timer already due sooner stays:
        it only looks again when it fires, so a busy connection arms one every timeout at most."""
        watchdog = self._watchdog
        if watchdog is None:
            self._watch_until(when)
        elif self._watch_at > when:
            watchdog.cancel()
            self._watch_until(when)

    def _watch(self) -> None:
        """The connection's one timer: is a head or a body overdue? Re-armed only while one is due."""
        self._watchdog = None
        if self.transport is None or self._force_close:
            return
        now = self._loop.time()
        limits = self._limits
        if self._head_since and not self._refused:
            due = self._head_since + limits.header_timeout
            if now < due or self._request_in_progress or self._messages:
                # Early, or a pipelined head behind a request still being answered.
                self._watch_until(max(due, now + limits.header_timeout))
            elif self._head_bytes:
                self._refuse(
                    ClientLimitExceeded(
                        408, "Request Timeout", f"The request head did not arrive within {limits.header_timeout:g} s."
                    ),
                    len(self._messages),
                )
            else:
                self.force_close()  # connected, and never sent a byte
            return
        body = self._body
        if body is None or body.is_eof() or not self._request_in_progress:
            return  # nothing due; an unread body after the answer is aiohttp's lingering, bounded by itself
        due = self._body_read_at + limits.body_timeout
        if self._reading_paused:
            # The gateway stopped reading (its upstream is slower): not the client's stall.
            self._body_read_at = now
            self._watch_until(now + limits.body_timeout)
        elif now < due:
            self._watch_until(due)
        else:
            body.set_exception(
                BodyStalled(408, "Request Timeout", f"The request body stalled: no byte arrived for {limits.body_timeout:g} s.")
            )


class BoundedServer(web.Server):
    """aiohttp's low-level server, with a `handler_class` (a BoundedRequestHandler) for each
    connection; a subclass that speaks differently sets its own subclass of it there."""

    handler_class: type[BoundedRequestHandler] = BoundedRequestHandler

    def __init__(self, handler: Any, *, limits: ClientLimits, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self._limits = limits

    def __call__(self) -> BoundedRequestHandler:
        return self.handler_class(self, loop=self._loop, limits=self._limits, **self._kwargs)
