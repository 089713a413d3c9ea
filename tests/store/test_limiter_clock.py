"""The limiter on an injected clock: the circuit breaker's cool-down and the in-process
stand-in of `on_store_error: local` read the clock the limiter is given, so their
timing is asserted to the millisecond by setting the time, never by waiting for it.

The store is a real RedisStore with nothing listening on its port, so every check
fails at once (no connection), as a dead Redis fails them."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from gateway.config.model import Limit
from gateway.limiter.circuit_breaker import BREAKER_COOLDOWN, BREAKER_FAILURES, BreakerState
from gateway.limiter.limiter import Limiter
from gateway.limiter.store import LimitCheck
from gateway.redis.store import RedisStore
from gateway.testing import config_from_yaml
from tests.helpers import store_config
from tests.processes import RedisServer


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def a_limit(policy: str) -> Limit:
    config = config_from_yaml(
        f"""
limits:
  per_client: {{rate: 1/second, burst: 2, key: header:X-API-Key, on_store_error: {policy}}}
routes:
  - match: {{path: /}}
    upstream: http://127.0.0.1:1
    limits: [per_client]
"""
    )
    return config.limits[0]


@pytest.fixture
async def dead_store() -> AsyncIterator[RedisStore]:
    server = RedisServer()  # a free port, and nothing listening on it
    store = RedisStore(store_config(server.url, key_secret=None))
    try:
        yield store
    finally:
        await store.close()


async def test_the_breaker_opens_and_probes_on_the_limiters_clock(dead_store):
    clock = Clock()
    changes: list[BreakerState] = []
    limiter = Limiter(dead_store, shared_store=True, on_breaker_change=changes.append, clock=clock)
    check = [LimitCheck(limit=a_limit("open"), identity="header:x-api-key=k", cost=1)]
    for _ in range(BREAKER_FAILURES):
        clock.now += 0.05  # failures spread over more than BREAKER_FAILING_SECONDS
        assert (await limiter.check(check)).statuses[0].outcome == "fail_open"
    assert limiter.breaker.state is BreakerState.OPEN
    opened_at = clock.now
    clock.now = opened_at + BREAKER_COOLDOWN - 0.001
    assert (await limiter.check(check)).statuses[0].outcome == "fail_open"
    assert changes[-1] is BreakerState.OPEN  # no probe a millisecond before the cool-down ends
    clock.now = opened_at + BREAKER_COOLDOWN
    assert (await limiter.check(check)).statuses[0].outcome == "fail_open"
    assert BreakerState.HALF_OPEN in changes[changes.index(BreakerState.OPEN) :]  # the probe went out


async def test_the_local_stand_in_refills_on_the_limiters_clock(dead_store):
    clock = Clock()
    limiter = Limiter(dead_store, shared_store=True, clock=clock)
    check = [LimitCheck(limit=a_limit("local"), identity="header:x-api-key=k", cost=1)]
    decisions = [await limiter.check(check) for _ in range(3)]
    assert [d.statuses[0].outcome for d in decisions] == ["fail_local"] * 3
    assert [d.allowed for d in decisions] == [True, True, False]  # burst 2
    clock.now += 0.999
    assert not (await limiter.check(check)).allowed  # 1/second: not yet a token
    clock.now += 0.001
    assert (await limiter.check(check)).allowed
