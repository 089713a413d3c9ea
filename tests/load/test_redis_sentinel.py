"""Redis Sentinel: the store finds the master through the sentinels and follows
a failover. A real master, a replica and three sentinels, all redis-server
processes; the gateway as users start it in tests."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from gateway.limiter.circuit_breaker import BREAKER_COOLDOWN
from gateway.redis.connection import RECONNECT_BACKOFF_MAX
from gateway.testing import running_gateway
from tests.load.test_redis_failures import gateway_yaml, get
from tests.processes import SentinelServer, eventually, wait_until

pytestmark = pytest.mark.timing  # measures time, load or memory: one such module runs at a time


def sentinel_url(sentinels: list[SentinelServer]) -> str:
    return "redis+sentinel://" + ",".join(f"127.0.0.1:{s.port}" for s in sentinels) + "/mymaster"


async def decisions_until_back(http: aiohttp.ClientSession, url: str, *, limit_seconds: float) -> tuple[float, set[int]]:
    """Request /closed until a decision comes from Redis again; (seconds it took, statuses seen)."""
    started = time.monotonic()
    seen = set()
    while True:
        response = await get(http, url + "/closed")
        seen.add(response.status)
        if "RateLimit" in response.headers:
            return time.monotonic() - started, seen
        assert time.monotonic() - started < limit_seconds, f"no decision from Redis for {limit_seconds} s"


async def test_the_store_finds_the_master_and_follows_it_when_it_dies_under_load(sentinel_group, upstream):
    master, replica, sentinels = sentinel_group
    config = gateway_yaml(sentinel_url(sentinels), upstream, timeout="10ms", burst=100_000)
    async with running_gateway(config) as gw, aiohttp.ClientSession() as http:
        first = await get(http, gw.url + "/closed")
        assert first.headers["RateLimit"] == '"strict";r=99999;t=86400'
        assert len(master.client().keys("rl:strict:*")) == 1
        stop = asyncio.Event()
        answers: list[tuple[float, bool]] = []  # (when, decided by Redis) for every request

        async def load(worker: int) -> None:
            while not stop.is_set():
                response = await get(http, gw.url + "/closed", key=f"client-{worker}")
                assert response.status in (200, 503), response.status
                answers.append((time.monotonic(), "RateLimit" in response.headers))

        workers = [asyncio.ensure_future(load(i)) for i in range(20)]
        try:
            await eventually(lambda: len(answers) > 200, what="load before the failure")
            killed = time.monotonic()
            master.stop()
            # Sentinel's own timers, then at most one reconnect backoff and one breaker cool-down.
            sentinel_seconds = (SentinelServer.DOWN_AFTER_MS + SentinelServer.FAILOVER_TIMEOUT_MS) / 1000
            bound = sentinel_seconds + RECONNECT_BACKOFF_MAX + BREAKER_COOLDOWN
            await eventually(
                lambda: any(decided and when > killed + 0.1 for when, decided in answers[-20:]),
                what="decisions from the promoted master",
                deadline=bound,
            )
            back = time.monotonic()
            await eventually(lambda: len(answers) > 0 and answers[-1][0] > back + 0.5, what="load after the failover")
        finally:
            stop.set()
            await asyncio.gather(*workers)
    undecided_after = [when for when, decided in answers if when > back + 0.1 and not decided]
    print(f"sentinel failover under load: decisions from Redis again {back - killed:.2f} s after the master died")
    assert undecided_after == [], f"{len(undecided_after)} requests undecided after the failover"
    assert replica.client().info("replication")["role"] == "master"
    # The promoted replica had the buckets: the first client's, written before the failure, too.
    assert len(replica.client().keys("rl:strict:*")) == 21



async def test_a_demoted_master_answering_readonly_sends_the_store_to_the_new_one(sentinel_group, upstream):
    master, replica, sentinels = sentinel_group
    async with running_gateway(gateway_yaml(sentinel_url(sentinels), upstream, timeout="10ms")) as gw:
        async with aiohttp.ClientSession() as http:
            assert "RateLimit" in (await get(http, gw.url + "/closed")).headers
            sentinels[0].client().sentinel_failover("mymaster")  # graceful: the old master lives on as a replica
            wait_until(lambda: replica.client().info("replication")["role"] == "master", what="the promotion")
            # The demotion Sentinel sends the old master once its next INFO poll (every 10 s)
            # sees it still a master, sent at once: the same REPLICAOF, 10 s sooner.
            master.client().replicaof("127.0.0.1", replica.port)
            wait_until(lambda: master.client().info("replication")["role"] == "slave", what="the old master's demotion")
            replica.client().config_resetstat()
            _window, seen = await decisions_until_back(http, gw.url, limit_seconds=3.0)
            assert seen <= {200, 503}
            for _ in range(5):
                assert "RateLimit" in (await get(http, gw.url + "/closed")).headers
            # The decisions came from the new master, whose replica the old one now is.
            assert replica.client().info("commandstats")["cmdstat_evalsha"]["calls"] >= 6
