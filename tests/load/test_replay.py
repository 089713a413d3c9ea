"""Linearizability replay: 8 gateway processes flood one key, Redis logs every
decision the script makes, and the pure-Python model, replaying the log in
Redis's order, makes every one of the same decisions.

The gateways run through `tests.instrumented_gateway` (the CLI with the logging
build of the script, tests/replay_script.py). 256 concurrent client loops (32 per
gateway) send requests for one API key for LOAD_SECONDS against 50/s, burst 20,
so Redis both allows and denies. Every request is answered before the counts are
taken. The limit runs at the defaults users run (10 ms timeout, failing open), so
a check Redis did not answer in time would show as a fail_open allow the log
lacks; there must be none.

What must hold:
- the log's sequence is 1..N with no gap, and N is the number of script calls
  Redis counted (`INFO commandstats`): the log is every decision;
- replayed in sequence order through gateway/limiter/bucket.py, every allow or
  deny is the model's, and the remaining tokens agree to 1e-9 × capacity, as
  tests/model_check.py compares them (a rounding tie, where the cost lies
  between two balances that agree, is the one allowed split; a flood lands on
  one every few thousand decisions, and each is counted and printed);
- the 200s the clients received across the 8 gateways, the allows the gateways
  counted and the log's allows are one number, and the model's allows are that
  number too (give or take the rounding ties). The
  gateways' denial caches answer many 429s without calling Redis; those are
  never allows, so the allowed count covers every request.

Redis has a core of its own (`dedicated_redis`), as in production.
"""

from __future__ import annotations

import asyncio
import collections
import os
import time
from pathlib import Path

import aiohttp
import pytest

from tests.processes import gateway_fleet
from tests.replay_script import LOG_SUFFIX, Decision, replay
from tests.scrape import settled_decisions

pytestmark = pytest.mark.timing  # measures time, load or memory: one such module runs at a time

GATEWAYS = 8
LOOPS_PER_GATEWAY = 32
LOAD_SECONDS = 3.0
RATE, BURST = "50/second", 20
REPO = Path(__file__).resolve().parents[2]

CONFIG = """
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
store:
  url: {url}
limits:
  replay:
    rate: {rate}
    burst: {burst}
    key: header:X-API-Key
routes:
  - match: {{path: /}}
    upstream: {upstream}
    limits: [replay]
"""


async def flood(urls: list[str], seconds: float) -> collections.Counter[int]:
    """LOOPS_PER_GATEWAY loops per gateway, each sending one request after another
    until `seconds` have passed; every response is read and counted."""
    statuses: collections.Counter[int] = collections.Counter()
    end = time.monotonic() + seconds
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def loop(url: str) -> None:
            while time.monotonic() < end:
                async with http.get(url, headers={"X-API-Key": "one-client"}) as response:
                    await response.read()
                    statuses[response.status] += 1

        await asyncio.gather(*(loop(url + "/replay") for url in urls for _ in range(LOOPS_PER_GATEWAY)))
    return statuses


async def test_eight_gateways_decide_exactly_as_the_model_replaying_redis_order(dedicated_redis, upstream):
    config = CONFIG.format(url=dedicated_redis.url, rate=RATE, burst=BURST, upstream=upstream)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with gateway_fleet(config, GATEWAYS, module="tests.instrumented_gateway", env=env) as gateways:
        statuses = await flood([gateway.url for gateway in gateways], LOAD_SECONDS)
        async with aiohttp.ClientSession() as http:
            counts = [await settled_decisions(http, gateway.admin_url) for gateway in gateways]

    redis = dedicated_redis.client()
    try:
        logs = redis.keys("rl:replay:*" + LOG_SUFFIX)
        assert len(logs) == 1, logs
        log = [Decision.parse(entry) for entry in redis.lrange(logs[0], 0, -1)]
        stats = redis.info("commandstats")
    finally:
        redis.close()
    script_calls = sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("evalsha", "eval"))
    result = replay(log)
    logged_allows = sum(d.allowed for d in log)
    print(
        f"{sum(statuses.values())} requests {dict(statuses)}; {result.decisions} script calls replayed, "
        f"{logged_allows} allowed, {result.decisions - logged_allows} denied by Redis, "
        f"{result.allowed} allowed by the model; {result.ties} rounding ties ({result.script_over_model} allowed "
        f"by the script alone, widest {result.widest_tie:.1e}); "
        f"over {(log[-1].now_ms - log[0].now_ms) / 1000:.2f} s of Redis time"
    )

    assert result.mismatches == []
    # Every decision is logged, numbered without a gap; a call may carry several checks.
    assert result.decisions == len(log) == max(d.seq for d in log)
    assert 0 < script_calls <= len(log)
    assert set(statuses) <= {200, 429}, statuses
    assert statuses[200] == logged_allows == sum(c["replay", "allow"] for c in counts)
    # The model's count, and every decision, is the script's but for rounding ties (model_check.py).
    assert abs(result.allowed - logged_allows) <= result.ties
    assert sum(c["replay", "fail_closed"] + c["replay", "fail_open"] for c in counts) == 0
    # Both kinds of decision were made by Redis, and the flood outran the limit.
    assert 0 < logged_allows < result.decisions
    assert statuses[429] > statuses[200]
