"""Benchmark: what one limiter decision costs, in-process store vs Redis store.

Starts a private redis-server on a free port, then runs rounds of N checks on
each store, interleaved (memory, redis, memory, redis, ...) so machine noise
hits both alike, and prints the median per-check time of each and their ratio.

    .venv/bin/python scripts/bench_limiter_check.py [--rounds 15] [--checks 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.config.model import StoreConfig  # noqa: E402
from gateway.limiter.limiter import Limiter  # noqa: E402
from gateway.limiter.memory_store import MemoryStore  # noqa: E402
from gateway.limiter.redis_store import RedisStore  # noqa: E402
from gateway.limiter.store import LimitCheck  # noqa: E402
from gateway.testing import config_from_yaml  # noqa: E402
from tests.processes import RedisServer  # noqa: E402

CONFIG = """
limits:
  per_client: {rate: 1000000/second, burst: 1000000, key: [header:X-API-Key]}
  per_ip: {rate: 1000000/second, burst: 1000000, key: [ip]}
routes:
  - match: {path: /}
    upstream: http://127.0.0.1:1
    limits: [per_client, per_ip]
"""


async def round_seconds(limiter: Limiter, checks: list[list[LimitCheck]]) -> float:
    started = time.perf_counter()
    for request in checks:
        decision = await limiter.check(request)
        assert decision.allowed, decision
    return (time.perf_counter() - started) / len(checks)


async def main(rounds: int, count: int) -> None:
    config = config_from_yaml(CONFIG)
    per_client, per_ip = config.limits
    requests = [
        [LimitCheck(per_client, f"header:x-api-key=key{i % 500}", 1), LimitCheck(per_ip, f"ip=10.0.{i % 200}.1", 1)]
        for i in range(count)
    ]
    with RedisServer() as server:
        redis_store = RedisStore(
            StoreConfig(url=server.url, timeout=1.0, prefix="bench:", local_divisor=1, max_pending=4096, key_secret=None)
        )
        await redis_store.start()
        limiters = {"memory": Limiter(MemoryStore()), "redis": Limiter(redis_store)}
        times: dict[str, list[float]] = {name: [] for name in limiters}
        for name, limiter in limiters.items():  # warm-up
            await round_seconds(limiter, requests[:200])
        for _ in range(rounds):
            for name, limiter in limiters.items():
                times[name].append(await round_seconds(limiter, requests))
        await redis_store.close()
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, median in medians.items():
        print(f"{name:6s} median {median * 1e6:8.1f} µs per check (2 limits), over {rounds} rounds of {count}")
    print(f"redis / memory: {medians['redis'] / medians['memory']:.1f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--checks", type=int, default=2000)
    args = parser.parse_args()
    asyncio.run(main(args.rounds, args.checks))
