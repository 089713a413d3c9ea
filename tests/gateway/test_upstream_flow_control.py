"""gateway.upstream.flow_control on a real TCP transport: pausing, resuming and draining
are each idempotent, a drain waits only while writing is paused, and every waiter is
let go when writing resumes (as it is when the connection is lost)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from gateway.upstream.flow_control import FlowControl


@asynccontextmanager
async def transport() -> AsyncIterator[asyncio.Transport]:
    server = await asyncio.start_server(lambda reader, writer: None, "127.0.0.1", 0)
    _, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
    try:
        yield writer.transport  # type: ignore[misc]
    finally:
        writer.close()
        server.close()
        await server.wait_closed()


async def test_pausing_and_resuming_reads_twice_is_as_once() -> None:
    async with transport() as tcp:
        flow = FlowControl(tcp)
        flow.pause_reading()
        flow.pause_reading()
        assert not tcp.is_reading()
        flow.resume_reading()
        assert tcp.is_reading()
        flow.resume_reading()
        assert tcp.is_reading() and not flow.read_paused


async def test_drain_waits_only_while_writing_is_paused() -> None:
    async with transport() as tcp:
        flow = FlowControl(tcp)
        await flow.drain()  # not paused: returns at once
        flow.pause_writing()
        flow.pause_writing()
        waiters = [asyncio.ensure_future(flow.drain()) for _ in range(2)]
        cancelled = asyncio.ensure_future(flow.drain())
        await asyncio.sleep(0)
        cancelled.cancel()  # one writer giving up leaves the others waiting
        await asyncio.sleep(0)
        assert not any(waiter.done() for waiter in waiters)
        flow.resume_writing()
        flow.resume_writing()
        await asyncio.gather(*waiters)
        assert not flow.write_paused
