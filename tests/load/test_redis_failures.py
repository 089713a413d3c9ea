"""When Redis is slow, stopped, restarted or loses its script cache: the store's
own behaviour, and what the fault suite (tests/load/test_faults.py) does not cover.

Each check is bounded by store.timeout as a whole, pool wait included; a check
that timed out is never sent again; a gateway started before Redis begins
deciding once Redis is up; gateways agree on the identity secret after Redis
restarts empty; and SCRIPT FLUSH leaves the counts exact. What clients see
under load during each fault, with latency, recovery, store calls and leaks,
is in the fault suite."""

from __future__ import annotations

import asyncio
import collections
import time

import aiohttp
import pytest

from gateway.config.model import Limit
from gateway.limiter.store import LimitCheck, StoreError
from gateway.redis.store import RedisStore
from gateway.testing import config_from_yaml, running_gateway
from tests.helpers import store_config
from tests.processes import RedisServer

pytestmark = pytest.mark.timing  # measures time, load or memory: one such module runs at a time


def gateway_yaml(store_url: str, upstream: str, *, timeout: str, burst: int = 10, rate: str = "1/day") -> str:
    """Three routes: /free has no limit, /open fails open, /closed fails closed."""
    return f"""
store:
  url: {store_url}
  timeout: {timeout}
limits:
  fair:
    rate: {rate}
    burst: {burst}
    key: header:X-API-Key
    on_store_error: open
  strict:
    rate: {rate}
    burst: {burst}
    key: header:X-API-Key
    on_store_error: closed
routes:
  - match: {{path: /free}}
    upstream: {upstream}
  - match: {{path: /open}}
    upstream: {upstream}
    limits: [fair]
  - match: {{path: /closed}}
    upstream: {upstream}
    limits: [strict]
"""


def one_limit(burst: int = 50) -> Limit:
    config = config_from_yaml(
        f"""
limits:
  per_client: {{rate: 1/day, burst: {burst}, key: header:X-API-Key}}
routes:
  - match: {{path: /}}
    upstream: http://127.0.0.1:1
    limits: [per_client]
"""
    )
    return config.limits[0]


async def get(http: aiohttp.ClientSession, url: str, key: str = "k") -> aiohttp.ClientResponse:
    async with http.get(url, headers={"X-API-Key": key}) as response:
        await response.read()
        return response


def gateway_connections(redis_server) -> int:
    """Connections to Redis other than this test's own client."""
    return len([c for c in redis_server.client().client_list() if c["cmd"] != "client|list"])


async def test_a_burst_of_checks_shares_one_connection_and_stays_exact(dedicated_redis):
    redis_server = dedicated_redis
    store = RedisStore(store_config(redis_server.url, timeout=0.01, key_secret=None))
    await store.start()
    try:
        check = [LimitCheck(limit=one_limit(burst=50), identity="header:x-api-key=k", cost=1)]
        # 300 at once: Redis runs the script in ~10 us, so a 10 ms timeout covers several
        # hundred checks queued on one connection, but not thousands.
        answers = await asyncio.gather(*(store.check(check) for _ in range(300)), return_exceptions=True)
        assert gateway_connections(redis_server) == 1
    finally:
        await store.close()
    errors = [a for a in answers if isinstance(a, BaseException)]
    assert errors == []
    assert collections.Counter(a.allowed for a in answers) == {True: 50, False: 250}


async def test_a_hung_redis_times_out_every_check_and_the_connection_survives(redis_server):
    store = RedisStore(store_config(redis_server.url, timeout=0.01, key_secret=None))
    await store.start()
    check = [LimitCheck(limit=one_limit(burst=10_000), identity="header:x-api-key=k", cost=1)]
    sent = 0
    try:
        for _ in range(4):
            redis_server.pause()
            try:
                # Starts are spread over ~20 ms so that deadlines land while batches are
                # still being written.
                async with asyncio.timeout(10):
                    checks = []
                    for i in range(200):
                        checks.append(asyncio.ensure_future(store.check(check)))
                        if i % 10 == 9:
                            await asyncio.sleep(0.001)
                    answers = await asyncio.gather(*checks, return_exceptions=True)
            finally:
                redis_server.resume()
            assert all(isinstance(a, StoreError) for a in answers), {type(a).__name__ for a in answers}
            assert {str(a).rpartition(": ")[2] for a in answers} == {"no answer within 10 ms"}
            # The late replies are read and dropped in order: the next answers are this
            # round's own, on the same connection. The first may meet a Redis still
            # catching up after SIGCONT, so it is retried; a timeout is a sent check too.
            sent += len(checks)
            remaining = []
            deadline = time.monotonic() + 5
            while len(remaining) < 3:
                sent += 1
                try:
                    remaining.append((await store.check(check)).remaining[0])
                except StoreError:
                    assert time.monotonic() < deadline, "the store never answered again"
                    remaining.clear()
            assert remaining[0] - remaining[1] == pytest.approx(1, abs=0.01)
            assert remaining[1] - remaining[2] == pytest.approx(1, abs=0.01)
            assert gateway_connections(redis_server) == 1
        # Every timed-out check still ran once Redis woke, and none ran twice.
        client = redis_server.client()
        tokens = float(client.hget(next(client.scan_iter("rl:per_client:*")), "tokens"))
        assert tokens == pytest.approx(10_000 - sent, abs=0.1)
    finally:
        await store.close()


async def test_past_max_pending_a_check_fails_at_once(redis_server):
    store = RedisStore(store_config(redis_server.url, timeout=0.05, max_pending=20, key_secret=None))
    await store.start()
    check = [LimitCheck(limit=one_limit(), identity="header:x-api-key=k", cost=1)]
    redis_server.pause()
    try:
        started = time.perf_counter()
        answers = await asyncio.gather(*(store.check(check) for _ in range(100)), return_exceptions=True)
        elapsed = time.perf_counter() - started
    finally:
        redis_server.resume()
        await store.close()
    reasons = collections.Counter(str(a).rpartition(": ")[2] for a in answers)
    assert reasons == {"no answer within 50 ms": 20, "20 commands already waiting for Redis": 80}, reasons
    assert elapsed < 5


async def test_a_check_that_timed_out_is_not_sent_again(redis_server, upstream):
    config = gateway_yaml(redis_server.url, upstream, timeout="200ms")
    client = redis_server.client()
    async with running_gateway(config) as gw, aiohttp.ClientSession() as http:
        first = await get(http, gw.url + "/open")
        assert first.headers["RateLimit"] == '"fair";r=9;t=86400'
        (bucket,) = [k for k in client.scan_iter("rl:fair:*")]
        redis_server.pause()
        try:
            timed_out = await get(http, gw.url + "/open")
        finally:
            redis_server.resume()
        assert timed_out.status == 200 and "RateLimit" not in timed_out.headers, "the check did not time out"
        # The EVALSHA sent before the timeout may run once Redis wakes; it must not run twice.
        charges = 9 - float(client.hget(bucket, "tokens"))
        assert round(charges) in (0, 1) and charges == pytest.approx(round(charges), abs=0.01)
        # Later replies are not mixed up with the abandoned one: each matches Redis.
        for _ in range(3):
            answer = await get(http, gw.url + "/open")
            tokens = float(client.hget(bucket, "tokens"))
            assert answer.headers["RateLimit"].startswith(f'"fair";r={int(tokens)};')


async def test_a_gateway_started_before_redis_starts_deciding_once_redis_is_up(upstream):
    server = RedisServer()  # a free port, nothing listening yet
    try:
        async with running_gateway(gateway_yaml(server.url, upstream, timeout="10ms")) as gw:
            async with aiohttp.ClientSession() as http:
                assert (await get(http, gw.url + "/open")).status == 200
                assert (await get(http, gw.url + "/closed")).status == 503
                server.start()
                up = time.monotonic()
                while "RateLimit" not in (await get(http, gw.url + "/open")).headers:
                    # Reconnects are tried at least every 0.5 s; seconds more are the scheduler's.
                    assert time.monotonic() - up < 5.0, "decisions did not begin within 5 s of Redis starting"
                assert (await get(http, gw.url + "/closed")).headers["RateLimit"] == '"strict";r=9;t=86400'
    finally:
        server.__exit__(None, None, None)


async def test_gateways_keep_sharing_buckets_after_redis_restarts_empty(redis_server, upstream):
    """A restarted Redis has lost the fleet's identity secret along with the buckets.
    A gateway that started before the restart must publish its secret again, or a
    gateway started afterwards picks another one and each client gets two buckets."""
    config = gateway_yaml(redis_server.url, upstream, timeout="2s")
    async with running_gateway(config) as before, aiohttp.ClientSession() as http:
        assert (await get(http, before.url + "/closed")).status == 200
        redis_server.stop()
        redis_server.start()
        assert redis_server.client().dbsize() == 0
        # The first check may meet the connection the restart closed (503); the next one decides.
        answer = await get(http, before.url + "/closed")
        if answer.status == 503:
            answer = await get(http, before.url + "/closed")
        assert answer.headers["RateLimit"] == '"strict";r=9;t=86400'
        async with running_gateway(config) as after:
            statuses = collections.Counter()
            for i in range(20):
                statuses[(await get(http, (before, after)[i % 2].url + "/closed")).status] += 1
    assert statuses == {200: 9, 429: 11}


async def test_gateways_agree_again_when_a_new_gateway_reaches_an_emptied_redis_first(
    redis_server, upstream, monkeypatch
):
    """The other order: after an empty restart a new gateway starts first, picks a new
    secret and loads the script, so the old gateway never sees NOSCRIPT. It re-reads the
    secret every SECRET_REREAD_SECONDS (shortened here) and then shares buckets again."""
    from gateway.redis import secret as redis_store

    config = gateway_yaml(redis_server.url, upstream, timeout="2s")
    async with running_gateway(config) as before, aiohttp.ClientSession() as http:
        assert (await get(http, before.url + "/closed")).status == 200
        redis_server.stop()
        redis_server.start()
        async with running_gateway(config) as after:
            assert (await get(http, after.url + "/closed")).status == 200  # after's secret is now Redis's
            monkeypatch.setattr(redis_store, "SECRET_REREAD_SECONDS", 0.0)
            store = before.gateway.store
            secret_key = "rl:" + redis_store.SECRET_KEY_SUFFIX

            def adopted() -> bool:
                return store._secret == redis_server.client().get(secret_key).encode()

            assert not adopted()
            for _ in range(100):
                # The first check meets the connection the restart closed; a later one starts the re-read.
                await get(http, before.url + "/closed")
                await asyncio.sleep(0.01)  # lets the background re-read run in this loop
                if adopted():
                    break
            monkeypatch.setattr(redis_store, "SECRET_REREAD_SECONDS", 3600.0)
            assert adopted()
            redis_server.client().flushdb()
            statuses = collections.Counter()
            for i in range(20):
                statuses[(await get(http, (before, after)[i % 2].url + "/closed")).status] += 1
    assert statuses == {200: 10, 429: 10}


async def test_script_flush_during_traffic_is_invisible_to_clients(redis_server, upstream):
    config = gateway_yaml(redis_server.url, upstream, timeout="2s", burst=100)
    client = redis_server.client()
    async with running_gateway(config) as gw, aiohttp.ClientSession() as http:
        client.config_resetstat()
        statuses: collections.Counter[int] = collections.Counter()
        for _ in range(4):
            client.script_flush()
            # 50 requests at once, so the flush lands while checks are in flight.
            wave = asyncio.gather(*(get(http, gw.url + "/closed") for _ in range(50)))
            await asyncio.to_thread(client.script_flush)
            statuses.update(r.status for r in await wave)
        stats = client.info("commandstats")
    assert statuses == {200: 100, 429: 100}
    # The flushes did bite: some EVALSHA got NOSCRIPT and the script was sent in full.
    assert stats["cmdstat_eval"]["calls"] >= 1
