"""HTTP/1.1 to one upstream: one `asyncio.Protocol` per keep-alive connection
(`gateway.upstream.connection`), the upstream's idle connections kept for the next
request (`IdleConnections`: connections to one target, not balancing's pool of targets),
and responses parsed by llhttp (httptools), the parser of Node and uvicorn.

Knows nothing of routes, limits or aiohttp's server. The proxy hands it a method, a
request target, header lines and a body (`gateway.upstream.body.RequestBody`) and gets an
`UpstreamResponse` whose body it reads in bounded chunks: past `HIGH_WATER` bytes not
yet read, the connection stops reading from the upstream (`pause_reading`), and a body
the upstream does not take pauses its sender (`pause_writing`). What each request's head
starts with, Host and the URL's credentials, is written once per upstream (`Endpoint`).

Trusts the config's URLs; trusts nothing an upstream sends. A response whose framing is
ambiguous (Content-Length twice, or beside Transfer-Encoding; a transfer coding other than
chunked) or that llhttp refuses fails the attempt, and its connection is never reused. A
connection is kept idle only once its response was read to the end and both sides meant
to keep it. Every failure leaves as one of `gateway.upstream.errors`:
`ConnectFailed` (nothing was sent), `UpstreamTimeout` and `UpstreamFailed`.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import ssl
import time
from dataclasses import dataclass

from multidict import CIMultiDict
from yarl import URL

from gateway.upstream.body import RequestBody
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


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where an upstream base URL points, and the parts of each request's head that only
    the URL decides, written once here rather than on every request."""

    host: str
    port: int
    tls: ssl.SSLContext | None
    authority: str  # the Host header: host, and the port when it is not the scheme's
    base_path: str  # the URL's path, before each request's own
    authorization: str | None  # Basic credentials from the URL's user information, replacing the request's
    # What follows the request target: the version and the Host line (`authority`). A
    # request that keeps its client's Host writes its own.
    after_target: str
    # The Authorization line of `authorization`, written after the request's headers; "" without one.
    authorization_line: str

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
            after_target=_after_target(authority),
            authorization_line="" if authorization is None else f"Authorization: {authorization}\r\n",
        )


def _after_target(host: str) -> str:
    return f" HTTP/1.1\r\nHost: {host}\r\n"


class IdleConnections:
    """The connections to one upstream that no request is using, kept alive for the next
    ones: the most recently released is taken first, and one idle past `IDLE_SECONDS` is
    closed instead. (Balancing's pool is another thing: the targets of a route.)"""

    __slots__ = ("_kept",)

    def __init__(self) -> None:
        self._kept: collections.deque[tuple[float, UpstreamConnection]] = collections.deque()  # (since, connection)

    def keep(self, connection: UpstreamConnection) -> None:
        self._kept.append((time.monotonic(), connection))

    def take(self) -> UpstreamConnection | None:
        """The most recently kept connection still open, or None."""
        kept = self._kept
        stale = time.monotonic() - IDLE_SECONDS
        while kept and kept[0][0] < stale:
            kept.popleft()[1].close()
        while kept:
            connection = kept.pop()[1]  # the most recently used: the least likely to be closed by now
            if connection.open:
                return connection
        return None

    def close(self) -> None:
        while self._kept:
            self._kept.pop()[1].close()


class UpstreamClient:
    """Requests to one upstream, sent over its idle connections or new ones."""

    def __init__(self, url: str, tls: ssl.SSLContext | None, bounds: HeadBounds = DEFAULT_BOUNDS) -> None:
        self.endpoint = Endpoint.of(url, tls)
        self._bounds = bounds
        self._idle = IdleConnections()
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
        connection = self._idle.take()
        if connection is not None:
            try:
                return await connection.exchange(method, head, body, length, read_timeout)
            except UpstreamFailed:
                if connection.answering or method not in IDEMPOTENT or not (body is None or isinstance(body, bytes)):
                    raise
        connection = await self._connect(connect_timeout)
        return await connection.exchange(method, head, body, length, read_timeout)

    def release(self, response: UpstreamResponse) -> None:
        """The caller is done with `response`: its connection is kept idle for the next
        request when the response was read to the end and both sides keep it, else closed."""
        connection = response._connection
        if connection.reusable() and not self._closed:
            connection.reset()
            self._idle.keep(connection)
        else:
            connection.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close every idle connection; those in use close as they are released."""
        self._closed = True
        self._idle.close()

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
        after_target = endpoint.after_target if host is None else _after_target(host)
        lines = [f"{method} {endpoint.base_path}{target}{after_target}"]
        if not endpoint.authorization_line:
            for name, value in headers.items():
                lines.append(f"{name}: {value}\r\n")
        else:
            # The URL's credentials are the gateway's login to this upstream: they replace the
            # client's, whom the upstream would otherwise see beside them, or instead of them.
            for name, value in headers.items():
                if name.lower() != "authorization":
                    lines.append(f"{name}: {value}\r\n")
            lines.append(endpoint.authorization_line)
        if body is None:
            lines.append("Content-Length: 0\r\n\r\n" if method in _LENGTH_ALWAYS else "\r\n")
        elif length is not None:
            lines.append(f"Content-Length: {length}\r\n\r\n")
        else:
            lines.append("Transfer-Encoding: chunked\r\n\r\n")
        # The server decoded the client's bytes this way: encoded back, they are the same bytes.
        return "".join(lines).encode("utf-8", "surrogateescape")
