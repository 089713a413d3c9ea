"""A small TCP chaos proxy for the fault tests: it stands between the gateway and
a real redis-server, as the network does, and misbehaves on command.

tc netem is not available on this kernel, so the network's faults are made here.
The proxy is a process of its own, put at real-time CPU priority by `ChaosProxy`
like `RedisServer(dedicated=True)`: on this 2-core machine the gateway and the
test's load keep both cores busy, and a proxy in the test's event loop or in a
thread (waiting for the GIL) would add milliseconds of its own to round trips
that a 10 ms store timeout measures.

Modes, switched at any time:

- `pass`: bytes flow both ways as they arrive.
- `delay MS`: every reply (server to client) is delivered MS ms after it
  arrived, in order, so each round trip takes MS ms longer.
- `blackhole`: connections are accepted and read, and nothing is forwarded or
  answered. What was read is delivered in order when the mode ends, as TCP
  delivers after a partition heals; a connection closed meanwhile loses it.
- `reset`: the next reply on each connection is cut: its first half is
  forwarded, then the client's connection is reset (SO_LINGER 0: an RST, not a
  FIN). Connections made while the mode lasts die the same way.
- `refuse`: nothing listens (connects are refused) and every connection is
  closed.

It also counts the commands clients sent, by name, parsed with hiredis, so a
test knows how many reached Redis (or would have).

Run as `python -m tests.chaos_proxy TARGET_PORT`: it prints `listening PORT`,
then answers one line on stdout for each line on stdin: `mode pass`,
`mode delay 10`, `mode blackhole`, `mode reset`, `mode refuse` (answer `ok`),
or `counts` (answer: a JSON object of command name to count).
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import signal
import socket
import struct
import subprocess
import sys
from pathlib import Path

import hiredis

HOST = "127.0.0.1"
READ_SIZE = 65536


class Proxy:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.mode = "pass"
        self.delay = 0.0
        self.flowing = asyncio.Event()  # cleared while blackholed
        self.flowing.set()
        self.commands: collections.Counter[str] = collections.Counter()
        self.links: set[Link] = set()
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task] = set()

    async def listen(self) -> None:
        self._server = await asyncio.start_server(self._accepted, HOST, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def set_mode(self, mode: str, delay_ms: float = 0.0) -> None:
        if self.mode == "refuse" and mode != "refuse":
            await self.listen()  # the same port again
        self.mode, self.delay = mode, delay_ms / 1000
        if mode == "refuse":
            assert self._server is not None
            self._server.close()
            for link in list(self.links):
                link.close()
        if mode == "blackhole":
            self.flowing.clear()
        else:
            self.flowing.set()

    async def _accepted(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(HOST, self.target_port)
        except OSError:
            client_writer.close()  # Redis is not there: the connection ends
            return
        link = Link(self, client_reader, client_writer, server_reader, server_writer)
        self.links.add(link)
        self._handlers.add(asyncio.current_task())
        await link.run()
        self.links.discard(link)
        self._handlers.discard(asyncio.current_task())

    async def close(self) -> None:
        """Close every connection and wait for their handlers, so none is cancelled mid-way."""
        if self._server is not None:
            self._server.close()
        for link in list(self.links):
            link.close()
        await asyncio.gather(*self._handlers, return_exceptions=True)


class Link:
    """One client connection and its connection to Redis: a reader and a sender each way."""

    def __init__(self, proxy: Proxy, client_reader, client_writer, server_reader, server_writer) -> None:
        self.proxy = proxy
        self.client_writer = client_writer
        self.server_writer = server_writer
        self._parser = hiredis.Reader()
        self._directions = [
            (client_reader, server_writer, False),  # commands
            (server_reader, client_writer, True),  # replies
        ]
        self._tasks: list[asyncio.Task] = []

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for reader, writer, replies in self._directions:
            queue: asyncio.Queue = asyncio.Queue()
            self._tasks += [
                loop.create_task(self._read(reader, queue, replies)),
                loop.create_task(self._send(queue, writer, replies)),
            ]
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _read(self, reader: asyncio.StreamReader, queue: asyncio.Queue, replies: bool) -> None:
        loop = asyncio.get_running_loop()
        try:
            while data := await reader.read(READ_SIZE):
                if not replies:
                    self._count(data)
                delay = self.proxy.delay if replies and self.proxy.mode == "delay" else 0.0
                queue.put_nowait((loop.time() + delay, data))
        except OSError:
            self.close(reset=True)
            return
        queue.put_nowait((0.0, b""))  # EOF, after what came before it

    async def _send(self, queue: asyncio.Queue, writer: asyncio.StreamWriter, replies: bool) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due, data = await queue.get()
            await self.proxy.flowing.wait()
            if due > loop.time():
                await asyncio.sleep(due - loop.time())
            if not data:
                self.close()
                return
            if replies and self.proxy.mode == "reset":
                writer.write(data[: max(1, len(data) // 2)] if len(data) > 1 else b"")
                self.close(reset=True)
                return
            writer.write(data)

    def _count(self, data: bytes) -> None:
        self._parser.feed(data)
        while (command := self._parser.gets()) is not False:
            self.proxy.commands[command[0].decode().upper()] += 1

    def close(self, *, reset: bool = False) -> None:
        """End both connections; `reset` ends the client's with an RST."""
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        for writer in (self.client_writer, self.server_writer):
            if reset:
                sock = writer.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
            else:
                writer.close()


async def main(target_port: int) -> None:
    proxy = Proxy(target_port)
    await proxy.listen()
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    print(f"listening {proxy.port}", flush=True)
    while line := (await stdin.readline()).decode().split():
        if line[0] == "mode":
            await proxy.set_mode(line[1], float(line[2]) if len(line) > 2 else 0.0)
            print("ok", flush=True)
        elif line[0] == "counts":
            print(json.dumps(proxy.commands), flush=True)
        else:
            print(f"error unknown command {line[0]!r}", flush=True)
    await proxy.close()


class ChaosProxy:
    """The proxy as a context manager for tests: a process in front of `target_port`,
    at real-time CPU priority, stopped on exit. Its methods block for one line's
    exchange; from async code call them through `asyncio.to_thread`."""

    def __init__(self, target_port: int) -> None:
        self._target_port = target_port
        self.process: subprocess.Popen | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def __enter__(self) -> ChaosProxy:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.chaos_proxy", str(self._target_port)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent,
        )
        os.sched_setscheduler(self.process.pid, os.SCHED_FIFO, os.sched_param(10))
        self.port = int(self._answer().removeprefix("listening "))
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.stdin.close()  # main() ends at EOF
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.send_signal(signal.SIGKILL)
                self.process.wait()
        if self.process is not None and self.process.stdout:
            self.process.stdout.close()

    def _answer(self) -> str:
        assert self.process is not None and self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise AssertionError(f"chaos proxy exited with {self.process.wait()}")
        return line.strip()

    def _ask(self, line: str) -> str:
        assert self.process is not None and self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        return self._answer()

    def set_mode(self, mode: str, delay_ms: float = 0.0) -> None:
        assert self._ask(f"mode {mode} {delay_ms:g}") == "ok"

    def commands(self) -> collections.Counter[str]:
        """Commands received from clients so far, by name (EVALSHA, EVAL, PING, ...)."""
        return collections.Counter(json.loads(self._ask("counts")))


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
