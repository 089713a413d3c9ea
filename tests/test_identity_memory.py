"""What a client that mints long identities can make the gateway hold.

An identity value is capped at MAX_IDENTITY_LENGTH characters (431 past it, never charged
or forwarded), and the gateway's per-identity memory (the denial cache, leased tokens)
holds a long identity by a 16-byte digest, so each remembered client costs the same few
hundred bytes whatever length it chose. Memory is measured with tracemalloc for the
structures alone, and as the RSS of a gateway process for a flood."""

from __future__ import annotations

import tracemalloc

import aiohttp
import pytest

from gateway.identity.sources import MAX_IDENTITY_LENGTH
from gateway.limiter.denial_cache import DenialCache
from gateway.limiter.keys import COMPACT_IDENTITY, memory_key
from gateway.limiter.store import LimitCheck
from gateway.limiter.token_leases import Leases
from gateway.testing import running_gateway
from tests.helpers import flood
from tests.processes import GatewayProcess
from tests.test_denial_cache import limit
from tests.upstream import CountingUpstream, serving

pytestmark = pytest.mark.timing  # measures time, load or memory: one such module runs at a time


def long_identity(i: int, length: int = MAX_IDENTITY_LENGTH) -> str:
    return f"header:x-api-key={i:08d}".ljust(length, "k")


def test_a_long_identity_is_held_by_a_digest_and_a_short_one_as_itself():
    assert memory_key("ip=203.0.113.7") == "ip=203.0.113.7"
    assert memory_key("k" * COMPACT_IDENTITY) == "k" * COMPACT_IDENTITY
    digest = memory_key(long_identity(1))
    assert isinstance(digest, bytes) and len(digest) == 16
    assert memory_key(long_identity(1)) == digest != memory_key(long_identity(2))


def test_denials_of_identities_of_the_longest_length_cost_what_short_ones_do():
    """20,000 denied clients of 1,024-character identities: held as raw strings, the cache
    took over 20 MB; by digest, under 8 MB."""
    per_client = limit(rate="1/hour", burst=1)
    cache = DenialCache()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(20_000):
            cache.record(LimitCheck(per_client, long_identity(i), 1), remaining=0.0, sent_at=0.0)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(cache) == 20_000
    assert held < 8 * 1024 * 1024, f"{held / 1024 / 1024:.1f} MB for 20,000 denials"
    # Looked up, listed for the admin API and forgotten by the identity, as before.
    check = LimitCheck(per_client, long_identity(7), 1)
    assert cache.lookup([check], 1.0) is not None
    assert cache.held_for(per_client, long_identity(7), 1.0) > 0
    assert cache.forget(per_client.name, long_identity(7)) == 1
    assert cache.lookup([check], 1.0) is None


def test_leased_tokens_of_a_long_identity_are_found_by_it():
    leased = limit(rate="1/hour", burst=100)
    leases = Leases()
    check = LimitCheck(leased, long_identity(3), 1)
    leases.grant(check, tokens=5, remaining=90.0, now=0.0)
    assert leases.unspent(check) == 5
    leases.forget(leased.name, long_identity(3))
    assert leases.unspent(check) == 0


async def test_an_identity_past_the_cap_gets_431_and_is_neither_charged_nor_forwarded():
    upstream = CountingUpstream()
    config = """
limits:
  per_key: {{rate: 1/hour, burst: 1, key: header:X-API-Key}}
routes:
  - match: {{path: /}}
    upstream: {url}
    limits: [per_key]
"""
    async with serving(upstream.handle) as url, running_gateway(config.format(url=url)) as gw:
        async with aiohttp.ClientSession() as http:
            at_cap = "k" * MAX_IDENTITY_LENGTH
            async with http.get(gw.url + "/a", headers={"X-API-Key": at_cap + "k"}) as response:
                assert response.status == 431
                problem = await response.json(content_type=None)
            assert str(MAX_IDENTITY_LENGTH) in problem["detail"] and at_cap not in problem["detail"]
            # Nothing was charged: the key at the cap still has its one token.
            async with http.get(gw.url + "/a", headers={"X-API-Key": at_cap}) as response:
                assert response.status == 200
            async with http.get(gw.url + "/a", headers={"X-API-Key": at_cap}) as response:
                assert response.status == 429
    assert set(upstream.most) == {"k" * MAX_IDENTITY_LENGTH}  # the key past the cap never reached it


async def test_a_flood_of_distinct_long_keys_leaves_the_gateways_memory_where_it_was(upstream, redis_server):
    """8,000 requests, each with its own 8,000-byte key against a burst-1 limit: the keys
    used to be held whole in the denial cache (about 8.6 KB an entry, 70 MB for these);
    now each is refused at the cap. Then as many keys at the cap, each allowed once and so
    remembered as denied: 5.3 MB in all here, where the store's cache of bucket keys,
    holding each identity whole, had added 13 MB for these alone."""
    config = f"""
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
store: {{url: "{redis_server.url}"}}
limits:
  per_key: {{rate: 1/hour, burst: 1, key: header:X-API-Key, on_store_error: open}}
routes:
  - match: {{path: /}}
    upstream: {upstream}
    limits: [per_key]
"""
    with GatewayProcess(config) as gateway:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as http:
            async with http.get(gateway.url + "/warm", headers={"X-API-Key": "warm"}) as response:
                assert response.status == 200
            start = gateway.rss_bytes()
            lengths = [8_000] * 8_000 + [MAX_IDENTITY_LENGTH - len("header:x-api-key=")] * 8_000
            keys = (f"{n:08d}".ljust(length, "k") for n, length in enumerate(lengths))
            statuses = await flood(http, gateway.url + "/x", keys)
            grown = gateway.rss_bytes() - start
    print(f"\nFIGURES RSS {start / 1024 / 1024:.0f} MB -> +{grown / 1024 / 1024:.1f} MB after {statuses}")
    assert statuses == {431: 8_000, 200: 8_000}, statuses
    assert grown < 10 * 1024 * 1024, f"RSS grew by {grown / 1024 / 1024:.1f} MB"
