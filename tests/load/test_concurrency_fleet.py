"""Concurrency limits across a fleet: gateway processes started as users start them
(`python -m gateway run`), one dedicated Redis, and a real upstream that counts, per
identity, the requests it is serving at once and holds them until the test lets go.

At the settings users run: the default store.timeout (10 ms) and limits that fail open,
so a lease the gateway failed to get answered in time would admit a request too many.
"""

from __future__ import annotations

import asyncio
import collections
import time

import aiohttp
import pytest

from gateway.limiter.concurrency import RENEW_FRACTION
from tests.processes import GatewayProcess, eventually, gateway_fleet
from tests.scrape import settled_decisions
from tests.upstream import CountingUpstream, serving

pytestmark = pytest.mark.timing  # measures time, load or memory: one such module runs at a time

GATEWAYS = 4
IDENTITIES = 3
PER_IDENTITY = 100
CONCURRENCY = 5

FLEET_CONFIG = """
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
store: {{url: "{url}"}}
limits:
  conns: {{concurrency: {concurrency}, lease_ttl: {ttl}, key: header:X-API-Key, on_store_error: open}}
routes:
  - match: {{path: /}}
    upstream: {upstream}
    limits: [conns]
"""


async def test_four_gateways_never_let_more_than_n_in_flight_per_identity(dedicated_redis):
    upstream = CountingUpstream()
    async with serving(upstream.handle) as upstream_url:
        config = FLEET_CONFIG.format(url=dedicated_redis.url, concurrency=CONCURRENCY, ttl="60s", upstream=upstream_url)
        with gateway_fleet(config, GATEWAYS) as gateways:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
                answered: collections.Counter[tuple[str, int]] = collections.Counter()

                async def request(i: int) -> None:
                    who = f"client-{i % IDENTITIES}"
                    url = gateways[i % GATEWAYS].url + "/held"
                    async with http.get(url, headers={"X-API-Key": who}) as response:
                        await response.read()
                        answered[who, response.status] += 1

                total = IDENTITIES * PER_IDENTITY
                tasks = [asyncio.ensure_future(request(i)) for i in range(total)]
                try:
                    # Every request is either refused or held by the upstream.
                    await eventually(
                        lambda: sum(answered.values()) + sum(upstream.in_flight.values()) == total,
                        what="every request refused or in the upstream",
                        deadline=60,
                    )
                    held = dict(upstream.in_flight)
                    refused = {who: answered[who, 429] for who, _ in answered}
                finally:
                    upstream.gate.set()
                    await asyncio.gather(*tasks)
                counts = [await settled_decisions(http, gateway.admin_url) for gateway in gateways]

                # Every lease was given back: the next requests are admitted, N at a time again.
                redis = dedicated_redis.client()
                await eventually(lambda: not redis.keys("rl:conns:leases:*"), what="every lease released")

    names = [f"client-{i}" for i in range(IDENTITIES)]
    assert held == {who: CONCURRENCY for who in names}, held
    assert dict(upstream.most) == {who: CONCURRENCY for who in names}, upstream.most
    assert refused == {who: PER_IDENTITY - CONCURRENCY for who in names}, refused
    assert answered == {
        **{(who, 200): CONCURRENCY for who in names},
        **{(who, 429): PER_IDENTITY - CONCURRENCY for who in names},
    }
    assert sum(c["conns", "fail_open"] for c in counts) == 0
    assert sum(c["conns", "allow"] for c in counts) == CONCURRENCY * IDENTITIES
    assert sum(c["conns", "concurrency_limited"] for c in counts) == total - CONCURRENCY * IDENTITIES


def redis_ms(redis) -> float:
    seconds, micros = redis.time()
    return seconds * 1000 + micros / 1000


async def test_a_killed_gateways_leases_expire_within_the_lease_ttl_and_not_before(dedicated_redis):
    ttl = 2.0
    upstream = CountingUpstream()
    redis = dedicated_redis.client()
    async with serving(upstream.handle) as upstream_url:
        config = FLEET_CONFIG.format(url=dedicated_redis.url, concurrency=2, ttl="2s", upstream=upstream_url)
        with gateway_fleet(config, 2) as (doomed, survivor):
            async with aiohttp.ClientSession() as http:

                async def status(gateway: GatewayProcess, path: str) -> int:
                    async with http.get(gateway.url + path, headers={"X-API-Key": "k"}) as response:
                        await response.read()
                        return response.status

                held = [asyncio.ensure_future(status(doomed, "/held")) for _ in range(2)]
                try:
                    await eventually(lambda: upstream.in_flight["k"] == 2, what="two requests held upstream")
                    (key,) = redis.keys("rl:conns:leases:*")
                    first_expiry = min(score for _, score in redis.zrange(key, 0, -1, withscores=True))

                    # A request longer than the TTL keeps its lease: it is renewed.
                    await eventually(lambda: redis_ms(redis) > first_expiry + 200, what="the first TTL to pass")
                    assert redis.zcard(key) == 2
                    assert await status(survivor, "/fast") == 429

                    expiry = min(score for _, score in redis.zrange(key, 0, -1, withscores=True))
                    doomed.process.kill()  # SIGKILL: no release, no renewal ever again
                    doomed.process.wait()
                    killed_at = time.monotonic()
                    assert await status(survivor, "/fast") == 429

                    async def admitted() -> bool:
                        return await status(survivor, "/fast") == 200

                    await eventually(admitted, what="a new request admitted", deadline=ttl * 3)
                    waited = time.monotonic() - killed_at
                    admitted_redis_ms = redis_ms(redis)
                finally:
                    upstream.gate.set()
                    await asyncio.gather(*held, return_exceptions=True)

    # Not before the leases expired by Redis's clock: at least the TTL less the time since
    # their last renewal (at most a third of it) after the kill, and within one TTL of it.
    assert admitted_redis_ms >= expiry
    assert ttl * (1 - RENEW_FRACTION) - 0.05 <= waited <= ttl + 0.5, waited


STACKED_CONFIG = """
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
store: {{url: "{url}"}}
limits:
  hot: {{rate: 1/hour, burst: 100, key: global, lease: 10, on_store_error: open}}
  tokens: {{rate: 1/hour, burst: 50, key: header:X-API-Key, on_store_error: open}}
  daily: {{quota: {{limit: 40, per: day}}, key: header:X-API-Key, on_store_error: open}}
  conns: {{concurrency: 5, key: header:X-API-Key, on_store_error: open}}
routes:
  - {{match: {{path: /}}, upstream: "{upstream}", limits: [hot, tokens, daily, conns]}}
"""


async def test_a_leased_bucket_a_bucket_a_quota_and_a_concurrency_limit_on_one_route(dedicated_redis):
    """300 requests of one client at once over three gateways, every one held upstream: the
    quota (40) is the tightest rate limit, so exactly 40 pass the rate limits, each charging
    every one of them; of those, 5 get a lease and reach the upstream, and 35 are refused
    by the concurrency limit, charged all the same (as docs/limit-policies.md says)."""
    upstream = CountingUpstream()
    async with serving(upstream.handle) as upstream_url:
        config = STACKED_CONFIG.format(url=dedicated_redis.url, upstream=upstream_url)
        with gateway_fleet(config, 3) as gateways:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
                answered: collections.Counter[int] = collections.Counter()

                async def request(i: int) -> None:
                    async with http.get(gateways[i % 3].url + "/held", headers={"X-API-Key": "k"}) as response:
                        await response.read()
                        answered[response.status] += 1

                tasks = [asyncio.ensure_future(request(i)) for i in range(300)]
                try:
                    await eventually(
                        lambda: answered.total() + upstream.in_flight["k"] == 300, what="every request refused or held"
                    )
                    held = upstream.in_flight["k"]
                finally:
                    upstream.gate.set()
                    await asyncio.gather(*tasks)
                counts = collections.Counter()
                for gateway in gateways:
                    counts.update(await settled_decisions(http, gateway.admin_url))
    assert held == upstream.most["k"] == 5
    assert answered == {200: 5, 429: 295}
    assert counts["hot", "allow"] == counts["tokens", "allow"] == counts["daily", "allow"] == 40
    assert (counts["conns", "allow"], counts["conns", "concurrency_limited"]) == (5, 35)
    assert not any(counts[name, "fail_open"] for name in ("hot", "tokens", "daily", "conns"))
