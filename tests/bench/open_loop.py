"""An open-loop HTTP client, for latency without coordinated omission.

Requests fall due on a fixed schedule, one every 1/rate seconds, whatever the
server does, and each latency runs from the moment its request was *due* to the
last byte of its response. A server that stalls is charged for every request
it delayed, where a closed-loop client (wrk) would simply have sent fewer.
httperf schedules the same way, but with a new connection per request and only
a 1 ms histogram; this client keeps every latency, over keep-alive connections
as wrk and real API clients use them. A due request that finds every
connection busy waits for one, and the wait counts.

It runs on asyncio's select()-based loop on purpose: epoll_wait takes its
timeout in whole milliseconds, so on uvloop or asyncio's default loop requests
would leave in 1 ms clumps, each carrying up to 1 ms of the client's own delay.
select() takes microseconds. The scheduler's own lateness (dispatched minus
due) is reported so it can be told apart from the server's.

Prints one JSON object: counts, and p50/p90/p99/p99.9/max latency in ms.

    python -m tests.bench.open_loop --url http://127.0.0.1:8080/ --rate 2000 --duration 5
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import re
import selectors
import time
from urllib.parse import urlsplit

# Enough that requests rarely wait for a connection at the rates we run
# (latency of a few ms times a few thousand per second is a handful in flight).
DEFAULT_CONNECTIONS = 32
# How long the run waits for the last responses; one that has not come by then counts as infinitely late.
DRAIN_SECONDS = 5.0
# The first request falls due this long after the connections are open, so none starts late.
START_DELAY = 0.05
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*(\d+)", re.IGNORECASE)


class ProtocolError(Exception):
    """The response is not one this small client can frame (no Content-Length)."""


class Connection(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time."""

    def __init__(self, client: OpenLoopClient) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.due: float | None = None  # when the request in flight fell due
        self.response_size: int | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def send(self, request: bytes, due: float) -> None:
        assert self.transport is not None
        self.due = due
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.response_size is None:
            head_end = self.buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = bytes(self.buffer[:head_end])
            length = _CONTENT_LENGTH.search(head)
            if length is None:
                raise ProtocolError(f"response without Content-Length: {head[:60]!r}")
            self.status = int(head[9:12])
            self.response_size = head_end + 4 + int(length.group(1))
        if len(self.buffer) >= self.response_size:
            del self.buffer[: self.response_size]
            self.response_size = None
            due, self.due = self.due, None
            assert due is not None
            self.client.response_done(self, due, self.status)

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.connection_lost(self)


class OpenLoopClient:
    def __init__(self, url: str, *, api_keys: int) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        path = parts.path or "/"
        # One request per client key, built once: the client must cost as little per request as it can.
        self.requests = [
            f"GET {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nX-API-Key: client-{n}\r\n\r\n".encode()
            for n in range(api_keys)
        ]
        self.idle: list[Connection] = []
        self.waiting: collections.deque[tuple[float, int]] = collections.deque()
        self.latencies: list[float] = []
        self.dispatch_lags: list[float] = []  # how late the scheduler dispatched each request
        self.statuses: collections.Counter[int] = collections.Counter()
        self.in_flight = 0
        self.lost = 0
        self.waited_for_connection = 0  # due while all connections were busy; the wait counts as latency

    async def open(self, connections: int) -> None:
        loop = asyncio.get_running_loop()
        for _ in range(connections):
            _, connection = await loop.create_connection(lambda: Connection(self), self.host, self.port)
            self.idle.append(connection)

    async def run(self, rate: float, duration: float) -> None:
        interval = 1.0 / rate
        start = time.perf_counter() + START_DELAY
        for index in range(int(rate * duration)):
            due = start + index * interval
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            self.dispatch_lags.append(time.perf_counter() - due)
            self.in_flight += 1
            if self.idle:
                self.idle.pop().send(self.requests[index % len(self.requests)], due)
            else:
                self.waited_for_connection += 1
                self.waiting.append((due, index))
        drain_until = time.perf_counter() + DRAIN_SECONDS
        while self.in_flight and time.perf_counter() < drain_until:
            await asyncio.sleep(0.01)

    def response_done(self, connection: Connection, due: float, status: int) -> None:
        self.latencies.append(time.perf_counter() - due)
        self.statuses[status] += 1
        self.in_flight -= 1
        if self.waiting:
            waiting_due, index = self.waiting.popleft()
            connection.send(self.requests[index % len(self.requests)], waiting_due)
        else:
            self.idle.append(connection)

    def connection_lost(self, connection: Connection) -> None:
        if connection.due is not None:
            self.lost += 1
            self.in_flight -= 1
        if connection in self.idle:
            self.idle.remove(connection)

    def close(self) -> None:
        for connection in self.idle:
            if connection.transport is not None:
                connection.transport.close()

    def summary(self) -> dict[str, float | int]:
        # A response that never came is infinitely late: leaving it out would be the omission we avoid.
        unanswered = self.in_flight + self.lost
        latencies = sorted(self.latencies) + [math.inf] * unanswered
        lags = sorted(self.dispatch_lags)
        ms = 1000.0
        return {
            "due": len(self.dispatch_lags),
            "waited_for_connection": self.waited_for_connection,
            "completed": len(self.latencies),
            "unanswered": unanswered,
            "non_2xx": sum(count for status, count in self.statuses.items() if not 200 <= status < 300),
            "p50_ms": percentile(latencies, 50) * ms,
            "p90_ms": percentile(latencies, 90) * ms,
            "p99_ms": percentile(latencies, 99) * ms,
            "p999_ms": percentile(latencies, 99.9) * ms,
            "max_ms": latencies[-1] * ms if latencies else math.nan,
            "dispatch_lag_p50_ms": percentile(lags, 50) * ms,
            "dispatch_lag_p99_ms": percentile(lags, 99) * ms,
        }


def percentile(sorted_values: list[float], percent: float) -> float:
    """Nearest rank: the smallest value that at least `percent`% of the values do not exceed."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(percent / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


async def measure(url: str, rate: float, duration: float, connections: int, api_keys: int) -> dict[str, float | int]:
    client = OpenLoopClient(url, api_keys=api_keys)
    try:
        await client.open(connections)
        await client.run(rate, duration)
    finally:
        client.close()
    return client.summary()


def select_loop() -> asyncio.AbstractEventLoop:
    return asyncio.SelectorEventLoop(selectors.SelectSelector())


def main() -> None:
    parser = argparse.ArgumentParser(description="Open-loop HTTP latency at a fixed request rate.")
    parser.add_argument("--url", required=True)
    parser.add_argument("--rate", type=float, required=True, help="requests per second")
    parser.add_argument("--duration", type=float, required=True, help="seconds of schedule")
    parser.add_argument("--connections", type=int, default=DEFAULT_CONNECTIONS)
    parser.add_argument("--api-keys", type=int, default=10_000, help="distinct X-API-Key values, in turn")
    args = parser.parse_args()
    with asyncio.Runner(loop_factory=select_loop) as runner:
        result = runner.run(measure(args.url, args.rate, args.duration, args.connections, args.api_keys))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
