"""HTTP/1.1 to one upstream: one `asyncio.Protocol` per keep-alive connection, a pool
of idle ones (`gateway.upstream.connection`), and responses parsed by llhttp
(httptools), the parser of Node and uvicorn.

Knows nothing of routes, limits or aiohttp's server. The proxy hands it a method, a
request target, header lines and a body (bytes, or chunks as they arrive) and gets an
`UpstreamResponse` whose body it reads in bounded chunks: past `HIGH_WATER` bytes not
yet read, the connection stops reading from the upstream (`pause_reading`), and a body
the upstream does not take pauses its sender (`pause_writing`).

Trusts the config's URLs; trusts nothing an upstream sends. A response whose framing is
ambiguous (Content-Length twice, or beside Transfer-Encoding; a transfer coding other than
chunked) or that llhttp refuses fails the attempt, and its connection is never reused. A
connection goes back to the pool only once its response was read to the end and both
sides meant to keep it. Every failure leaves as one of this module's errors:
`ConnectFailed` (nothing was sent), `UpstreamTimeout` and `UpstreamFailed`.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import ssl
import time
from collections.abc import AsyncIterable
from dataclasses import dataclass

from multidict import CIMultiDict
from yarl import URL

from gateway.upstream.connection import DEFAULT_BOUNDS, HeadBounds, UpstreamConnection, UpstreamResponse
from gateway.upstream.errors import ConnectFailed, UpstreamFailed

# An idle connection older than this is closed rather than reused: upstreams close idle
# keep-alive connections too (uvicorn after 5 s, nginx 75 s), and a reuse racing that
# close costs a retry. aiohttp's client keeps them 15 s.
IDLE_SECONDS = 15.0
# Methods a request may be sent twice with (RFC 9110 §9.2.2), as nginx resends them.
IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS", "TRACE"})
# Methods whose empty body is still announced, as aiohttp's client and curl do.
_LENGTH_ALWAYS = frozenset({"POST", "PUT", "PATCH"})
# What a request sends: whole bytes, chunks as they arrive (sent chunked), or nothing.
RequestBody = bytes | AsyncIterable[bytes] | None


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where an upstream base URL points, and what each request to it writes."""

    host: str
    port: int
    tls: ssl.SSLContext | None
    authority: str  # the Host header: host, and the port when it is not the scheme's
    base_path: str  # the URL's path, before each request's own
    authorization: str | None  # Basic credentials from the URL's user information, replacing the request's

    @classmethod
    def of(cls, url: str, tls: ssl.SSLContext | None) -> Endpoint:
        parsed = URL(url)
        host = parsed.raw_host or ""
        authority = f"[{host}]" if ":" in host else host
        if not parsed.is_default_port():
            authority += f":{parsed.port}"
        authorization = None
        if parsed.raw_user is not None:
            credentials = f"{parsed.user or ''}:{parsed.password or ''}".encode()
            authorization = "Basic " + base64.b64encode(credentials).decode()
        return cls(
            host=host,
            port=parsed.port or (443 if parsed.scheme == "https" else 80),
            tls=tls if parsed.scheme == "https" else None,
            authority=authority,
            base_path=parsed.raw_path.rstrip("/"),
            authorization=authorization,
        )


class UpstreamClient:
    """The idle connections to one upstream, and requests sent over them."""

    def __init__(self, url: str, tls: ssl.SSLContext | None, bounds: HeadBounds = DEFAULT_BOUNDS) -> None:
        self.endpoint = Endpoint.of(url, tls)
        self._bounds = bounds
        self._idle: collections.deque[UpstreamConnection] = collections.deque()
        self._closed = False

    async def request(
        self,
        method: str,
        target: str,
        headers: CIMultiDict[str],
        body: RequestBody,
        *,
        length: int | None,
        host: str | None,
        connect_timeout: float,
        read_timeout: float,
    ) -> UpstreamResponse:
        """Send one request and return its response once the head has arrived. `headers` are
        the end-to-end lines but Host (`host`, or else the upstream's own) and the body's
        framing, which are written here. A streamed
        `body` carries `length` bytes (None: it is sent chunked, as it came). The caller must `release`
        the response. A request that a reused connection failed before any byte of the
        answer is sent once more on a new connection when it may be: its method is
        idempotent and its body can be sent again."""
        head = self._head(method, target, headers, body, length, host)
        connection = self._take_idle()
        if connection is not None:
            try:
                return await connection.exchange(method, head, body, length, read_timeout)
            except UpstreamFailed:
                if connection.answering or method not in IDEMPOTENT or not (body is None or isinstance(body, bytes)):
                    raise
        connection = await self._connect(connect_timeout)
        return await connection.exchange(method, head, body, length, read_timeout)

    def release(self, response: UpstreamResponse) -> None:
        """The caller is done with `response`: its connection is kept for the next request
        when the response was read to the end and both sides keep it, else closed."""
        connection = response._connection
        if connection.reusable() and not self._closed:
            connection.reset()
            connection.idle_since = time.monotonic()
            self._idle.append(connection)
        else:
            connection.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close every idle connection; those in use close as they are released."""
        self._closed = True
        while self._idle:
            self._idle.pop().close()

    def _take_idle(self) -> UpstreamConnection | None:
        idle = self._idle
        stale = time.monotonic() - IDLE_SECONDS
        while idle and idle[0].idle_since < stale:
            idle.popleft().close()
        while idle:
            connection = idle.pop()  # the most recently used: the least likely to be closed by now
            if connection.open:
                return connection
        return None

    async def _connect(self, timeout: float) -> UpstreamConnection:
        endpoint = self.endpoint
        loop = asyncio.get_running_loop()
        connection = UpstreamConnection(loop, self._bounds)
        try:
            async with asyncio.timeout(timeout):
                await loop.create_connection(
                    lambda: connection,
                    endpoint.host,
                    endpoint.port,
                    ssl=endpoint.tls,
                    server_hostname=endpoint.host if endpoint.tls is not None else None,
                )
        except TimeoutError:
            connection.close()
            raise ConnectFailed("timed out", timed_out=True) from None
        except ssl.SSLError as exc:
            raise ConnectFailed(str(exc)) from None
        except OSError as exc:
            raise ConnectFailed(exc.strerror or str(exc)) from None
        return connection

    def _head(self, method: str, target: str, headers: CIMultiDict[str], body: RequestBody, length: int | None, host: str | None) -> bytes:
        endpoint = self.endpoint
        lines = [f"{method} {endpoint.base_path}{target} HTTP/1.1\r\nHost: {host or endpoint.authority}\r\n"]
        if endpoint.authorization is None:
            for name, value in headers.items():
                lines.append(f"{name}: {value}\r\n")
        else:
            # The URL's credentials are the gateway's login to this upstream: they replace the
            # client's, whom the upstream would otherwise see beside them, or instead of them.
            for name, value in headers.items():
                if name.lower() != "authorization":
                    lines.append(f"{name}: {value}\r\n")
            lines.append(f"Authorization: {endpoint.authorization}\r\n")
        if body is None:
            lines.append("Content-Length: 0\r\n\r\n" if method in _LENGTH_ALWAYS else "\r\n")
        elif length is not None:
            lines.append(f"Content-Length: {length}\r\n\r\n")
        else:
            lines.append("Transfer-Encoding: chunked\r\n\r\n")
        # The server decoded the client's bytes this way: encoded back, they are the same bytes.
        return "".join(lines).encode("utf-8", "surrogateescape")
