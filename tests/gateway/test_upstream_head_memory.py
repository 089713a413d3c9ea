"""An upstream's response head cannot pile up memory in the gateway. As first reported,
an upstream that sends header lines without end took the gateway from 63 MB to 417 MB
of RSS before timeout.read answered 504, each repeat added about 360 MB, and the memory
stayed: the head was unbounded, and the failed connection was kept by a reference cycle
that the gateway's gc settings (gc.freeze, a young threshold of 20,000) seldom collect.

Here a gateway process, started as users start it, forwards to such an upstream three
times: each attempt is a 502 as soon as the head passes upstream_max_header_size (or
upstream_max_header_lines), long before timeout.read, and the RSS stays where it was.

Measured on this machine with this test's upstream, gateway RSS:
- before the bounds (acb5ffa): no answer at all, since every read re-arms timeout.read;
  the first attempt took the gateway from 60 MB to 16.7 GB in about a minute and to
  20.7 GB twenty seconds later, when it was stopped by hand;
- with them: 502 three times, 60.16 MB before and 60.20 MB after.
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp

from tests.processes import GatewayProcess
from tests.upstream import running_upstream

ATTEMPTS = 3
GROWTH_LIMIT = 20 * 1000 * 1000  # bounded: under 1 MB measured; unbounded: ~360 MB an attempt


async def _endless_head(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Read a request, then write header lines until the gateway hangs up."""
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\n")
        for i in range(1_000_000):
            writer.write(b"".join(b"X-Endless-%d-%d: %s\r\n" % (i, j, b"v" * 100) for j in range(100)))
            await writer.drain()
            await asyncio.sleep(0)  # drain() does not yield while the socket takes it all
    writer.close()


async def test_endless_upstream_heads_get_502_and_leave_the_rss_where_it_was() -> None:
    endless = await asyncio.start_server(_endless_head, "127.0.0.1", 0)
    endless_url = f"http://127.0.0.1:{endless.sockets[0].getsockname()[1]}"
    try:
        async with running_upstream() as upstream:
            config = (
                "routes:\n"
                f"  - match: {{path: /endless}}\n    upstream: {endless_url}\n    timeout: {{read: 5s}}\n"
                f"  - match: {{path: /}}\n    upstream: {upstream}\n"
            )
            with GatewayProcess(config) as gateway:
                async with aiohttp.ClientSession() as session:
                    async with session.get(f"{gateway.url}/echo") as response:
                        await response.read()  # what is allocated once is allocated
                    before = gateway.rss_bytes()
                    statuses = []
                    for _ in range(ATTEMPTS):
                        async with session.get(f"{gateway.url}/endless") as response:
                            await response.read()
                            statuses.append(response.status)
                    after = gateway.rss_bytes()
    finally:
        endless.close()
        await endless.wait_closed()
    assert statuses == [502] * ATTEMPTS
    assert after - before < GROWTH_LIMIT, f"RSS grew from {before / 1e6:.0f} MB to {after / 1e6:.0f} MB"
