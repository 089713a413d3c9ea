"""The in-process store's memory budget (`local_store_memory`), end to end: a gateway
process with no `store:` in front of a real upstream.

A flood of new clients keeps the gateway's memory near where it was, evicting the least
recently checked buckets (counted in gateway_local_store_evictions_total); a client whose
bucket cannot be held because the budget is spent on requests in flight gets a 503 that
charges nothing, and is served again once they end."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from gateway.limiter.memory_store import ENTRY_BYTES
from tests.helpers import flood
from tests.processes import GatewayProcess, eventually
from tests.scrape import decisions, scrape, value
from tests.upstream import CountingUpstream, serving

EVICTIONS = "gateway_local_store_evictions_total"


def config(upstream: str, memory: str, limits: str = "[per_key]") -> str:
    return f"""
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
local_store_memory: {memory}
limits:
  per_key: {{rate: 1/hour, burst: 5, key: header:X-API-Key}}
  conns: {{concurrency: 5, key: header:X-API-Key}}
routes:
  - match: {{path: /}}
    upstream: {upstream}
    limits: {limits}
"""


async def test_a_flood_of_new_clients_evicts_the_least_recent_and_memory_stays_within_the_budget(upstream):
    """20,000 clients, one request each: uncapped, their buckets took about 10 MB of RSS
    here (some 460 bytes each); in a 1 MiB budget the oldest are evicted and every
    request is still served."""
    with GatewayProcess(config(upstream, "1MiB")) as gateway:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as http:
            async with http.get(gateway.url + "/warm", headers={"X-API-Key": "warm"}) as response:
                assert response.status == 200
            start = gateway.rss_bytes()
            statuses = await flood(http, gateway.url + "/x", (f"client-{n}" for n in range(20_000 // 64 * 64)))
            grown = gateway.rss_bytes() - start
            evicted = value((await scrape(http, gateway.admin_url))[1], EVICTIONS)
    print(f"\nFIGURES RSS {start / 1024 / 1024:.0f} MB -> +{grown / 1024 / 1024:.1f} MB, {evicted:.0f} evicted")
    assert statuses == {200: 20_000 // 64 * 64}, statuses
    held = 1024 * 1024 // ENTRY_BYTES
    assert evicted >= 20_000 // 64 * 64 + 1 - held
    assert grown < 5 * 1024 * 1024, f"RSS grew by {grown / 1024 / 1024:.1f} MB"


async def test_with_the_budget_held_by_requests_in_flight_a_new_client_gets_503_and_is_not_charged():
    """Room for two entries: two clients' requests in flight hold a lease each, which is
    never evicted, so a third client's bucket has nowhere to go."""
    upstream = CountingUpstream()
    async with serving(upstream.handle) as upstream_url:
        with GatewayProcess(config(upstream_url, f"{2 * ENTRY_BYTES}B", "[per_key, conns]")) as gateway:
            async with aiohttp.ClientSession() as http:
                held = [
                    asyncio.ensure_future(http.get(gateway.url + "/held", headers={"X-API-Key": key})) for key in "ab"
                ]
                try:
                    await eventually(lambda: upstream.in_flight["a"] + upstream.in_flight["b"] == 2, what="two held")
                    async with http.get(gateway.url + "/", headers={"X-API-Key": "c"}) as response:
                        body = json.loads(await response.read())
                        assert response.status == 503, body
                        assert response.headers["Retry-After"] == "1"
                        assert response.headers["Content-Type"].startswith("application/problem+json")
                    assert "in-process store is full" in body["detail"]
                    assert body["violated-policies"] == ["per_key"]
                    counted = await decisions(http, gateway.admin_url)
                    assert counted["per_key", "no_room"] == 1
                    # Each held request's bucket made room for the leases.
                    assert value((await scrape(http, gateway.admin_url))[1], EVICTIONS) == 2
                finally:
                    upstream.gate.set()
                    for response in await asyncio.gather(*held):
                        assert response.status == 200
                        response.release()
                async with http.get(gateway.url + "/", headers={"X-API-Key": "c"}) as response:
                    assert response.status == 200
                    # The refused request took nothing: 5 - 1 left.
                    assert 'r=4' in response.headers["RateLimit"]
                assert "Traceback" not in "".join(gateway.stderr_lines)
