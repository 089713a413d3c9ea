"""A hot key shared by a fleet: four gateway processes (`python -m gateway run`)
on one dedicated Redis, every request of one API key, a limit with `lease: 20`,
at the default store.timeout (10 ms) and failing open.

- Within the limit, Redis sees at most one script call per 20 allowed requests
  (and one per process for a lease left part spent), counted from
  `INFO commandstats`.
- Flooded far past the limit, the fleet never admits more than the limit: the
  requests the upstream received, counted there exactly, are at most
  burst + rate × the Redis time between the first and the last request. Nor
  much less: at most `lease` tokens per process per lapse, and the tail, go
  unspent.
Either count is exact only if no check failed open, which the metrics show."""

from __future__ import annotations

import asyncio
import math
import time

import aiohttp
import pytest

from tests.helpers import script_calls
from tests.processes import GatewayProcess, eventually, gateway_fleet
from tests.scrape import settled_decisions
from tests.upstream import RecordingUpstream, serving

pytestmark = pytest.mark.timing  # measures time, load or memory: one such module runs at a time

GATEWAYS = 4
LEASE = 20
CONCURRENCY = 48

CONFIG = """
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
store: {{url: "{url}"}}
limits:
  hot: {{rate: {rate}/second, burst: {burst}, key: header:X-API-Key, lease: {lease}}}
routes:
  - {{match: {{path: /}}, upstream: "{upstream}", limits: [hot]}}
"""


def redis_seconds(client) -> float:
    seconds, micros = client.time()
    return seconds + micros / 1e6


async def flood(gateways: list[GatewayProcess], *, requests: int | None = None, seconds: float | None = None) -> dict[int, int]:
    """CONCURRENCY loops sending the one API key round the gateways, until `requests`
    have been sent or `seconds` have passed; statuses counted."""
    statuses: dict[int, int] = {}
    sent = [0]
    end = time.monotonic() + (seconds or math.inf)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

        async def loop() -> None:
            while time.monotonic() < end and (requests is None or sent[0] < requests):
                gateway = gateways[sent[0] % GATEWAYS]
                sent[0] += 1
                async with http.get(gateway.url + "/hot", headers={"X-API-Key": "the-one-key"}) as response:
                    await response.read()
                    statuses[response.status] = statuses.get(response.status, 0) + 1

        await asyncio.gather(*(loop() for _ in range(CONCURRENCY)))
    return statuses


async def decided(gateways: list[GatewayProcess]) -> dict[str, float]:
    async with aiohttp.ClientSession() as http:
        counts = [await settled_decisions(http, gateway.admin_url) for gateway in gateways]
    return {outcome: sum(c["hot", outcome] for c in counts) for outcome in ("allow", "deny", "fail_open")}


async def test_a_hot_key_within_its_limit_costs_redis_one_call_per_lease(dedicated_redis):
    client = dedicated_redis.client()
    counting = RecordingUpstream()
    async with serving(counting.handle) as upstream:
        config = CONFIG.format(url=dedicated_redis.url, rate=10_000, burst=10_000, lease=LEASE, upstream=upstream)
        with gateway_fleet(config, GATEWAYS) as gateways:
            before = script_calls(client)
            statuses = await asyncio.wait_for(flood(gateways, requests=2000), 120)
            calls = script_calls(client) - before
            counts = await decided(gateways)
    print(f"\nwithin the limit: {statuses}, {calls} script calls for {counting.requests} allowed ({calls / counting.requests:.4f} each)")
    assert counts["fail_open"] == 0
    assert statuses == {200: 2000} and counting.requests == 2000 == counts["allow"]
    # Each process's leases are whole 20s but its last, which may be part spent.
    assert calls <= math.ceil(2000 / LEASE) + GATEWAYS


@pytest.mark.parametrize("rate, burst", [(200, 50)])
async def test_a_flooded_fleet_never_admits_more_than_the_limit(dedicated_redis, rate, burst):
    client = dedicated_redis.client()
    counting = RecordingUpstream()
    async with serving(counting.handle) as upstream:
        config = CONFIG.format(url=dedicated_redis.url, rate=rate, burst=burst, lease=LEASE, upstream=upstream)
        with gateway_fleet(config, GATEWAYS) as gateways:
            before = script_calls(client)
            started = redis_seconds(client)  # before the first request: the bucket is full and untouched
            statuses = await asyncio.wait_for(flood(gateways, seconds=2.0), 120)
            ended = redis_seconds(client)  # after the last answer: no lease is taken later
            calls = script_calls(client) - before
            counts = await decided(gateways)
    elapsed = ended - started
    most = burst + rate * elapsed
    # Under-admission: at most LEASE per process per lapse (1 s), and the tokens of the tail.
    least = burst + rate * elapsed - LEASE * GATEWAYS * (math.ceil(elapsed) + 1) - rate * 0.25
    print(
        f"\nflooded: {statuses} over {elapsed:.3f} s of Redis time; upstream received {counting.requests}, "
        f"limit allows {most:.1f}; {calls} script calls ({calls / max(1, counting.requests):.3f} per allowed request)"
    )
    assert counts["fail_open"] == 0
    assert counting.requests == statuses.get(200, 0) == counts["allow"]
    assert statuses.get(429, 0) > 0 and set(statuses) <= {200, 429}
    assert counting.requests <= most
    assert counting.requests >= least


BESIDE_A_DENYING_LIMIT = """
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
store: {{url: "{url}"}}
limits:
  hot: {{rate: 1/hour, burst: 100, key: global, lease: 10}}
  per_key: {{rate: 1/hour, burst: 5, key: header:X-API-Key}}
routes:
  - {{match: {{path: /a}}, upstream: "{upstream}", limits: [hot, per_key]}}
  - {{match: {{path: /b}}, upstream: "{upstream}", limits: [hot]}}
"""


async def test_tokens_a_denying_limit_gives_back_leave_no_process_holding_more_than_its_lease(dedicated_redis):
    """200 concurrent requests of one client on one process: each takes a leased token
    before its per-key limit answers, so the process refills while its tokens are out;
    the per-key limit admits 5 and the rest come back. The process then holds at most
    `lease` (10) unspent, the rest back in Redis (as the admin API reads the bucket), so
    another process admits at least 100 - 5 - 10 of the global bucket and the fleet never
    more than 100."""
    counting = RecordingUpstream()
    async with serving(counting.handle) as upstream:
        config = BESIDE_A_DENYING_LIMIT.format(url=dedicated_redis.url, upstream=upstream)
        with gateway_fleet(config, 2) as (first, second):
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

                async def status(gateway: GatewayProcess, path: str, key: str) -> int:
                    async with http.get(gateway.url + path, headers={"X-API-Key": key}) as response:
                        await response.read()
                        return response.status

                one = await asyncio.gather(*(status(first, "/a", "one") for _ in range(200)))
                assert counting.requests == one.count(200) == 5

                # The denials do not wait for the excess to go back to Redis (a background
                # refund); the fleet's bucket shows it there once the refunds have landed.
                async def refunded() -> bool:
                    async with http.get(first.admin_url + "/buckets/hot") as response:
                        return (await response.json())["tokens"] >= 100 - 5 - 10

                await eventually(refunded, what="the first process's excess leased tokens back in Redis")
                other = await asyncio.gather(*(status(second, "/b", "other") for _ in range(200)))
                counts = [await settled_decisions(http, gateway.admin_url) for gateway in (first, second)]
    assert 100 - 5 - 10 <= other.count(200) == counting.requests - 5 <= 100 - 5, other.count(200)
    assert all(c[name, "fail_open"] == 0 for c in counts for name in ("hot", "per_key"))
