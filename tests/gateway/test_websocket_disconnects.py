"""WebSocket clients that vanish: mid-relay with a reset, or while their handshake waits
for the upstream. Each is a client's doing, so the gateway logs no traceback: the session
gets its access line (101 once it was open; 499, as for HTTP, when the client left before
the answer), and the upstream's side is closed.

The gateway runs as users run it (`gateway run --access-log json`), its stderr captured;
the upstream is a real aiohttp server."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from tests.processes import GatewayProcess, eventually
from tests.raw_client import RAW_TIMEOUT
from tests.scrape import scrape, value
from tests.upstream import serving

HANDSHAKE = (
    b"GET /%s HTTP/1.1\r\nHost: gw\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
    b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
)
CLIENTS = 5


class Upstream:
    """/ticks sends frames as fast as its peer takes them, until that peer is gone; /held
    answers its handshake only once `release` is set. Both read what they are sent, so
    they answer a close frame."""

    def __init__(self) -> None:
        self.ticking = 0
        self.ended = 0
        self.held = 0
        self.release = asyncio.Event()

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.path == "/held":
            self.held += 1
            await self.release.wait()
        ws = web.WebSocketResponse()
        await ws.prepare(request)  # type: ignore[arg-type]
        self.ticking += 1
        ticker = asyncio.ensure_future(self._tick(ws))
        try:
            async for _ in ws:
                pass
        finally:
            ticker.cancel()
            self.ended += 1
        return ws

    @staticmethod
    async def _tick(ws: web.WebSocketResponse) -> None:
        while not ws.closed:
            try:
                await ws.send_str("tick")
            except ConnectionError:
                return
            await asyncio.sleep(0)


def config(upstream: str) -> str:
    return f"listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\nroutes:\n  - match: {{path: /}}\n    upstream: {upstream}\n"


async def open_raw(url: str, path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    writer.write(HANDSHAKE % path.encode())
    await writer.drain()
    return reader, writer


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a client that crashed or lost its network."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def access_lines(gw: GatewayProcess) -> list[dict]:
    return [json.loads(line) for line in gw.stdout_lines if line.startswith("{")]


async def test_clients_resetting_mid_relay_end_their_sessions_without_a_traceback():
    upstream = Upstream()
    async with serving(upstream.handle) as url:
        with GatewayProcess(config(url), args=("--access-log", "json")) as gw:
            for _ in range(CLIENTS):
                reader, writer = await open_raw(gw.url, "ticks")
                assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), RAW_TIMEOUT)).startswith(b"HTTP/1.1 101 ")
                await asyncio.wait_for(reader.readexactly(6), RAW_TIMEOUT)  # a first frame: "tick" relayed
                reset(writer)
            await eventually(lambda: upstream.ended == CLIENTS, what="each upstream side to be closed")
            await eventually(lambda: len(access_lines(gw)) == CLIENTS, what="an access line per session")
            assert [line["status"] for line in access_lines(gw)] == [101] * CLIENTS
            async with aiohttp.ClientSession() as http:  # still serving, and it was counted
                _, samples = await scrape(http, gw.admin_url)
            assert value(samples, "gateway_requests_total", route="/", method="GET", status_class="1xx") == CLIENTS
        stderr = "".join(gw.stderr_lines)
        assert "Traceback" not in stderr and "exception was never retrieved" not in stderr, stderr


async def test_a_client_leaving_while_its_handshake_waits_is_logged_as_499_without_a_traceback():
    upstream = Upstream()
    async with serving(upstream.handle) as url:
        with GatewayProcess(config(url), args=("--access-log", "json")) as gw:
            _, writer = await open_raw(gw.url, "held")
            await eventually(lambda: upstream.held == 1, what="the upstream to have the handshake")
            reset(writer)
            upstream.release.set()  # the upstream accepts a handshake whose client is gone
            await eventually(lambda: upstream.ended == 1, what="the upstream side to be closed")
            await eventually(lambda: len(access_lines(gw)) == 1, what="the access line")
            assert access_lines(gw)[0]["status"] == 499
            async with aiohttp.ClientSession() as http:
                _, samples = await scrape(http, gw.admin_url)
            assert value(samples, "gateway_client_closed_requests_total", route="/") == 1
            assert not [s for s in samples if s.name == "gateway_requests_total" and s.labels.get("status_class") == "5xx"]
        stderr = "".join(gw.stderr_lines)
        assert "Traceback" not in stderr, stderr
