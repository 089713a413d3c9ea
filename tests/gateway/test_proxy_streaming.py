"""Bodies stream through the gateway both ways and are never held whole: a
1 GiB upload and a 1 GiB download pass while the gateway process's RSS stays
under 150 MB. The gateway runs as its own process (GatewayProcess), so the RSS
measured is the gateway's alone; the upstream and the client run here.

Each transfer also stalls its receiving side for STALL_SECONDS early on. A
gateway that kept reading from the fast side without waiting for the slow one
would pull hundreds of megabytes into memory in that second; one that applies
backpressure holds no more than its socket buffers and a chunk."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from tests.processes import GatewayProcess, PeakRss
from tests.upstream import running_upstream

GIB = 1 << 30
RSS_LIMIT = 150 * 1000 * 1000
UPLOAD_BLOCK = b"u" * (1 << 20)
SAMPLE_INTERVAL = 0.02
# Long enough for an unbounded buffer to pass 150 MB even on a busy machine; it is a
# stalled reader being simulated, not a wait for anything.
STALL_SECONDS = 1.0


@pytest.fixture
async def gateway_process():
    async with running_upstream() as upstream:
        config = f"""
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
shutdown_grace: 1s
limits:
  generous: {{rate: 1000/second}}
routes:
  - match: {{path: /}}
    upstream: {upstream}
    limits: [generous]
"""
        with GatewayProcess(config) as gateway:
            yield gateway


@pytest.mark.timeout(300)
async def test_a_1_gib_download_streams_through_within_150_mb_of_gateway_rss(gateway_process):
    received = 0
    started = time.monotonic()
    with PeakRss(gateway_process.rss_bytes, interval=SAMPLE_INTERVAL) as rss:
        async with aiohttp.ClientSession() as client:
            async with client.get(gateway_process.url + f"/stream?size={GIB}") as response:
                assert response.status == 200
                assert response.headers["Transfer-Encoding"] == "chunked"
                stalled = False
                async for chunk in response.content.iter_chunked(1 << 20):
                    received += len(chunk)
                    if not stalled and received >= 1 << 20:
                        stalled = True
                        await asyncio.sleep(STALL_SECONDS)  # a client that stops reading for a while
    elapsed = time.monotonic() - started
    print(f"1 GiB download: {elapsed:.1f} s, gateway peak RSS {rss.peak / 1e6:.1f} MB over {rss.samples} samples")
    assert received == GIB
    assert rss.samples > 1
    assert 0 < rss.peak < RSS_LIMIT


@pytest.mark.timeout(300)
async def test_a_1_gib_upload_streams_through_within_150_mb_of_gateway_rss(gateway_process):
    async def body():
        for _ in range(GIB // len(UPLOAD_BLOCK)):
            yield UPLOAD_BLOCK

    started = time.monotonic()
    with PeakRss(gateway_process.rss_bytes, interval=SAMPLE_INTERVAL) as rss:
        async with aiohttp.ClientSession() as client:
            # The upstream waits STALL_SECONDS before it reads the body at all.
            async with client.post(gateway_process.url + f"/sink?pause={STALL_SECONDS}", data=body()) as response:
                assert response.status == 200
                answer = await response.json()
    elapsed = time.monotonic() - started
    print(f"1 GiB upload: {elapsed:.1f} s, gateway peak RSS {rss.peak / 1e6:.1f} MB over {rss.samples} samples")
    assert answer == {"received": GIB}
    assert rss.samples > 1
    assert 0 < rss.peak < RSS_LIMIT
