"""Streaming: 1 GiB downloaded and 1 GiB uploaded through a gateway, with the
gateway process's RSS (VmRSS in /proc/PID/status) read before each transfer and
sampled during it for its peak. The body is generated as it is sent and counted
as it arrives, here and in the upstream (bulk_upstream, a process of its own),
never held whole by either; so what the gateway's RSS grows by is what the
gateway buffers. It runs after the throughput rounds, with a gateway of its own
at (a)'s config.
"""

from __future__ import annotations

import functools
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import uvloop

from tests.bench.install import BenchError
from tests.bench.servers import bulk_upstream, started
from tests.bench.variants import gateway_yaml
from tests.processes import GatewayProcess, PeakRss

GIB = 1 << 30
# --quick moves 64 MiB each way: seconds instead of a minute, and still far more than any buffer.
QUICK_BYTES = 64 << 20
UPLOAD_BLOCK = b"u" * (1 << 20)
# One small transfer each way first, so that what the gateway allocates once (its
# first upstream connection, lazily built buffers) is in "before", not in the growth.
WARMUP_BYTES = 1 << 20
SAMPLE_INTERVAL = 0.01
# A stalled transfer fails the phase instead of hanging it; no transfer waits this long for a chunk.
READ_TIMEOUT_SECONDS = 60


@dataclass(frozen=True)
class Transfer:
    direction: str  # "download" or "upload"
    size: int
    seconds: float
    rss_before: int
    rss_peak: int
    samples: int

    @property
    def growth(self) -> int:
        return max(0, self.rss_peak - self.rss_before)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise BenchError(f"no VmRSS in /proc/{pid}/status")


async def download(client: aiohttp.ClientSession, url: str, size: int) -> None:
    received = 0
    async with client.get(f"{url}/stream?size={size}") as response:
        if response.status != 200:
            raise BenchError(f"download through the gateway answered {response.status}")
        async for chunk in response.content.iter_any():
            received += len(chunk)
    if received != size:
        raise BenchError(f"download through the gateway delivered {received:,} of {size:,} bytes")


async def upload(client: aiohttp.ClientSession, url: str, size: int) -> None:
    async def body():
        for _ in range(size // len(UPLOAD_BLOCK)):
            yield UPLOAD_BLOCK

    # An async generator as the body: aiohttp sends it chunked, one block at a time.
    async with client.post(f"{url}/sink", data=body()) as response:
        answer = await response.json() if response.status == 200 else None
    if answer != {"received": size}:
        raise BenchError(f"upload through the gateway: the upstream answered {answer or response.status}")


async def _transfers(url: str, pid: int, size: int) -> list[Transfer]:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=READ_TIMEOUT_SECONDS)
    transfers = []
    async with aiohttp.ClientSession(timeout=timeout) as client:
        for direction, transfer in (("download", download), ("upload", upload)):
            await transfer(client, url, WARMUP_BYTES)
            before = rss_bytes(pid)
            started_at = time.monotonic()
            with PeakRss(functools.partial(rss_bytes, pid), interval=SAMPLE_INTERVAL) as rss:
                await transfer(client, url, size)
            seconds = time.monotonic() - started_at
            transfers.append(Transfer(direction, size, seconds, before, rss.peak, rss.samples))
            print(
                f"bench: {direction} of {size >> 20} MiB in {seconds:.1f} s, gateway RSS "
                f"{before / 1e6:.1f} MB before, {rss.peak / 1e6:.1f} MB at peak",
                file=sys.stderr,
            )
    return transfers


def measure_streaming(log_dir: Path, *, size: int) -> list[Transfer]:
    """`size` bytes down, then up, through a fresh gateway (no limits) to the aiohttp upstream."""
    with bulk_upstream(log_dir) as upstream:
        with started(GatewayProcess(gateway_yaml(upstream.url)), "gateway") as gateway:
            assert gateway.process is not None
            return uvloop.run(_transfers(gateway.url, gateway.process.pid, size))
