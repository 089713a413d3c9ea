"""WebSocket upgrades, proxied both ways. The rate limit has already been
applied to the handshake; frames that follow are not counted."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from gateway.proxy.problem import problem

# The client library writes its own handshake fields; the client's must not be sent twice.
_HANDSHAKE_HEADERS = ("Sec-WebSocket-Key", "Sec-WebSocket-Version", "Sec-WebSocket-Extensions", "Sec-WebSocket-Protocol")
# Codes that only report locally and MUST NOT be sent in a close frame (RFC 6455 §7.4.1):
# no code received (1005), the connection lost with no close frame (1006), TLS failed (1015).
# aiohttp reports a peer that vanished as 1006; browsers fail a close frame that carries it.
_UNSENDABLE_CLOSE_CODES = frozenset({1005, 1006, 1015})


def is_websocket_upgrade(request: web.BaseRequest) -> bool:
    if request.headers.get("Upgrade", "").lower() != "websocket":
        return False  # most requests: no need to read Connection
    connection = {t.strip().lower() for line in request.headers.getall("Connection", ()) for t in line.split(",")}
    return "upgrade" in connection


class ClientLeft(Exception):
    """The client's connection was lost before the upstream's acceptance of its handshake
    could be passed on: the client's doing, answered as a client that closed (499)."""


class WebSocketConnectFailed(Exception):
    """The upstream could not be connected to (refused, unreachable, or past the route's
    `timeout.connect`): nothing was sent, so another pool target may take the handshake.
    `response` is the client's answer if none does; `reason`, why, is for the log."""

    def __init__(self, response: web.Response, reason: str) -> None:
        super().__init__()
        self.response = response
        self.reason = reason


async def proxy_websocket(
    request: web.BaseRequest,
    session: aiohttp.ClientSession,
    url: URL,
    headers: CIMultiDict[str],
    limit_headers: Mapping[str, str],
    timed_out: web.Response,
    answered: Callable[[int, float], None],
    opened: Callable[[], None] | None = None,
) -> web.StreamResponse:
    """Open the upstream WebSocket first, so its refusal becomes a 502 and its subprotocol is
    the one agreed. `session` carries the route's connect and read timeouts, which bound the
    handshake; past either, `timed_out` (a 504) is the answer. A connect failure raises
    WebSocketConnectFailed. `answered` is given the status of the upstream's answer to the
    handshake (101, or the status it refused with) and the seconds it took, as the access
    log and gateway_upstream_latency_seconds take an HTTP response's; `opened` is called
    once the upstream has accepted the handshake. A client gone by then raises ClientLeft."""
    protocols = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()]
    for name in _HANDSHAKE_HEADERS:
        headers.popall(name, None)
    ws_url = url.with_scheme("wss" if url.scheme == "https" else "ws")
    sent = time.perf_counter()
    try:
        upstream = await session.ws_connect(ws_url, headers=headers, protocols=protocols, autoping=False)
    except aiohttp.ConnectionTimeoutError:
        raise WebSocketConnectFailed(timed_out, "timed out") from None
    except aiohttp.ClientConnectorError as exc:
        detail = f"Cannot open a WebSocket to the upstream: {type(exc).__name__}."
        reason = str(exc.os_error.strerror or exc)  # an untrusted certificate's [SSL: ...] too
        raise WebSocketConnectFailed(problem(502, "Bad Gateway", detail, headers=limit_headers), reason) from None
    except TimeoutError:
        return timed_out  # connected, but no handshake answer within timeout.read
    except aiohttp.WSServerHandshakeError as exc:
        answered(exc.status, time.perf_counter() - sent)
        return problem(
            502,
            "Bad Gateway",
            f"The upstream refused the WebSocket handshake with status {exc.status}.",
            headers=limit_headers,
        )
    except aiohttp.ClientError as exc:
        return problem(
            502, "Bad Gateway", f"Cannot open a WebSocket to the upstream: {type(exc).__name__}.", headers=limit_headers
        )
    answered(101, time.perf_counter() - sent)  # ws_connect returns only on 101 Switching Protocols
    if opened is not None:
        opened()
    async with upstream:
        client = web.WebSocketResponse(protocols=[upstream.protocol] if upstream.protocol else (), autoping=False)
        client.headers.update(limit_headers)
        try:
            await client.prepare(request)
        except ConnectionError:
            await upstream.close(code=aiohttp.WSCloseCode.GOING_AWAY)
            raise ClientLeft from None
        to_upstream = asyncio.ensure_future(_pipe(client, upstream))
        to_client = asyncio.ensure_future(_pipe(upstream, client))
        done, pending = await asyncio.wait({to_upstream, to_client}, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            _peer_gone(task)
        if to_client in done:
            # The upstream ended it: a vanished upstream is the gateway's failure to the client.
            await client.close(code=_sendable(upstream.close_code, lost=aiohttp.WSCloseCode.BAD_GATEWAY))
        await upstream.close(code=_sendable(client.close_code, lost=aiohttp.WSCloseCode.GOING_AWAY))
        await client.close()  # a no-op when closed above, or by the client's own close frame
    return client


def _sendable(code: int | None, *, lost: int) -> int:
    """`code` as a close frame to the other side may carry it: `lost` for a peer whose
    connection ended with no close frame, 1000 for one whose close frame had no code."""
    if code in _UNSENDABLE_CLOSE_CODES:
        return lost
    return code or aiohttp.WSCloseCode.OK


def _peer_gone(task: asyncio.Task[None]) -> None:
    """Retrieve a finished relay's failure: a write to a side that reset its connection
    ends the session like a close, with no traceback (the client's doing, or the
    upstream's, never the gateway's); anything else is a failure of our own, raised."""
    failure = task.exception()
    if failure is not None and not isinstance(failure, ConnectionError):
        raise failure


async def _pipe(source, sink) -> None:
    async for message in source:
        if message.type == aiohttp.WSMsgType.TEXT:
            await sink.send_str(message.data)
        elif message.type == aiohttp.WSMsgType.BINARY:
            await sink.send_bytes(message.data)
        elif message.type == aiohttp.WSMsgType.PING:
            await sink.ping(message.data)
        elif message.type == aiohttp.WSMsgType.PONG:
            await sink.pong(message.data)
