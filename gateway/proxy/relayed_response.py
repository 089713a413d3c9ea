"""An upstream's response as the gateway relays it, its head written as the bytes the
upstream sent.

The upstream connection hands the head over losslessly: header values decoded as UTF-8
with surrogateescape (a byte that is no part of a UTF-8 character becomes a lone surrogate,
U+DC80-U+DCFF), the reason phrase as Latin-1. aiohttp's head writer encodes every value
as UTF-8 and its C writer drops lone surrogates without a word: `filename="r\\xe9sum\\xe9.pdf"`
left as `"rsum.pdf"`, and `Location: /\\xff/evil.example`, which the Location rule had
passed, left as `//evil.example`, another host. So a relayed response writes its head
itself, each value encoded back as it was decoded (`field_bytes`): the upstream's bytes,
obs-text included, and the bytes every rule before it read. An all-ASCII head, the
usual one, is the same bytes either way and goes through aiohttp's serializer, in C.

Obs-text (0x80-0xFF) is passed on, not refused: RFC 9110 §5.5 lets a recipient keep it,
nginx relays header bytes unchanged, and Envoy's HTTP/1 codec accepts it
(`HeaderUtility::headerValueIsValid`, obs-text allowed) and relays the bytes. Control
bytes are refused as Envoy refuses them (nginx is laxer): llhttp fails the attempt on
one in a header field, and the upstream connection on one in the reason phrase, which
llhttp lets through: a 502 before anything is written, and the connection closed. `serialized_head` refuses them again, as aiohttp's
writer does, so no value can split a line whatever reaches it.

Trusts nothing in the values. Names are tokens: llhttp and the config loader allow
nothing else, so encoding them is the identity.
"""

from __future__ import annotations

import re

from aiohttp import hdrs, web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.helpers import rfc822_formatted_time, should_remove_content_length
from aiohttp.http import HttpVersion, HttpVersion10, HttpVersion11
from aiohttp.http_writer import StreamWriter
from aiohttp.http_writer import _serialize_headers as _ascii_head
from multidict import CIMultiDict

# RFC 9110 §5.5: no CTL but HTAB in a field value; CR and LF would end the line.
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def field_bytes(value: str) -> bytes:
    """The bytes a header value is written as: those the upstream connection (and aiohttp,
    for a client's request) decoded it from."""
    return value.encode("utf-8", "surrogateescape")


def relayable_reason(reason: str) -> bool:
    """Whether a reason phrase holds no control character (RFC 9112 §4: HTAB, SP, VCHAR
    and obs-text only), which llhttp lets through there and nowhere else in a head."""
    return _CONTROL.search(reason) is None


def serialized_head(version: HttpVersion, status: int, reason: str, headers: CIMultiDict[str]) -> bytes:
    """The status line and header fields, each value as `field_bytes` and the reason phrase
    as Latin-1. Raises ValueError on a control character, which would split a line."""
    if reason.isascii() and "".join(headers.values()).isascii():
        # ASCII is one byte a character either way, and aiohttp's serializer, in C, is the quicker.
        return _ascii_head(f"HTTP/{version.major}.{version.minor} {status} {reason}", headers)
    lines = list(map(": ".join, headers.items()))
    if not relayable_reason(reason) or _CONTROL.search("".join(lines)) is not None:
        raise ValueError("Forbidden control character in a response header")
    status_line = b"HTTP/%d.%d %d %s\r\n" % (version.major, version.minor, status, reason.encode("latin-1"))
    if not lines:
        return status_line + b"\r\n"
    return status_line + field_bytes("\r\n".join(lines)) + b"\r\n\r\n"


class RelayedResponse(web.StreamResponse):
    """An upstream's response: its head the upstream's bytes, with no Content-Type where
    the upstream sent none. aiohttp gives any response with content one of
    application/octet-stream, which tells a browser to download what it would otherwise
    have sniffed and shown (RFC 9110 §8.3 leaves that to the recipient); nginx and Envoy
    add none either."""

    async def _start(self, request: web.BaseRequest) -> AbstractStreamWriter:  # aiohttp's, from prepare()
        """aiohttp's `_start`, `_prepare_headers`, the request's `_prepare_hook` and
        `_write_headers` as one coroutine rather than four: a relayed response sets no
        cookie, compression or chunking of its own, takes no Content-Type, and the public
        listener's hook only drops the Server banner. The fields are aiohttp's."""
        self._req = request
        writer = self._payload_writer = request._payload_writer
        assert isinstance(writer, StreamWriter)
        keep_alive = self._keep_alive
        if keep_alive is None:
            keep_alive = self._keep_alive = request.keep_alive
        version = request.version
        headers = self._headers
        length = writer.length = self.content_length
        if self._must_be_empty_body:
            if length is not None and should_remove_content_length(request.method, self._status):
                del headers[hdrs.CONTENT_LENGTH]
            headers.popall(hdrs.TRANSFER_ENCODING, None)  # RFC 9112 §6.1: none on a response without a body
        elif length is None:
            if version >= HttpVersion11:
                writer.enable_chunking()
                headers[hdrs.TRANSFER_ENCODING] = "chunked"
            else:
                keep_alive = False  # to HTTP/1.0 the body ends with the connection
        if hdrs.DATE not in headers:
            headers[hdrs.DATE] = rfc822_formatted_time()
        headers.popall(hdrs.SERVER, None)
        if hdrs.CONNECTION not in headers:
            if keep_alive:
                if version == HttpVersion10:
                    headers[hdrs.CONNECTION] = "keep-alive"
            elif version == HttpVersion11:
                headers[hdrs.CONNECTION] = "close"
        # What StreamWriter.write_headers does with the head it serializes: hold it, to go
        # out with the first body bytes or at once.
        writer._headers_buf = serialized_head(version, self._status, self._reason, headers)
        writer._headers_written = False
        if self._send_headers_immediately:
            writer.send_headers()
        return writer


class ArrivedResponse(RelayedResponse):
    """For an upstream response whose body has already arrived whole: its status line and
    headers wait for that body and leave with it in one write, as aiohttp's own Response
    does, instead of a write each. The client waits for nothing, since nothing is left to
    wait for; a body still arriving streams through RelayedResponse, headers first."""

    _send_headers_immediately = False  # aiohttp's switch, False in its Response class
