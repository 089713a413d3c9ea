"""A request body on its way to the upstream: `Expect: 100-continue` held back until the
body is wanted, and a body read ahead up to a bound before an upstream connection is
taken, then streamed. Trusts the client for nothing: every read is bounded.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
from aiohttp import hdrs, web
from aiohttp.http import HttpVersion11

from gateway.proxy.problem import problem
from gateway.upstream.body import RequestBody

# Big enough to keep syscalls few, small enough that many streams stay within a
# modest RSS: 1000 concurrent streams hold at most ~64 MB of chunks.
STREAM_CHUNK_BYTES = 64 * 1024
# A request body still arriving is read ahead up to this before an upstream connection is
# taken (nginx buffers request bodies too, 16 KiB in memory); larger bodies then stream.
# 1,000 requests reading ahead hold at most ~64 MB.
REQUEST_BUFFER_BYTES = 64 * 1024
# Set on a request that asked for 100 Continue and has not been sent it yet (see expectation).
_AWAITING_CONTINUE = web.RequestKey("gateway.awaiting_continue", bool)


def expectation(request: web.BaseRequest) -> web.Response | None:
    """Check `Expect`: `100-continue` on a request with a body is remembered, and its interim
    response waits until the body is about to be read (send_continue), so that a 404, 413, 429 or
    503 decided from the head alone comes first and the client never sends a body no one will
    read (RFC 9110 §10.1.1; nginx sends its 100 Continue only when it reads the body, too).
    Any other expectation gets 417. HTTP/1.0 has no interim responses, so there it is ignored."""
    if request.version != HttpVersion11:
        return None
    if request.headers["Expect"].lower() != "100-continue":
        return problem(417, "Expectation Failed", "Only the expectation 100-continue is understood.")
    if request.body_exists:
        request[_AWAITING_CONTINUE] = True
    return None


def awaiting_continue(request: web.BaseRequest) -> bool:
    """Whether `expectation` held back a 100 Continue not sent yet. Most requests send no
    Expect: the header test spares them a miss in the request's mapping, which raises and
    catches a KeyError, twice a request."""
    return hdrs.EXPECT in request.headers and _AWAITING_CONTINUE in request


async def send_continue(request: web.BaseRequest) -> None:
    """Send the 100 Continue that `expectation` held back: the body is wanted now."""
    del request[_AWAITING_CONTINUE]
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # the interim response is not part of the response's size
    await request.writer.drain()


async def read_ahead(content: aiohttp.StreamReader, limit: int, *, cap: bool) -> RequestBody:
    """Read the body until it ends or passes `limit` bytes. A body that ended is returned
    whole. Past the limit: None with `cap` (a body too large), or else the bytes read so far
    followed by the rest as it streams in."""
    parts: list[bytes] = []
    size = 0
    while size <= limit:
        chunk = await content.readany()
        if not chunk:
            return b"".join(parts)
        size += len(chunk)
        parts.append(chunk)
    return None if cap else _stream_on(parts, content)


async def _stream_on(parts: list[bytes], content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    for part in parts:
        yield part
    parts.clear()
    async for chunk in content.iter_chunked(STREAM_CHUNK_BYTES):
        yield chunk
