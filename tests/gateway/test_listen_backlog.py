"""The listen backlog: the kernel queues a burst of new clients for the public listener
instead of dropping their SYNs, which a client only retries a second later.

The gateway is started as users start it and stopped (SIGSTOP) while the clients
connect, so every connection that completes was queued by the kernel, not accepted."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess

import pytest

from gateway.config.model import DEFAULT_LISTEN_BACKLOG
from tests.gateway.test_reload import reload_with
from tests.helpers import error_of
from tests.processes import GatewayProcess, free_port

CLIENTS = 1000
# Only a failing run waits this long: a SYN the kernel dropped is retried after 1 s, 3 s, 7 s…
CONNECT_DEADLINE = 30
ROUTES = "routes:\n  - match: {path: /only}\n    upstream: http://127.0.0.1:9\n"


async def connect_all(port: int, count: int) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    attempts = [asyncio.ensure_future(asyncio.open_connection("127.0.0.1", port)) for _ in range(count)]
    done, pending = await asyncio.wait(attempts, timeout=CONNECT_DEADLINE)
    for attempt in pending:
        attempt.cancel()
    connected = [attempt.result() for attempt in done if attempt.exception() is None]
    if len(connected) < count:
        for _, writer in connected:
            writer.close()
        pytest.fail(f"{len(connected)} of {count} connections were queued; the rest waited on SYN retries")
    return connected


async def answer_of(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    writer.write(b"GET /elsewhere HTTP/1.1\r\nHost: gateway.test\r\nConnection: close\r\n\r\n")
    status = await reader.readline()
    writer.close()
    return status.split(b" ")[1]


async def test_a_thousand_clients_connecting_at_once_are_all_queued_and_answered():
    with GatewayProcess(ROUTES) as gateway:
        port = int(gateway.url.rsplit(":", 1)[1])
        assert gateway.process is not None
        os.kill(gateway.process.pid, signal.SIGSTOP)
        try:
            connections = await connect_all(port, CLIENTS)
        finally:
            os.kill(gateway.process.pid, signal.SIGCONT)
        answers = await asyncio.gather(*(answer_of(reader, writer) for reader, writer in connections))
    assert answers == [b"404"] * CLIENTS


def listen_queue_sizes() -> dict[int, int]:
    """Each listening TCP port's backlog, as the kernel reports it (ss: Send-Q of a listener)."""
    lines = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True, check=True).stdout.splitlines()
    sizes = {}
    for line in lines:
        fields = line.split()
        sizes[int(fields[3].rsplit(":", 1)[1])] = int(fields[2])
    return sizes


def test_the_configured_backlog_is_the_public_and_decision_listeners_queue():
    decision_port = free_port()
    config = (
        "listen: {address: 127.0.0.1:0, backlog: 64}\n"
        f"decision_listen: 127.0.0.1:{decision_port}\ntrusted_proxies: [127.0.0.1/32]\n" + ROUTES
    )
    with GatewayProcess(config) as gateway:
        sizes = listen_queue_sizes()
        assert sizes[int(gateway.url.rsplit(":", 1)[1])] == 64
        assert sizes[decision_port] == 64


def test_the_default_backlog_holds_a_workers_max_in_flight():
    with GatewayProcess(ROUTES) as gateway:
        assert listen_queue_sizes()[int(gateway.url.rsplit(":", 1)[1])] == DEFAULT_LISTEN_BACKLOG


@pytest.mark.parametrize(
    ("backlog", "expected"),
    [
        ("0", "listen.backlog: expected an integer >= 1, got 0"),
        ("65536", "listen.backlog: expected an integer <= 65,535, got 65,536"),
        ("lots", "listen.backlog: expected an integer, got a string"),
    ],
)
def test_a_backlog_out_of_range_is_one_line_naming_it(backlog, expected):
    message = error_of(f"listen: {{address: 127.0.0.1:8080, backlog: {backlog}}}\n{ROUTES}")
    assert message.endswith(expected), message


async def test_a_reload_keeps_the_listeners_backlog_and_says_it_waits_for_a_restart():
    port, admin = free_port(), free_port()
    def config(backlog: int) -> str:
        return f"listen: {{address: 127.0.0.1:{port}, backlog: {backlog}}}\nadmin_listen: 127.0.0.1:{admin}\n" + ROUTES
    with GatewayProcess(config(64)) as gateway:
        await reload_with(gateway, config(256), "only at restart")
        warned = [line for line in gateway.stderr_lines if "only at restart" in line]
        assert warned[0].rstrip().endswith("changed settings that take effect only at restart: listen.backlog"), warned
        assert listen_queue_sizes()[port] == 64
