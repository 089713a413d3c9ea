"""Store checks per second with no HTTP in the way: one process (on uvloop, as
the gateway runs) keeps IN_FLIGHT checks in flight against one private Redis,
for the project's RedisStore, for redis-py EVALSHA of the same Lua script per
call, and for the `limits` library's three async Redis strategies. Every
contender is opened once and measured in interleaved rounds, like the HTTP
variants.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import redis.asyncio
import uvloop

from gateway.limiter.store import LimitCheck, StoreError
from gateway.redis.scripts import load_script
from gateway.redis.store import RedisStore
from gateway.testing import config_from_yaml
from tests.bench.naive_proxy import ALL_ALLOWED_ARGS

IN_FLIGHT = 200
CLIENT_COUNT = 10_000
# The `limits` strategies' equivalent of the all-allowed bucket.
LIMITS_ALL_ALLOWED = "1000000/second"

# Built from YAML, as the gateway builds it, so a changed StoreConfig needs no edit here.
# The timeout is far above the default 10 ms on purpose: this measures how many checks
# the store completes, and at 200 in flight a check that waits for a pooled connection
# is slow, not failed.
PROJECT_STORE_YAML = """
store:
  url: {url}
  timeout: 1s
limits:
  bench: {{rate: 1000000/second, burst: 1000000, key: ['header:X-API-Key']}}
routes:
  - match: {{path: /}}
    upstream: http://127.0.0.1:9
    limits: [bench]
"""

Check = Callable[[int], Awaitable[object]]  # one check for client number n


@dataclass(frozen=True)
class Contender:
    key: str
    title: str
    open: Callable[[str], Awaitable[tuple[Check, Callable[[], Awaitable[None]]]]]  # redis URL -> (check, close)


@dataclass(frozen=True)
class StoreRun:
    checks_per_second: float
    failed: int  # StoreError from the project's store (it times out rather than wait forever)


async def open_project_store(url: str) -> tuple[Check, Callable[[], Awaitable[None]]]:
    config = config_from_yaml(PROJECT_STORE_YAML.format(url=url))
    assert config.store is not None
    store = RedisStore(config.store)
    await store.start()
    limit = config.limits[0]
    requests = [[LimitCheck(limit, f"header:X-API-Key=client-{n}", 1)] for n in range(CLIENT_COUNT)]
    return (lambda n: store.check(requests[n])), store.close


async def open_redis_py_evalsha(url: str) -> tuple[Check, Callable[[], Awaitable[None]]]:
    # One connection per check in flight: redis-py's pool raises, rather than waits, when it runs out.
    client = redis.asyncio.Redis.from_url(url, max_connections=IN_FLIGHT)
    sha = await client.script_load(load_script())
    keys = [f"bench-evalsha:client-{n}" for n in range(CLIENT_COUNT)]
    return (lambda n: client.evalsha(sha, 1, keys[n], *ALL_ALLOWED_ARGS)), client.aclose


def limits_strategy(strategy_name: str) -> Callable[[str], Awaitable[tuple[Check, Callable[[], Awaitable[None]]]]]:
    async def open_strategy(url: str) -> tuple[Check, Callable[[], Awaitable[None]]]:
        import limits
        import limits.aio.strategies
        from limits.aio.storage import RedisStorage

        storage = RedisStorage(url.replace("redis://", "async+redis://", 1))
        limiter = getattr(limits.aio.strategies, strategy_name)(storage)
        item = limits.parse(LIMITS_ALL_ALLOWED)
        clients = [f"client-{n}" for n in range(CLIENT_COUNT)]

        async def close() -> None:
            pass  # coredis has no close on this client; its connections go with the event loop

        # The strategy's name keeps each strategy's keys apart: they store different Redis types.
        return (lambda n: limiter.hit(item, strategy_name, clients[n])), close

    return open_strategy


CONTENDERS: tuple[Contender, ...] = (
    Contender("store", "project RedisStore (gateway.redis.store)", open_project_store),
    Contender("evalsha", "redis-py EVALSHA per call, same script", open_redis_py_evalsha),
    Contender("limits-moving", "limits MovingWindowRateLimiter", limits_strategy("MovingWindowRateLimiter")),
    Contender("limits-fixed", "limits FixedWindowRateLimiter", limits_strategy("FixedWindowRateLimiter")),
    Contender(
        "limits-sliding", "limits SlidingWindowCounterRateLimiter", limits_strategy("SlidingWindowCounterRateLimiter")
    ),
)


async def run_for(check: Check, seconds: float) -> StoreRun:
    """IN_FLIGHT workers, each starting its next check when its last one returns, for `seconds`."""
    stop_at = time.perf_counter() + seconds
    completed = failed = 0

    async def worker(first_client: int) -> None:
        nonlocal completed, failed
        client = first_client
        while time.perf_counter() < stop_at:
            try:
                await check(client)
            except StoreError:
                failed += 1
            else:
                completed += 1
            client = (client + IN_FLIGHT) % CLIENT_COUNT

    started = time.perf_counter()
    await asyncio.gather(*(worker(n) for n in range(IN_FLIGHT)))
    return StoreRun(checks_per_second=completed / (time.perf_counter() - started), failed=failed)


async def _measure(redis_url: str, rounds: int, seconds: float, warmup: float) -> dict[str, list[StoreRun]]:
    opened: list[tuple[Contender, Check, Callable[[], Awaitable[None]]]] = []
    try:
        for contender in CONTENDERS:
            check, close = await contender.open(redis_url)
            opened.append((contender, check, close))
        for _, check, _ in opened:
            await run_for(check, warmup)  # fills every pool before anything counts
        runs: dict[str, list[StoreRun]] = {contender.key: [] for contender in CONTENDERS}
        for round_number in range(1, rounds + 1):
            for contender, check, _ in opened:
                runs[contender.key].append(await run_for(check, seconds))
            progress = ", ".join(f"{key} {results[-1].checks_per_second:.0f}" for key, results in runs.items())
            print(f"bench: store round {round_number}/{rounds} (checks/s): {progress}", file=sys.stderr)
        return runs
    finally:
        for _, _, close in opened:
            await close()


def measure_store_checks(redis_url: str, *, rounds: int, seconds: float, warmup: float) -> dict[str, list[StoreRun]]:
    return uvloop.run(_measure(redis_url, rounds, seconds, warmup))


def contender_titles() -> Sequence[tuple[str, str]]:
    return [(contender.key, contender.title) for contender in CONTENDERS]
