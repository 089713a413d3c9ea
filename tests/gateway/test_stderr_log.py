"""The gateway's own log when nothing reads stderr (a stalled Docker or journald log
driver): the lines go through a bounded queue written by a thread of their own, so a
full pipe costs log lines, counted in gateway_log_lines_dropped_total, never requests.

The lines come from a real source: each request to an upstream that refuses
connections logs one warning. Nothing reads stderr past the startup line until the
test says so (GatewayProcess(read_stderr=False))."""

from __future__ import annotations

import asyncio
import re
import signal

import aiohttp

from gateway.log_lines import FLUSH_SECONDS, STDERR_QUEUE_LINES
from tests.processes import GatewayProcess, eventually, free_port
from tests.raw_client import pipelined
from tests.scrape import scrape, value

# Requests are sent phase by phase, each phase to its own refusing upstream, so the
# order of the kept lines can be read from them. Five queues' worth overflows the
# pipe (64 KiB, some 600 lines), the line in the writer's hands and the queue.
PHASES = 5
PER_PHASE = STDERR_QUEUE_LINES
SENDERS = 10
# One whole line of the gateway's log, as cli formats it.
LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR) [\w.]+: [^\n]*\n")
REFUSED = re.compile(r"cannot connect to upstream http://127\.0\.0\.(\d+):\d+: ")


def refusing_yaml() -> str:
    port = free_port()  # bound and closed again: nothing listens there
    routes = "".join(
        f"  - match: {{path: /p{phase}}}\n    upstream: http://127.0.0.{phase + 1}:{port}\n" for phase in range(PHASES)
    )
    return f"listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\nshutdown_grace: 1s\nroutes:\n{routes}"


async def send_phases(gw: GatewayProcess, phases: int = PHASES) -> None:
    """PER_PHASE requests to each of the first `phases` routes in turn, SENDERS at once,
    each sender pipelining its share on one connection; each must be answered 502, with no
    wait for the next answer longer than the raw client's timeout."""

    async def sender(path: str) -> None:
        count = PER_PHASE // SENDERS
        requests = [f"GET {path} HTTP/1.1\r\nHost: gw\r\n\r\n".encode()] * (count - 1)
        requests.append(f"GET {path} HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n".encode())
        assert await pipelined(gw.url, requests) == [502] * count

    for phase in range(phases):
        await asyncio.gather(*(sender(f"/p{phase}") for _ in range(SENDERS)))


async def dropped(gw: GatewayProcess) -> float:
    async with aiohttp.ClientSession() as http:
        return value((await scrape(http, gw.admin_url))[1], "gateway_log_lines_dropped_total")


def refused_phases(lines: list[str]) -> list[int]:
    return [int(match.group(1)) - 1 for line in lines if (match := REFUSED.search(line))]


async def test_a_stalled_stderr_costs_log_lines_never_requests():
    """Nothing reads stderr: requests are answered all the same, /metrics too, and each line
    that found the queue full is counted dropped. Read at last, the kept lines come out
    whole and in order."""
    sent = PHASES * PER_PHASE
    with GatewayProcess(refusing_yaml(), read_stderr=False) as gw:
        await send_phases(gw)
        assert await dropped(gw) > 0
        gw.read_stderr()

        async def every_line_accounted() -> bool:
            return len(refused_phases(gw.stderr_lines)) + await dropped(gw) == sent

        await eventually(every_line_accounted, what="each refused request's line written or counted dropped")
        dropped_count = await dropped(gw)
        assert await asyncio.to_thread(gw.stop) == 0
    kept = refused_phases(gw.stderr_lines)
    assert len(kept) + dropped_count == sent  # and nothing more came at the stop
    assert len(kept) >= STDERR_QUEUE_LINES
    # Lines are dropped only while the queue is full, and it never drains while stderr is
    # not read: the kept lines are the first ones, phase after phase.
    assert kept == sorted(kept) and kept[0] == 0
    broken = [line for line in gw.stderr_lines if not LOG_LINE.fullmatch(line)]
    assert not broken, broken[:3]
    assert gw.stderr_lines[-1].endswith("INFO gateway: stopped\n")


async def test_a_stop_exits_within_the_grace_when_stderr_is_blocked():
    """shutdown_grace is 1s; the queued lines get FLUSH_SECONDS more, then are given up."""
    with GatewayProcess(refusing_yaml(), read_stderr=False) as gw:
        await send_phases(gw, 2)  # lines past what the pipe takes: the writer is blocked at the stop
        gw.signal(signal.SIGTERM)
        assert await asyncio.to_thread(gw.wait, 1 + FLUSH_SECONDS + 3) == 0
