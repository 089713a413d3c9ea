"""Hand-made HTTP/1.1 requests over a raw socket, from a chosen loopback address.

Linux answers on all of 127.0.0.0/8, so a test can be two different clients
(127.0.0.1 and 127.0.0.2) without a second machine."""

from __future__ import annotations

import asyncio
import json

from yarl import URL

RAW_TIMEOUT = 10.0


def _dechunk(body: bytes) -> bytes:
    out = bytearray()
    while True:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += body[:size]
        body = body[size + 2 :]


async def raw_exchange(
    url: str, request: bytes, *, local_host: str = "127.0.0.1"
) -> tuple[int, list[tuple[str, str]], bytes]:
    """Send `request` verbatim (it must ask for Connection: close) and read the whole answer.
    Returns the status, every header line in order, and the body with chunked framing removed."""
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
    status = int(lines[0].split()[1])
    headers = [(name.strip(), value.strip()) for name, _, value in (line.partition(":") for line in lines[1:])]
    if any(n.lower() == "transfer-encoding" and "chunked" in v.lower() for n, v in headers):
        body = _dechunk(body)
    return status, headers, body


def values(headers: list[tuple[str, str]], name: str) -> list[str]:
    return [v for n, v in headers if n.lower() == name.lower()]


async def raw_request(url: str, request: bytes, *, local_host: str = "127.0.0.1") -> tuple[int, dict[str, list[str]], bytes]:
    """`raw_exchange`, with the header values by lower-case name."""
    status, lines, body = await raw_exchange(url, request, local_host=local_host)
    headers: dict[str, list[str]] = {}
    for name, value in lines:
        headers.setdefault(name.lower(), []).append(value)
    return status, headers, body


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


async def pipelined(url: str, requests: list[bytes], *, timeout: float = RAW_TIMEOUT) -> list[int]:
    """Send `requests` on one connection at once, not waiting for any answer (HTTP/1.1
    pipelining: the last must ask for Connection: close), and read the answers to the end;
    returns their statuses in order. Every read must bring bytes within `timeout`, and every
    answer must carry a Content-Length (the gateway's own do). Thousands of requests cost
    the client next to nothing, so a test that needs many measures the gateway, not aiohttp."""
    target = URL(url)
    reader, writer = await asyncio.open_connection(target.host, target.port)

    async def read_to_the_end() -> bytes:
        chunks = []
        while chunk := await asyncio.wait_for(reader.read(1 << 16), timeout):
            chunks.append(chunk)
        return b"".join(chunks)

    reading = asyncio.ensure_future(read_to_the_end())  # read while writing: answers fill a buffer too
    try:
        writer.write(b"".join(requests))
        await writer.drain()
        data = await reading
    finally:
        reading.cancel()
        writer.close()
        await writer.wait_closed()
    statuses = []
    while data:
        head, end, data = data.partition(b"\r\n\r\n")
        assert end, f"an answer's head ends early: {head[:200]!r}"
        status_line, *lines = head.split(b"\r\n")
        statuses.append(int(status_line.split()[1]))
        lengths = [int(value) for name, _, value in (line.partition(b":") for line in lines) if name.lower() == b"content-length"]
        assert len(lengths) == 1, head
        data = data[lengths[0]:]
    return statuses
