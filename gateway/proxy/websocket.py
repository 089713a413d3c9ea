"""WebSocket upgrades, proxied both ways. The rate limit has already been
applied to the handshake; frames that follow are not counted."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from gateway.proxy.problem import problem

# The client library writes its own handshake fields; the client's must not be sent twice.
_HANDSHAKE_HEADERS = ("Sec-WebSocket-Key", "Sec-WebSocket-Version", "Sec-WebSocket-Extensions", "Sec-WebSocket-Protocol")


def is_websocket_upgrade(request: web.BaseRequest) -> bool:
    if request.headers.get("Upgrade", "").lower() != "websocket":
        return False  # most requests: no need to read Connection
    connection = {t.strip().lower() for line in request.headers.getall("Connection", ()) for t in line.split(",")}
    return "upgrade" in connection


async def proxy_websocket(
    request: web.BaseRequest,
    session: aiohttp.ClientSession,
    url: URL,
    headers: CIMultiDict[str],
    limit_headers: Mapping[str, str],
) -> web.StreamResponse:
    """Open the upstream WebSocket first, so its refusal becomes a 502 and its subprotocol is the one agreed."""
    protocols = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()]
    for name in _HANDSHAKE_HEADERS:
        headers.popall(name, None)
    ws_url = url.with_scheme("wss" if url.scheme == "https" else "ws")
    try:
        upstream = await session.ws_connect(ws_url, headers=headers, protocols=protocols, autoping=False)
    except aiohttp.WSServerHandshakeError as exc:
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
    async with upstream:
        client = web.WebSocketResponse(protocols=[upstream.protocol] if upstream.protocol else (), autoping=False)
        client.headers.update(limit_headers)
        await client.prepare(request)
        to_upstream = asyncio.ensure_future(_pipe(client, upstream))
        to_client = asyncio.ensure_future(_pipe(upstream, client))
        done, pending = await asyncio.wait({to_upstream, to_client}, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        close_code = upstream.close_code if to_client in done else client.close_code
        await client.close(code=close_code or aiohttp.WSCloseCode.OK)
        await upstream.close(code=client.close_code or aiohttp.WSCloseCode.OK)
    return client


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
