"""A gateway whose clock is 5 s fast, or 5 s slow, allows exactly what a gateway
with the right time allows: the script reads Redis's TIME, so the gateway's own
clock never reaches a bucket.

One gateway runs with the right time (A). A second (S) runs with the right time,
then under libfaketime (Debian's `faketime` package, preloaded with `FAKETIME`)
shifted +5 s, then −5 s; libfaketime shifts both its wall clock and the
monotonic clock the gateway times its denial cache with. Each run shows the
shift took effect in the `Date` header of S's own 429s.

The limit is 1 token per 2 s, burst 5, so a bucket timed by a gateway 5 s off
would gain or lose 2.5 tokens, while a run of requests that ends within 1 s of
its first gains no whole token from Redis's clock, and its counts are exact:
- 12 requests, one after another, alternating S, A, S, A on one API key: the
  same statuses and Retry-After values in every run, 3 of S's and 2 of A's
  allowed;
- 40 concurrent requests, half through each gateway, on a fresh key: exactly
  5 allowed in every run.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import glob
import time

import aiohttp
import pytest

from tests.examples import ONE_REDIS_LIMIT
from tests.processes import GatewayProcess

pytestmark = pytest.mark.timing  # measures time, load or memory: one such module runs at a time

RATE, BURST = "1/2s", 5
SEQUENTIAL, CONCURRENT = 12, 40
# Requests in a run must end before Redis's clock refills a whole token.
RUN_DEADLINE = 1.0
# The multi-threaded build: the gateway starts threads (the resolver's, asyncio.to_thread).
LIBFAKETIME = sorted(glob.glob("/usr/lib/*/faketime/libfaketimeMT.so.1"))


def faketime_env(shift: str) -> dict[str, str]:
    return {"LD_PRELOAD": LIBFAKETIME[0], "FAKETIME": shift}


async def run(http: aiohttp.ClientSession, shifted: GatewayProcess, unshifted: GatewayProcess, name: str):
    """The sequential and concurrent requests of one run, and S's clock offset seen in its Date header."""
    started = time.monotonic()
    sequence = []
    offsets = []
    for i in range(SEQUENTIAL):
        gateway = shifted if i % 2 == 0 else unshifted
        async with http.get(gateway.url + "/", headers={"X-API-Key": f"{name}-sequential"}) as response:
            await response.read()
            sequence.append((response.status, response.headers.get("Retry-After")))
            if gateway is shifted and response.status == 429:  # a 200 carries the upstream's Date
                offsets.append(email.utils.parsedate_to_datetime(response.headers["Date"]).timestamp() - time.time())

    async def one(i: int) -> int:
        gateway = shifted if i % 2 == 0 else unshifted
        async with http.get(gateway.url + "/", headers={"X-API-Key": f"{name}-concurrent"}) as response:
            await response.read()
            return response.status

    concurrent = await asyncio.gather(*(one(i) for i in range(CONCURRENT)))
    elapsed = time.monotonic() - started
    assert elapsed < RUN_DEADLINE, f"run {name} took {elapsed:.2f} s; its counts would include a refill"
    return sequence, concurrent.count(200), offsets


@pytest.mark.skipif(not LIBFAKETIME, reason="libfaketime is not installed (apt-get install faketime)")
async def test_a_gateway_five_seconds_off_allows_exactly_what_one_on_time_allows(dedicated_redis, upstream):
    config = ONE_REDIS_LIMIT.format(url=dedicated_redis.url, upstream=upstream, name="skew", rate=RATE, burst=BURST)
    gateways = {
        "on time": GatewayProcess(config),
        "unshifted": GatewayProcess(config),
        "+5s": GatewayProcess(config, env=faketime_env("+5s")),
        "-5s": GatewayProcess(config, env=faketime_env("-5s")),
    }
    with contextlib.ExitStack() as stack:
        for gateway in gateways.values():
            stack.callback(gateway.__exit__, None, None, None)
        await asyncio.gather(*(asyncio.to_thread(gateway.start) for gateway in gateways.values()))
        unshifted = gateways.pop("on time")
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            runs = {name: await run(http, shifted, unshifted, name) for name, shifted in gateways.items()}

    expected_offset = {"unshifted": 0, "+5s": 5, "-5s": -5}
    for name, (sequence, allowed_concurrently, offsets) in runs.items():
        shifted_allowed = sum(status == 200 for status, _ in sequence[0::2])
        unshifted_allowed = sum(status == 200 for status, _ in sequence[1::2])
        print(f"{name}: S allowed {shifted_allowed}, A allowed {unshifted_allowed} of {SEQUENTIAL} alternating; "
              f"{allowed_concurrently} of {CONCURRENT} concurrent; S's Date was {min(offsets):+.1f}..{max(offsets):+.1f} s off")
        # Date has whole seconds and may be rendered up to a second before it is sent.
        assert all(expected_offset[name] - 2 < offset <= expected_offset[name] + 1 for offset in offsets), offsets
        assert sequence == runs["unshifted"][0], (name, sequence)
        assert (shifted_allowed, unshifted_allowed) == (3, 2)
        assert allowed_concurrently == BURST
    assert [status for status, _ in runs["unshifted"][0]] == [200] * BURST + [429] * (SEQUENTIAL - BURST)
