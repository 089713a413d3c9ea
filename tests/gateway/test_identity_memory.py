"""What a client that mints long identities can make the gateway hold.

An identity value is capped at `identity_max_length` characters (8 KiB by default: 431
past it, never charged or forwarded), and the gateway's per-identity memory (the denial
cache, leased tokens, the store's cache of bucket keys) holds a long identity by a
16-byte digest, so each remembered client costs the same few hundred bytes whatever
length it chose. Memory is measured with tracemalloc for the structures alone, and as
the RSS of a gateway process for a flood."""

from __future__ import annotations

import tracemalloc

import aiohttp

from gateway.config.model import DEFAULT_IDENTITY_MAX_LENGTH
from gateway.limiter.denial_cache import DenialCache
from gateway.limiter.keys import COMPACT_IDENTITY, HeldByDigest, listed_identity, memory_key
from gateway.limiter.store import LimitCheck
from gateway.limiter.token_leases import Leases
from gateway.limiter.top_limited import TopLimited
from gateway.testing import running_gateway
from tests.helpers import flood
from tests.load.test_denial_cache import limit
from tests.processes import GatewayProcess
from tests.upstream import CountingUpstream, serving


def long_identity(i: int, length: int = DEFAULT_IDENTITY_MAX_LENGTH) -> str:
    return f"header:x-api-key={i:08d}".ljust(length, "k")


def test_a_long_identity_is_held_by_a_digest_and_a_short_one_as_itself():
    assert memory_key("ip=203.0.113.7") == "ip=203.0.113.7"
    assert memory_key("k" * COMPACT_IDENTITY) == "k" * COMPACT_IDENTITY
    digest = memory_key(long_identity(1))
    assert isinstance(digest, bytes) and len(digest) == 16
    assert memory_key(long_identity(1)) == digest != memory_key(long_identity(2))


def test_denials_of_identities_of_the_longest_length_cost_what_short_ones_do():
    """20,000 denied clients of identities at the cap (8 KiB): held as raw strings, the
    cache would take over 160 MB; by digest, under 8 MB."""
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


def test_the_top_limited_list_holds_long_identities_by_their_digest():
    """2,000 denied clients of identities at the cap, the most it holds: held as sent, the
    list took 16 MB."""
    top = TopLimited(now=0.0)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(1_999):
            top.denied("per_key", long_identity(i), now=1.0 if i < 1_000 else 61.0)  # two epochs
        top.denied("per_key", long_identity(7), now=61.0)  # denied in both
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(top) == 2_000
    assert held < 2 * 1024 * 1024, f"{held / 1024 / 1024:.1f} MB for 2,000 long identities"
    counts = {hit.key: hit.count for hit in top.top(2_000, now=61.0)}
    held_as = listed_identity(long_identity(7))
    assert isinstance(held_as, HeldByDigest) and str(held_as).startswith("header:x-api-key#")
    assert counts["per_key", held_as] == 2
    assert listed_identity("header:x-api-key=short") == "header:x-api-key=short"


async def test_an_identity_past_the_cap_gets_431_and_is_neither_charged_nor_forwarded():
    """With a cap of 1 KiB: at the default, one header line (8,190 bytes at most, as llhttp
    reads it) cannot pass the cap (tests/gateway/test_identity_length.py has a composite key that does)."""
    upstream = CountingUpstream()
    cap = 1024
    config = """
identity_max_length: 1KiB
limits:
  per_key: {{rate: 1/hour, burst: 1, key: header:X-API-Key}}
routes:
  - match: {{path: /}}
    upstream: {url}
    limits: [per_key]
"""
    async with serving(upstream.handle) as url, running_gateway(config.format(url=url)) as gw:
        async with aiohttp.ClientSession() as http:
            at_cap = "k" * cap
            async with http.get(gw.url + "/a", headers={"X-API-Key": at_cap + "k"}) as response:
                assert response.status == 431
                problem = await response.json(content_type=None)
            assert str(cap) in problem["detail"] and at_cap not in problem["detail"]
            # Nothing was charged: the key at the cap still has its one token.
            async with http.get(gw.url + "/a", headers={"X-API-Key": at_cap}) as response:
                assert response.status == 200
            async with http.get(gw.url + "/a", headers={"X-API-Key": at_cap}) as response:
                assert response.status == 429
    assert set(upstream.most) == {"k" * cap}  # the key past the cap never reached it


async def test_a_flood_of_distinct_long_keys_leaves_the_gateways_memory_where_it_was(upstream, redis_server):
    """8,000 requests, each with its own 8,000-byte key against a burst-1 limit (under the
    8 KiB cap), each allowed and so remembered as denied; then each key again, denied. Held
    whole, the keys took about 8.6 KB an entry in the denial cache (70 MB for these) and
    as much again in the store's cache of bucket keys; by digest, a few MB in all."""
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
            keys = [f"{n:08d}".ljust(8_000, "k") for n in range(8_000)]
            first = await flood(http, gateway.url + "/x", keys)
            again = await flood(http, gateway.url + "/x", keys)
            grown = gateway.rss_bytes() - start
    print(f"\nFIGURES RSS {start / 1024 / 1024:.0f} MB -> +{grown / 1024 / 1024:.1f} MB after {first}, then {again}")
    assert first == {200: 8_000}, first
    assert again == {429: 8_000}, again
    assert grown < 10 * 1024 * 1024, f"RSS grew by {grown / 1024 / 1024:.1f} MB"
