"""`python -m tests.bench.parsers`: the cost of parsing one small upstream response with
each C parser the upstream client could use, interleaved (A B A B ...), medians.

- httptools (llhttp), public API: the parser calls back with header and body bytes.
- aiohttp's own C parser (`aiohttp._http_parser`), private API: it builds a message
  object, a header multidict and a payload stream per response.

Each figure includes the work that gets the head and body into the hands of the
caller, as the gateway's client would take them.
"""

from __future__ import annotations

import asyncio
import platform
import statistics
import time

import httptools
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http_parser import HttpResponseParserC

RESPONSE = (
    b"HTTP/1.1 200 OK\r\nServer: nginx\r\nDate: Tue, 01 Dec 2026 22:53:54 GMT\r\n"
    b"Content-Type: text/plain\r\nContent-Length: 3\r\nConnection: keep-alive\r\n\r\nok\n"
)
PER_ROUND = 50_000
ROUNDS = 7


class _Collector:
    __slots__ = ("body", "complete", "headers")

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.complete = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True


def httptools_round() -> float:
    collector = _Collector()
    parser = httptools.HttpResponseParser(collector)
    started = time.perf_counter()
    for _ in range(PER_ROUND):
        parser.feed_data(RESPONSE)
        collector.headers.clear()
        collector.body.clear()
    return (time.perf_counter() - started) / PER_ROUND * 1e6


def aiohttp_round(loop: asyncio.AbstractEventLoop) -> float:
    parser = HttpResponseParserC(BaseProtocol(loop), loop, 2**16)
    started = time.perf_counter()
    for _ in range(PER_ROUND):
        messages, _upgraded, _tail = parser.feed_data(RESPONSE)
        for message, payload in messages:
            message.headers.get("Content-Type")
            payload.read_nowait()
    return (time.perf_counter() - started) / PER_ROUND * 1e6


def main() -> None:
    loop = asyncio.new_event_loop()
    ours, theirs = [], []
    for _ in range(ROUNDS):
        theirs.append(aiohttp_round(loop))
        ours.append(httptools_round())
    loop.close()
    print(f"machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}")
    print(f"aiohttp's C parser: {statistics.median(theirs):.2f} µs a response (median of {ROUNDS} rounds)")
    print(f"httptools (llhttp): {statistics.median(ours):.2f} µs a response (median of {ROUNDS} rounds)")
    print(f"ratio: {statistics.median(theirs) / statistics.median(ours):.2f}")


if __name__ == "__main__":
    main()
