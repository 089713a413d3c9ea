"""The race the Lua script exists for: many gateway processes, one client, one
Redis. Four gateways started through the CLI answer 400 concurrent requests
for one API key against a burst of 50; exactly 50 pass. A naive
read-compute-write client, given the same concurrency, lets more through.

At the settings users run: the default store.timeout (10 ms) and a limit that
fails open, so a check the gateway failed to get answered in time would pass
and break the count. Redis has a core of its own (`dedicated_redis`), as in
production."""

from __future__ import annotations

import asyncio
import collections

import aiohttp
import pytest
import redis.asyncio

from tests.examples import ONE_REDIS_LIMIT
from tests.processes import gateway_fleet
from tests.scrape import settled_decisions

pytestmark = pytest.mark.timing  # measures time, load or memory: one such module runs at a time

GATEWAYS = 4
REQUESTS = 400
BURST = 50

async def naive_take_one(client: redis.asyncio.Redis, key: str, capacity: float, rate: float) -> bool:
    """A token bucket without the script: read, compute in Python, write back."""
    tokens, stamp = await client.hmget(key, "tokens", "ts")
    seconds, micros = await client.time()  # another client may charge the bucket meanwhile
    now = seconds + micros / 1e6
    held = capacity if tokens is None else min(capacity, float(tokens) + (now - float(stamp)) * rate)
    if held < 1:
        return False
    await client.hset(key, mapping={"tokens": held - 1, "ts": now})
    return True


async def test_four_gateways_let_exactly_the_burst_through_and_a_naive_client_does_not(dedicated_redis, upstream):
    config = ONE_REDIS_LIMIT.format(url=dedicated_redis.url, name="per_client", rate="1/day", burst=BURST, upstream=upstream)
    with gateway_fleet(config, GATEWAYS) as gateways:

        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as http:

            async def request(i: int) -> tuple[int, int]:
                url = gateways[i % GATEWAYS].url + "/race"
                async with http.get(url, headers={"X-API-Key": "one-client"}) as response:
                    await response.read()
                    return i % GATEWAYS, response.status

            answers = await asyncio.gather(*(request(i) for i in range(REQUESTS)))
            counts = [await settled_decisions(http, gateway.admin_url) for gateway in gateways]

    statuses = collections.Counter(status for _, status in answers)
    assert sum(c["per_client", "fail_open"] for c in counts) == 0
    assert sum(c["per_client", "allow"] for c in counts) == BURST
    assert statuses == {200: BURST, 429: REQUESTS - BURST}, statuses
    assert collections.Counter(g for g, _ in answers) == {g: REQUESTS // GATEWAYS for g in range(GATEWAYS)}

    pool = redis.asyncio.BlockingConnectionPool(port=dedicated_redis.port, max_connections=8)
    naive = redis.asyncio.Redis.from_pool(pool)  # closing it closes the pool
    try:
        taken = await asyncio.gather(
            *(naive_take_one(naive, "naive:one-client", BURST, 1 / 86400) for _ in range(REQUESTS))
        )
        assert len(set(pool._in_use_connections) | set(pool._available_connections)) > 1
    finally:
        await naive.aclose()
    assert sum(taken) > BURST, "the naive client kept to the limit; the race did not happen"
