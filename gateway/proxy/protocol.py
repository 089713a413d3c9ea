"""What the public listener says about itself, before and around the proxy handler.

Trusts nothing a client sent: a request aiohttp's parser (llhttp) refuses is
answered with a fixed problem+json that echoes none of its bytes (aiohttp's own
answer quotes the offending line, API keys and `<script>` included), and it is
logged as one debug line naming the kind of error, never with a traceback: a
malformed request is the client's doing, not ours, and a flood of them must not
become a flood of tracebacks. Only a failure of our own code (a 500) is logged
with its traceback.

No response carries a `Server` banner: aiohttp adds `Python/3.11 aiohttp/X.Y.Z`
to every response, which tells an attacker which advisories to try, and an
upstream's own `Server` field is dropped as nginx drops it (`proxy_hide_header`).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import httptools
from aiohttp import hdrs, web, web_protocol
from aiohttp.http import HttpVersion10, HttpVersion11
from aiohttp.http_exceptions import (
    BadHttpMethod,
    BadStatusLine,
    InvalidHeader,
    InvalidURLError,
    LineTooLong,
    PayloadEncodingError,
)
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import EMPTY_PAYLOAD
from aiohttp.web_protocol import RequestHandler

from gateway.config.http_names import request_host
from gateway.proxy.bounded_protocol import BoundedRequestHandler, BoundedServer
from gateway.proxy.headers import unrelayable_coding
from gateway.proxy.problem import problem

log = logging.getLogger("gateway.protocol")
_NO_CALLBACKS = object()  # httptools only finds where a request ends: it needs none of them

# Checked most specific first: BadHttpMethod is a BadStatusLine, and so on.
_PARSER_ERRORS: tuple[tuple[type[Exception], str], ...] = (
    (BadHttpMethod, "The request method is not one this gateway accepts, or this is not HTTP/1.x."),
    (BadStatusLine, "The request line is malformed."),
    (LineTooLong, "The request line or a header field is too long."),
    (InvalidURLError, "The request target is malformed."),
    (InvalidHeader, "A header field is malformed."),
    (PayloadEncodingError, "The message body's framing (Content-Length or Transfer-Encoding) is malformed."),
)
_MALFORMED = "The request is malformed."


def parser_refusal(exc: BaseException | None) -> str:
    """The detail of the 400 answering a request the parser refused with `exc`."""
    return next((text for kind, text in _PARSER_ERRORS if isinstance(exc, kind)), _MALFORMED)

# RFC 9110 §7.2: Host = uri-host [ ":" port ]. A reg-name is restricted here to its
# unreserved characters: sub-delims (`!$&'()*+,;=`) and %-escapes name no real host and
# are how `evil.example/@x`-style values confuse an upstream's URL parser. An IP-literal
# is an IPv6 address in brackets. RFC 9112 §3.2 asks for 400 on an invalid Host.
VALID_HOST = re.compile(r"(?:[A-Za-z0-9._~-]+|\[[0-9A-Fa-f:.]+\])(?::[0-9]{0,5})?")


def request_parser() -> str:
    """"llhttp" when aiohttp parses requests with its C extension (llhttp), as the gateway
    must: most aiohttp request-smuggling advisories hit only the pure-Python parser, which
    aiohttp falls back to without a compiled wheel or with AIOHTTP_NO_EXTENSIONS set."""
    return "llhttp" if web_protocol.HttpRequestParser.__module__ == "aiohttp._http_parser" else "python"


# Host values remembered as routes read them, so a returning client's Host costs a dict hit
# instead of a regular expression and a parse. Bounded, since clients choose the value:
# when full it starts over. Values past the key length are checked each time, never kept.
HOST_MEMO_SIZE = 1024
HOST_MEMO_KEY_CHARS = 128
_hosts: dict[str, str | None] = {}
_UNSEEN = object()


def routed_host(value: str) -> str | None:
    """A Host header's value as routes match it (request_host), or None if it is not a
    valid host[:port] (RFC 9112 §3.2)."""
    known = _hosts.get(value, _UNSEEN)
    if known is _UNSEEN:
        known = request_host(value) if VALID_HOST.fullmatch(value) is not None else None
        if len(value) <= HOST_MEMO_KEY_CHARS:
            if len(_hosts) >= HOST_MEMO_SIZE:
                _hosts.clear()
            _hosts[value] = known
    return known  # type: ignore[return-value]


def _host(request: web.BaseRequest) -> str | web.Response:
    """The Host as routes match it ("" for HTTP/1.0 without one), or a 400 for a Host that is
    not a host: missing on HTTP/1.1, given twice, empty or malformed."""
    hosts = request.headers.getall(hdrs.HOST, ())
    if not hosts:
        if request.version == HttpVersion10:
            return ""
        return problem(400, "Bad Request", "An HTTP/1.1 request needs a Host header.")
    if len(hosts) > 1:
        return problem(400, "Bad Request", "The Host header is given more than once.")
    host = routed_host(hosts[0])
    if host is None:
        return problem(400, "Bad Request", "The Host header is not a valid host[:port].")
    return host


def version_problem(request: web.BaseRequest) -> web.Response | None:
    """A 505 for a request line naming a version other than HTTP/1.0 or HTTP/1.1: llhttp
    reads `HTTP/2.0` and aiohttp would answer `HTTP/2.0 200 OK` over an HTTP/1 connection.
    The answer is an HTTP/1.1 one (RFC 9110 §15.6.6)."""
    if not isinstance(request, _UnsupportedVersionRequest):
        return None
    response = problem(505, "HTTP Version Not Supported", "Only HTTP/1.0 and HTTP/1.1 are served here.")
    response.force_close()
    return response


def coding_problem(request: web.BaseRequest) -> web.Response | None:
    """A 501 for a request body in a transfer coding other than chunked, such as
    `Transfer-Encoding: gzip, chunked`: llhttp removes the chunked framing and leaves the
    gzip, which would reach the upstream as a plain body (see gateway.proxy.headers). Nothing
    of the body is read, so the connection closes, as nginx closes it."""
    if hdrs.TRANSFER_ENCODING not in request.headers or not unrelayable_coding(request.headers):
        return None
    response = problem(501, "Not Implemented", "Only the chunked transfer coding is accepted.")
    response.force_close()
    return response


def checked_host(request: web.BaseRequest) -> str | web.Response:
    """The proxy handler's first step: the request's Host as routes match it, or the answer
    to a request refused for its version, its Host or its transfer coding, checked in that order."""
    response = version_problem(request)
    if response is not None:
        return response
    host = _host(request)
    if isinstance(host, str):
        return coding_problem(request) or host
    return host


class _Request(web.BaseRequest):
    async def _prepare_hook(self, response: web.StreamResponse) -> None:
        # Runs after aiohttp has added its Server banner and before the head is written.
        response.headers.popall(hdrs.SERVER, None)


class _UnsupportedVersionRequest(_Request):
    """A request whose line named another version; it is read as HTTP/1.1 so that the
    505 answering it is written as HTTP/1.1."""


class _RequestHandler(BoundedRequestHandler):
    _manager: PublicServer | None  # made only by PublicServer, as its handler_class

    def refused(self) -> None:
        if self._manager is not None:
            self._manager.refused()

    def data_received(self, data: bytes) -> None:
        self._received(data, self._at_message_start())

    def _received(self, data: bytes, at_start: bool) -> None:
        count = self._request_count
        super().data_received(data)
        if self._request_count != count and not self._upgraded and not self._refused and self._messages:
            message, payload = self._messages[-1]
            if isinstance(message, RawRequestMessage) and message.upgrade:
                self._declined_upgrade(message, payload, data if at_start else None)

    def _at_message_start(self) -> bool:
        """Whether the next read begins a request: no head or body is part way."""
        body = self._body
        return (
            (body is None or body.is_eof())
            and not self._head_bytes
            and not self._unmeasured
            and not self._upgraded
            and self._payload_parser is None
        )

    def _declined_upgrade(self, message: RawRequestMessage, payload: Any, data: bytes | None) -> None:
        """A request asking to switch to a protocol the gateway does not speak (`Upgrade: h2c`):
        it is answered as plain HTTP/1.1, its Upgrade dropped as hop-by-hop. llhttp stops at
        such a request and aiohttp drops the rest of the read, so requests pipelined behind it
        would go unanswered. The rest is found again with llhttp (httptools) when the read
        began a request (`data`) and this one has no body, and fed on; else the connection
        closes after the answer, which tells a pipelining client to send the rest again
        (RFC 9112 §9.3.2)."""
        # Where a request with a body ends, llhttp versions differ (after its head, or after
        # its body): taken from another one, a body could be read as requests. So only a
        # bodiless request's rest is fed on.
        if data is not None and payload is EMPTY_PAYLOAD:
            try:
                httptools.HttpRequestParser(_NO_CALLBACKS).feed_data(data)
            except httptools.HttpParserUpgrade as upgrade:
                tail = data[upgrade.args[0] :]
                if tail:
                    self._received(tail, at_start=True)
                return
            except httptools.HttpParserError:
                pass
        self._messages[-1] = (message._replace(should_close=True), payload)

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """Answer what aiohttp could not hand to the proxy handler (a request the parser
        refused, 400) or what escaped it (500, or 504 for a stray timeout), as problem+json."""
        if status == HTTPStatus.INTERNAL_SERVER_ERROR:
            log.error("request handler failed for %s %s", request.method, request.path, exc_info=exc)
            detail = "The gateway failed to handle this request."
        elif status == HTTPStatus.BAD_REQUEST:
            log.debug("refused a malformed request from %s: %s", request.remote, type(exc).__name__)
            self.refused()
            detail = parser_refusal(exc)
        else:
            detail = HTTPStatus(status).description + "."
        if request.writer.output_size > 0:
            raise ConnectionError("Response is sent already, cannot send another response with the error message")
        response = problem(status, HTTPStatus(status).phrase, detail)
        response.force_close()
        return response


class PublicServer(BoundedServer):
    """aiohttp's low-level server, speaking through the handler and request classes above,
    each connection bounded by `limits` (gateway.proxy.bounded_protocol). `refused` is called for
    each request the parser or those bounds refused, which the proxy handler never sees, so
    that the metrics count it."""

    handler_class = _RequestHandler

    def __init__(self, handler: Any, *, refused: Callable[[], None] = lambda: None, **kwargs: Any) -> None:
        super().__init__(handler, request_factory=self._request, **kwargs)
        self.refused = refused

    def _request(
        self, message: Any, payload: Any, protocol: RequestHandler, writer: Any, task: asyncio.Task[None]
    ) -> web.BaseRequest:
        if message.version == HttpVersion11 or message.version == HttpVersion10:
            return _Request(message, payload, protocol, writer, task, self._loop)
        message = message._replace(version=HttpVersion11, should_close=True)
        return _UnsupportedVersionRequest(message, payload, protocol, writer, task, self._loop)
