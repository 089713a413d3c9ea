"""Keys end to end: the gateway as users start it (`python -m gateway run`),
a private redis-server, a real upstream. Global limits hold exactly under
concurrency at the default store.timeout (10 ms), failing open; a tier's client
gets its tier's exact burst and a fresh bucket when moved (key file + SIGHUP);
an allowlisted network is never limited and is counted; the admin API names
global, composite and tiered buckets."""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
from pathlib import Path

import aiohttp
import pytest

from gateway.limiter.keys import identity_digest
from tests.processes import GatewayProcess, eventually
from tests.scrape import decisions, settled_decisions

pytestmark = pytest.mark.timing  # measures time, load or memory: one such module runs at a time

RELOADED = "config reloaded from"


async def get(client: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None) -> int:
    async with client.get(url, headers=headers) as response:
        await response.read()
        return response.status


async def admin(client: aiohttp.ClientSession, method: str, url: str, expect: int = 200) -> dict:
    """The admin API's answer, with `tokens` in whole tokens (a bucket refills on while we look)."""
    async with client.request(method, url) as response:
        body = await response.read()
        assert response.status == expect, body
        answer = json.loads(body)
        if "tokens" in answer:
            answer["tokens"] = int(answer["tokens"])
        return answer


async def test_a_global_limit_admits_exactly_its_burst_of_300_concurrent_clients(dedicated_redis, upstream):
    """300 requests at once, each from its own address (X-Forwarded-For from a trusted
    127.0.0.1): one bucket for all of them, so exactly the burst of 25 pass."""
    config = f"""
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
store: {{url: "{dedicated_redis.url}"}}
trusted_proxies: [127.0.0.1]
limits:
  upstream_capacity: {{rate: 1/hour, burst: 25, key: [], on_store_error: open}}
routes:
  - match: {{path: /}}
    upstream: {upstream}
    limits: [upstream_capacity]
"""
    with GatewayProcess(config) as gw:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as client:
            codes = await asyncio.gather(
                *(get(client, gw.url + "/", {"X-Forwarded-For": f"10.{i // 250}.{i % 250}.{i % 7 + 1}"}) for i in range(300))
            )
            counts = await settled_decisions(client, gw.admin_url)
    assert (codes.count(200), codes.count(429)) == (25, 275)
    assert counts["upstream_capacity", "allow"] == 25
    assert counts["upstream_capacity", "fail_open"] == 0
    assert counts["upstream_capacity", "deny"] + counts["upstream_capacity", "skipped"] == 275
    assert len(dedicated_redis.client().keys("rl:upstream_capacity:*")) == 1


def tiered_config(redis_url: str, upstream: str, keys_file: Path) -> str:
    return f"""
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
store: {{url: "{redis_url}", key_secret: tier-test-secret}}
trusted_proxies: [127.0.0.1]
limits:
  api:
    rate: 1/hour
    burst: 3
    key: [header:X-API-Key, ip]
    allow: [10.20.0.0/16]
    tiers:
      from: {{file: "{keys_file}"}}
      gold: {{rate: 2/hour, burst: 8}}
      silver: {{rate: 1/hour, burst: 5}}
routes:
  - match: {{path: /}}
    upstream: {upstream}
    limits: [api]
"""


async def passed(client: aiohttp.ClientSession, url: str, headers: dict[str, str], tries: int) -> int:
    return [await get(client, url, headers) for _ in range(tries)].count(200)


async def test_tiers_give_exact_bursts_and_a_moved_key_a_fresh_bucket(redis_server, upstream, tmp_path):
    keys_file = tmp_path / "keys.yaml"
    silver_hash = hashlib.sha256(b"key-s").hexdigest()
    keys_file.write_text(f"gold: [key-g]\nsilver: ['sha256:{silver_hash}']\n")
    with GatewayProcess(tiered_config(redis_server.url, upstream, keys_file)) as gw:
        async with aiohttp.ClientSession() as client:
            gold, silver, plain = {"X-API-Key": "key-g"}, {"X-API-Key": "key-s"}, {"X-API-Key": "key-d"}
            assert await passed(client, gw.url + "/", gold, 12) == 8
            assert await passed(client, gw.url + "/", silver, 12) == 5
            assert await passed(client, gw.url + "/", plain, 12) == 3
            async with client.get(gw.url + "/", headers=gold) as response:
                assert response.headers["RateLimit-Policy"] == '"api/gold";q=8;w=14400'
            # Each tier is its own bucket, in the identity's one Cluster slot (the same digest).
            digest = identity_digest(b"tier-test-secret", "header:x-api-key=key-g")
            assert redis_server.client().exists(f"rl:api/gold:{{{digest}}}")

            # key-g moves to silver: a fresh silver bucket of 5, not gold's empty one.
            keys_file.write_text(f"silver: [key-g, 'sha256:{silver_hash}']\n")
            before = sum(RELOADED in line for line in gw.stderr_lines)
            gw.signal(signal.SIGHUP)
            await eventually(lambda: sum(RELOADED in line for line in gw.stderr_lines) > before, what="the reload")
            assert await passed(client, gw.url + "/", gold, 8) == 5
            assert await passed(client, gw.url + "/", silver, 3) == 0  # silver's own bucket was not refilled

            # An allowlisted network is never limited, and each of its requests is counted.
            office = {"X-Forwarded-For": "10.20.3.4", "X-API-Key": "key-g"}
            assert await passed(client, gw.url + "/", office, 20) == 20
            counts = await decisions(client, gw.admin_url)
    assert counts["api", "allowlisted"] == 20
    assert counts["api", "allow"] == 8 + 5 + 3 + 5


async def test_the_admin_api_names_global_composite_and_tiered_buckets(redis_server, upstream, tmp_path):
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text("gold: [key-g]\n")
    config = f"""
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
store: {{url: "{redis_server.url}"}}
limits:
  everyone: {{rate: 1/hour, burst: 10, key: global}}
  per_key_route: {{rate: 1/hour, burst: 10, key: [[header:X-API-Key, path], 'ip/24']}}
  tiered:
    rate: 1/hour
    burst: 10
    key: header:X-API-Key
    tiers: {{from: {{file: "{keys_file}"}}, gold: {{rate: 1/hour, burst: 20}}}}
routes:
  - match: {{path: /v1}}
    upstream: {upstream}
    limits: [everyone, per_key_route, tiered]
"""
    with GatewayProcess(config) as gw:
        async with aiohttp.ClientSession() as client:
            for _ in range(2):
                assert await get(client, gw.url + "/v1/x", {"X-API-Key": "key-g"}) == 200
            assert await get(client, gw.url + "/v1/x") == 200
            base = gw.admin_url + "/buckets/"
            shown = await admin(client, "GET", base + "everyone")
            assert (shown["source"], shown["tokens"]) == ("global", 7)
            shown = await admin(client, "GET", base + "per_key_route?source=header:X-API-Key%2Bpath&value=key-g&value=/v1")
            assert (shown["source"], shown["tokens"]) == ("header:x-api-key+path", 8)
            shown = await admin(client, "GET", base + "per_key_route?source=ip/24&value=127.0.0.99")
            assert (shown["source"], shown["tokens"]) == ("ip/24", 9)
            await admin(client, "GET", base + "per_key_route?source=header:X-API-Key%2Bpath&value=key-g", expect=400)
            # The key file's tier by default; another tier when named.
            shown = await admin(client, "GET", base + "tiered?value=key-g")
            assert (shown["limit"], shown["capacity"], shown["tokens"]) == ("tiered/gold", 20, 18)
            shown = await admin(client, "GET", base + "tiered?value=key-g&tier=default")
            assert (shown["limit"], shown["held"], shown["tokens"]) == ("tiered", False, 10)
            await admin(client, "GET", base + "tiered?value=key-g&tier=platinum", expect=400)
            assert (await admin(client, "DELETE", base + "tiered?value=key-g"))["held"] is True
            assert (await admin(client, "GET", base + "tiered?value=key-g"))["tokens"] == 20
            assert (await admin(client, "DELETE", base + "everyone"))["held"] is True
            assert await get(client, gw.url + "/v1/x") == 200
            assert (await admin(client, "GET", base + "everyone"))["tokens"] == 9
