"""The store's circuit breaker: on its own, then in a gateway whose Redis hangs.

While the breaker is open a request costs the store nothing: the number of
checks a hung Redis runs once it wakes is what it took to open the breaker plus
one probe per cool-down, however many requests came meanwhile."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from gateway.limiter.circuit_breaker import (
    BREAKER_COOLDOWN,
    BREAKER_FAILING_SECONDS,
    BREAKER_FAILURES,
    BreakerState,
    CircuitBreaker,
)
from gateway.limiter.limiter import Limiter
from gateway.limiter.store import LimitCheck
from gateway.redis.store import RedisStore
from gateway.testing import running_gateway
from tests.helpers import store_config
from tests.load.test_redis_failures import gateway_yaml, get, one_limit
from tests.processes import RedisServer, eventually
from tests.scrape import scrape, value

pytestmark = pytest.mark.timing  # measures time, load or memory: one such module runs at a time


def test_it_opens_after_consecutive_failures_over_a_while_only():
    changes: list[BreakerState] = []
    breaker = CircuitBreaker(failures=3, failing_seconds=0.1, cooldown=1.0, on_change=changes.append)
    for _ in range(2):
        breaker.failed(0.0)
    breaker.succeeded()  # a success in between: the count starts again
    for _ in range(2):
        breaker.failed(1.0)
    assert breaker.state is BreakerState.CLOSED and breaker.allows(1.0)
    breaker.failed(1.05)  # three failures, but within a stall shorter than 0.1 s
    assert breaker.state is BreakerState.CLOSED
    breaker.failed(1.1)
    assert breaker.state is BreakerState.OPEN
    assert not breaker.allows(1.5)
    assert changes == [BreakerState.CLOSED, BreakerState.OPEN]


def test_a_short_stall_that_fails_hundreds_of_checks_at_once_does_not_open_it():
    breaker = CircuitBreaker()
    for _ in range(500):
        breaker.failed(7.0)
    assert breaker.state is BreakerState.CLOSED


def test_after_the_cooldown_one_probe_decides():
    breaker = CircuitBreaker(failures=1, failing_seconds=0.0, cooldown=1.0)
    breaker.failed(10.0)
    assert not breaker.allows(10.9)
    assert breaker.allows(11.0)  # the probe
    assert breaker.state is BreakerState.HALF_OPEN
    assert not breaker.allows(11.0)  # everyone else waits for it
    breaker.failed(11.1)  # the probe failed: another cool-down
    assert breaker.state is BreakerState.OPEN and not breaker.allows(12.0)
    assert breaker.allows(12.1)
    breaker.succeeded()
    assert breaker.state is BreakerState.CLOSED and breaker.allows(12.1)


def test_a_probe_that_went_away_is_owed_to_the_next_caller():
    breaker = CircuitBreaker(failures=1, failing_seconds=0.0, cooldown=1.0)
    breaker.failed(0.0)
    assert breaker.allows(1.0)
    breaker.abandoned(1.0)
    assert breaker.allows(1.0) and breaker.state is BreakerState.HALF_OPEN


def test_a_probe_that_could_not_be_sent_is_owed_to_the_next_caller():
    breaker = CircuitBreaker(failures=2, failing_seconds=0.0, cooldown=1.0)
    breaker.not_sent(0.0)  # while closed, a failure like any other
    breaker.not_sent(0.0)
    assert breaker.state is BreakerState.OPEN and not breaker.allows(0.5)
    assert breaker.allows(1.0)
    breaker.not_sent(1.0)
    assert breaker.allows(1.0) and breaker.state is BreakerState.HALF_OPEN


async def test_a_hung_redis_costs_requests_nothing_once_the_breaker_opens(redis_server, upstream):
    config = gateway_yaml(redis_server.url, upstream, timeout="10ms", burst=100_000)
    async with running_gateway(config) as gw, aiohttp.ClientSession() as http:
        assert "RateLimit" in (await get(http, gw.url + "/open")).headers
        client = redis_server.client()
        client.config_resetstat()
        redis_server.pause()
        try:
            started = time.monotonic()
            statuses = {200: 0, 503: 0}
            for i in range(300):
                statuses[(await get(http, gw.url + ("/open" if i % 2 else "/closed"))).status] += 1
            outage = time.monotonic() - started
            async with http.get(gw.admin_url + "/readyz") as response:
                ready = await response.json()
            _, samples = await scrape(http, gw.admin_url)
        finally:
            redis_server.resume()
        # The checks written before the breaker opened, and the probes, run now.
        calls = client.info("commandstats")["cmdstat_evalsha"]["calls"]
        assert statuses == {200: 150, 503: 150}
        # Before it opens: the failures it needs, spread over BREAKER_FAILING_SECONDS of
        # 10 ms timeouts; after: one probe per cool-down.
        before = max(BREAKER_FAILURES, BREAKER_FAILING_SECONDS / 0.01 + 2)
        probes = outage / BREAKER_COOLDOWN + 1
        assert calls <= before + probes, f"{calls} checks reached Redis in {outage:.2f} s"
        assert ready["breaker"] in ("open", "half_open")
        assert value(samples, "gateway_store_breaker", state=ready["breaker"]) == 1
        assert value(samples, "gateway_store_breaker", state="closed") == 0
        # Redis is back: the next probe closes the breaker, a cool-down (0.5 s) later; the
        # bound leaves a loaded machine's scheduler seconds, and a breaker that never
        # probes again still fails it.
        back = time.monotonic()
        while "RateLimit" not in (await get(http, gw.url + "/open")).headers:
            assert time.monotonic() - back < 10 * BREAKER_COOLDOWN, "decisions did not resume"
        _, samples = await scrape(http, gw.admin_url)
        assert value(samples, "gateway_store_breaker", state="closed") == 1
        async with http.get(gw.admin_url + "/readyz") as response:
            assert (await response.json())["breaker"] == "closed"


async def test_a_probe_that_could_not_be_sent_leaves_the_probe_to_the_next_check():
    """While the connection is down a check fails at once and costs nothing, so a probe
    that met no connection learned nothing: the next check probes, and the first check
    after the connection is back is decided by Redis, not a cool-down later. (A failed
    probe used to open the breaker for another 0.5 s: with the reconnect backoff of up
    to 0.5 s on top, decisions resumed up to 1 s after Redis was back.)"""
    server = RedisServer()  # a free port, nothing listening yet
    store = RedisStore(store_config(server.url, timeout=0.01, key_secret=None))
    changes: list[BreakerState] = []
    limiter = Limiter(store, shared_store=True, on_breaker_change=changes.append)
    check = [LimitCheck(limit=one_limit(burst=1000), identity="header:x-api-key=k", cost=1)]
    try:
        # Failures until the breaker opens, then until its cool-down ends and a probe goes out.
        async def probed() -> bool:
            decision = await limiter.check(check)
            assert decision.statuses[0].outcome == "fail_open"
            return BreakerState.HALF_OPEN in changes

        await eventually(probed, what="the breaker to open and then probe", deadline=5)
        assert limiter.breaker.state is BreakerState.OPEN
        await asyncio.to_thread(server.start)
        await store.ping()  # connected
        decision = await limiter.check(check)
        assert decision.statuses[0].outcome == "allow", "the breaker waited out a cool-down after the probe"
    finally:
        await store.close()
        server.__exit__(None, None, None)
