"""Hand-made HTTP/1.1 requests over a raw socket, from a chosen loopback address.

Linux answers on all of 127.0.0.0/8, so a test can be two different clients
(127.0.0.1 and 127.0.0.2) without a second machine."""

from __future__ import annotations

import asyncio
import json

from yarl import URL

RAW_TIMEOUT = 10.0


async def raw_request(url: str, request: bytes, *, local_host: str = "127.0.0.1") -> tuple[int, dict[str, list[str]], bytes]:
    """Send `request` verbatim (it must ask for Connection: close) and read the whole answer.
    Returns the status, the header values by lower-case name, and the body (never chunked here:
    the gateway's problem responses and the echo upstream's JSON carry a Content-Length)."""
    target = URL(url)
    reader, writer = await asyncio.open_connection(target.host, target.port, local_addr=(local_host, 0))
    try:
        writer.write(request)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), RAW_TIMEOUT)
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers: dict[str, list[str]] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers.setdefault(name.strip().lower(), []).append(value.strip())
    return int(lines[0].split()[1]), headers, body


def request_bytes(target: str, header_lines: list[tuple[bytes, bytes]] | list[tuple[str, str]]) -> bytes:
    """A GET of `target` with Host, the given header lines in order, and Connection: close."""
    out = bytearray(b"GET " + target.encode() + b" HTTP/1.1\r\nHost: gateway.test\r\n")
    for name, value in header_lines:
        name_b = name.encode() if isinstance(name, str) else name
        value_b = value.encode("latin-1") if isinstance(value, str) else value
        out += name_b + b": " + value_b + b"\r\n"
    return bytes(out + b"Connection: close\r\n\r\n")


def echoed(body: bytes) -> dict:
    """The echo upstream's view of a forwarded request (tests/upstream.py `echo`)."""
    return json.loads(body)


def echoed_headers(echo: dict, name: str) -> list[str]:
    return [v for n, v in echo["headers"] if n.lower() == name.lower()]
