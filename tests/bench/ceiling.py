"""Variant (g), the ceiling: what Python on aiohttp's HTTP server proxies when the
upstream client is lean. aiohttp's low-level `web.Server` takes each request and
a minimal HTTP/1.1 client forwards it: one `asyncio.Protocol` per keep-alive
upstream connection, the response parsed by httptools (llhttp, the C parser of
Node and uvicorn), and a deque of idle connections. Bodies are read whole, as
the naive proxy (f) reads them: the benchmark's upstream answers two bytes.

    python -m tests.bench.ceiling --port 8082 --upstream http://127.0.0.1:9000
"""

from __future__ import annotations

import argparse
import asyncio
import collections
from urllib.parse import urlsplit

import httptools
from aiohttp import web
from multidict import CIMultiDict

from tests.bench.low_level_server import Handler, serve

# Hop-by-hop fields (RFC 9110 §7.6.1), plus the framing and Host that each side writes for itself.
NOT_FORWARDED = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"transfer-encoding", b"upgrade",
     b"host", b"content-length"}
)
# Methods that may be sent again when a reused connection turns out closed (nginx's rule).
IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS", "TRACE"})

Answer = tuple[int, list[tuple[bytes, bytes]], bytes]


class StaleConnection(ConnectionError):
    """The upstream closed a connection before any byte of the answer: nothing was processed."""


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive connection; the parser's callbacks fill the answer of its one request in flight."""

    def __init__(self, idle: collections.deque[UpstreamConnection]) -> None:
        self._idle = idle
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._waiter: asyncio.Future[Answer] | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._received = False

    def send(self, message: bytes) -> asyncio.Future[Answer]:
        assert self._transport is not None and self._waiter is None
        self._waiter = asyncio.get_running_loop().create_future()
        self._headers, self._body, self._received = [], [], False
        self._transport.write(message)
        return self._waiter

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._transport = transport  # uvloop's transports are not asyncio.Transport subclasses

    def data_received(self, data: bytes) -> None:
        self._received = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(exc)
            assert self._transport is not None
            self._transport.close()  # framing is lost: the connection is never reused

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self._idle:
            self._idle.remove(self)
        self._fail(ConnectionResetError("upstream closed mid-answer") if self._received else StaleConnection())

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        waiter, self._waiter = self._waiter, None
        # Back to the pool only now, read to the end; even if its waiter was cancelled meanwhile.
        if self._parser.should_keep_alive():
            self._idle.append(self)
        elif self._transport is not None:
            self._transport.close()
        if waiter is not None and not waiter.done():
            waiter.set_result((self._parser.get_status_code(), self._headers, b"".join(self._body)))

    def _fail(self, exc: Exception) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)


class UpstreamClient:
    """Keep-alive connections to one upstream: an idle one is reused, else a new one is opened."""

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        self._address = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.host = parts.netloc.encode()
        self._idle: collections.deque[UpstreamConnection] = collections.deque()

    async def request(self, method: str, message: bytes) -> Answer:
        if self._idle:
            # The most recently used connection: the least likely to have timed out.
            try:
                return await self._idle.pop().send(message)
            except StaleConnection:
                if method not in IDEMPOTENT:
                    raise
        _, connection = await asyncio.get_running_loop().create_connection(
            lambda: UpstreamConnection(self._idle), *self._address
        )
        return await connection.send(message)


def make_handler(upstream: str) -> Handler:
    client = UpstreamClient(upstream)

    async def forward(request: web.BaseRequest) -> web.Response:
        head = [f"{request.method} {request.raw_path} HTTP/1.1\r\nHost: ".encode(), client.host, b"\r\n"]
        for name, value in request.raw_headers:
            if name.lower() not in NOT_FORWARDED:
                head += (name, b": ", value, b"\r\n")
        body = await request.read() if request.can_read_body else b""
        if body:
            head += (b"Content-Length: ", str(len(body)).encode(), b"\r\n")
        head.append(b"\r\n")
        try:
            status, raw_headers, content = await client.request(request.method, b"".join(head) + body)
        except (OSError, httptools.HttpParserError):
            return web.Response(status=502)
        headers = CIMultiDict(
            (name.decode("latin-1"), value.decode("latin-1"))
            for name, value in raw_headers
            if name.lower() not in NOT_FORWARDED
        )
        return web.Response(status=status, body=content, headers=headers)

    return forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args()
    upstream = args.upstream.rstrip("/")
    serve(lambda: make_handler(upstream), args.port)


if __name__ == "__main__":
    main()
