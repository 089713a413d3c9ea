"""The newer limit kinds stay exact across a fleet: four gateway processes
(`python -m gateway run`) on one dedicated Redis, at the default store.timeout
(10 ms), limits failing open, and about 1,000 client connections spread over the
four, every request sent at once. A check not answered in time would pass and
show as an extra allowed request, so each test also reads `fail_open == 0` from
every gateway's /metrics.

- Tiers: each gold, silver and default-tier client gets exactly its tier's burst.
- `mode: delay`: exactly burst + floor(max_delay × rate) admitted, the rest 429;
  with the debt larger than the fleet's `max_delayed` slots, each gateway delays
  exactly its `max_delayed`.
- A quota: exactly its limit.
- Two limits on a route (per client and global): all-or-nothing; the requests
  the global bucket denied charged the per-client buckets nothing.
- Composite keys `[[header:X-API-Key, path]]`: each (key, path) exactly its burst.
- `lease: 20` on a global key: never more than the burst, and no less than the
  burst less 20 per process (the bound in docs/limit-policies.md).

Rates are slow enough (at most 2 tokens a second) that nothing refills while a
flood is decided, so each count is exact. The fleet and Redis are shared; each
test uses limits of its own. The same kinds with one process or modest
concurrency are in test_shaping, test_quota_gateway, test_keys_redis and
test_lease_fleet; one plain bucket at fleet scale in test_redis_race."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import hashlib
import random
import tempfile
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tests.processes import GatewayProcess, RedisServer, gateway_fleet
from tests.scrape import settled_decisions
from tests.upstream import serving_in_a_thread

pytestmark = pytest.mark.timing  # measures time, load or memory: one such module runs at a time

GATEWAYS = 4
MAX_DELAYED = 3  # per gateway process
LEASE = 20

GOLD = [f"gold-{i}" for i in range(4)]
SILVER = [f"silver-{i}" for i in range(4)]
PLAIN = [f"plain-{i}" for i in range(4)]
TIER_BURST = {"gold": 8, "silver": 5, "plain": 3}

SHAPED_RATE, SHAPED_BURST, SHAPED_MAX_DELAY = 1.0, 3, 4.5
QUOTA = 100
PAIR_CLIENT_BURST, PAIR_GLOBAL_BURST = 5, 40
ENDPOINT_BURST = 7
HOT_BURST = 100

CONFIG = """
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
store: {{url: "{url}"}}
max_delayed: {max_delayed}
limits:
  tiered:
    rate: 1/hour
    burst: {plain_burst}
    key: header:X-API-Key
    on_store_error: open
    tiers:
      from: {{file: "{keys_file}"}}
      gold: {{rate: 1/hour, burst: {gold_burst}}}
      silver: {{rate: 1/hour, burst: {silver_burst}}}
  shaped: {{rate: 1/second, burst: {shaped_burst}, mode: delay, max_delay: {shaped_max_delay_ms}ms,
            key: header:X-API-Key, on_store_error: open}}
  shaped_capped: {{rate: 2/second, burst: 1, mode: delay, max_delay: 60s, key: header:X-API-Key, on_store_error: open}}
  daily: {{quota: {{limit: {quota}, per: day, reset: "{reset}"}}, key: header:X-API-Key, on_store_error: open}}
  per_client: {{rate: 1/hour, burst: {pair_client}, key: header:X-API-Key, on_store_error: open}}
  everyone: {{rate: 1/hour, burst: {pair_global}, key: global, on_store_error: open}}
  per_endpoint: {{rate: 1/hour, burst: {endpoint_burst}, key: [[header:X-API-Key, path]], on_store_error: open}}
  hot: {{rate: 1/hour, burst: {hot_burst}, key: global, lease: {lease}, on_store_error: open}}
routes:
  - {{match: {{path: /tiers}}, upstream: "{upstream}", limits: [tiered]}}
  - {{match: {{path: /shaped}}, upstream: "{upstream}", limits: [shaped]}}
  - {{match: {{path: /capped}}, upstream: "{upstream}", limits: [shaped_capped]}}
  - {{match: {{path: /quota}}, upstream: "{upstream}", limits: [daily]}}
  - {{match: {{path: /pair}}, upstream: "{upstream}", limits: [per_client, everyone]}}
  - {{match: {{path: /solo}}, upstream: "{upstream}", limits: [per_client]}}
  - {{match: {{path: /a}}, upstream: "{upstream}", limits: [per_endpoint]}}
  - {{match: {{path: /b}}, upstream: "{upstream}", limits: [per_endpoint]}}
  - {{match: {{path: /c}}, upstream: "{upstream}", limits: [per_endpoint]}}
  - {{match: {{path: /hot}}, upstream: "{upstream}", limits: [hot]}}
  - {{match: {{path: /free}}, upstream: "{upstream}"}}
"""


class Fleet:
    def __init__(self, redis: RedisServer, gateways: list[GatewayProcess], arrivals: collections.Counter) -> None:
        self.redis = redis
        self.gateways = gateways
        # (path, X-API-Key) of each request the upstream received.
        self.arrivals = arrivals


@pytest.fixture(scope="module")
def fleet():
    arrivals: collections.Counter[tuple[str, str]] = collections.Counter()

    async def count(request: web.BaseRequest) -> web.Response:
        arrivals[request.path, request.headers.get("X-API-Key", "")] += 1
        return web.Response(text="ok")

    # The quota's window ends 12 hours from now, never during the test.
    reset = (datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=12)).strftime("%H:%M UTC")
    with contextlib.ExitStack() as stack:
        directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gateway-test-fleet-")))
        keys_file = directory / "keys.yaml"
        silver = ", ".join(f"'sha256:{hashlib.sha256(key.encode()).hexdigest()}'" for key in SILVER)
        keys_file.write_text(f"gold: [{', '.join(GOLD)}]\nsilver: [{silver}]\n")
        redis = stack.enter_context(RedisServer(dedicated=True))
        upstream = stack.enter_context(serving_in_a_thread(count))
        config = CONFIG.format(
            url=redis.url, upstream=upstream, keys_file=keys_file, max_delayed=MAX_DELAYED,
            plain_burst=TIER_BURST["plain"], gold_burst=TIER_BURST["gold"], silver_burst=TIER_BURST["silver"],
            shaped_burst=SHAPED_BURST, shaped_max_delay_ms=int(SHAPED_MAX_DELAY * 1000), quota=QUOTA, reset=reset,
            pair_client=PAIR_CLIENT_BURST, pair_global=PAIR_GLOBAL_BURST, endpoint_burst=ENDPOINT_BURST,
            hot_burst=HOT_BURST, lease=LEASE,
        )
        gateways = stack.enter_context(gateway_fleet(config, GATEWAYS))
        yield Fleet(redis, gateways, arrivals)


async def flood(
    fleet: Fleet, requests: list[tuple[str, str]], *, first: tuple[str, str] | None = None,
    denied_at: list[float] | None = None,
) -> list[tuple[int, str, str, int]]:
    """Every (path, API key) sent at once, the n-th to gateway n mod 4, on a connection of
    its own; (gateway, path, key, status) of each answer. With `first`, the connections are
    opened beforehand (on an unlimited route) and `first` is answered by gateway 0 just
    before the flood, so the flood follows it within a few milliseconds. `denied_at` gets
    the monotonic time of each 429."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

        async def one(n: int, path: str, key: str) -> tuple[int, str, str, int]:
            g = n % GATEWAYS
            async with http.get(fleet.gateways[g].url + path, headers={"X-API-Key": key}) as response:
                await response.read()
                if denied_at is not None and response.status == 429:
                    denied_at.append(time.monotonic())
                return g, path, key, response.status

        if first is not None:
            await asyncio.gather(*(one(n, "/free", "warm-up") for n in range(len(requests))))
            assert (await one(0, *first))[3] == 200
            denied_at is None or denied_at.append(time.monotonic())
        return await asyncio.gather(*(one(n, path, key) for n, (path, key) in enumerate(requests)))


def spread(specs: list[tuple[str, str]], each: int) -> list[tuple[str, str]]:
    """`each` requests of every spec, in a fixed shuffled order: each spec reaches every gateway."""
    requests = [spec for spec in specs for _ in range(each)]
    random.Random(7).shuffle(requests)
    return requests


async def decisions(fleet: Fleet) -> list[dict[tuple[str, str], float]]:
    """Each gateway's settled decisions; none of any limit failed open."""
    async with aiohttp.ClientSession() as http:
        counts = [await settled_decisions(http, gateway.admin_url) for gateway in fleet.gateways]
    failed_open = {limit: n for c in counts for (limit, decision), n in c.items() if decision == "fail_open" and n}
    assert not failed_open, f"checks failed open: {failed_open}"
    return counts


def total(counts: list[dict[tuple[str, str], float]], limit: str, decision: str) -> float:
    return sum(c[limit, decision] for c in counts)


def passed(answers: list[tuple[int, str, str, int]]) -> collections.Counter:
    return collections.Counter((path, key) for _, path, key, status in answers if status == 200)


async def test_each_tier_gets_exactly_its_burst_across_the_fleet(fleet):
    clients = {key: tier for tier, keys in (("gold", GOLD), ("silver", SILVER), ("plain", PLAIN)) for key in keys}
    answers = await flood(fleet, spread([("/tiers", key) for key in clients], 80))
    counts = await decisions(fleet)
    print(f"\ntiers: {len(answers)} requests, {collections.Counter(s for *_, s in answers)}")
    assert {s for *_, s in answers} == {200, 429}
    assert passed(answers) == {("/tiers", key): TIER_BURST[tier] for key, tier in clients.items()}
    assert {k: n for k, n in fleet.arrivals.items() if k[0] == "/tiers"} == passed(answers)
    assert total(counts, "tiered", "allow") == sum(TIER_BURST[tier] for tier in clients.values())


async def test_delay_admits_exactly_burst_and_the_debt_and_rejects_the_rest(fleet):
    started = time.monotonic()
    answers = await flood(fleet, [("/shaped", "shaper")] * 1000)
    counts = await decisions(fleet)
    admitted = SHAPED_BURST + int(SHAPED_MAX_DELAY * SHAPED_RATE)  # 3 + floor(4.5)
    delayed = [c["shaped", "delayed"] for c in counts]
    print(f"\nshaped: {collections.Counter(s for *_, s in answers)}, delayed per gateway {delayed}, "
          f"{time.monotonic() - started:.2f} s")
    assert collections.Counter(s for *_, s in answers) == {200: admitted, 429: 1000 - admitted}
    assert fleet.arrivals["/shaped", "shaper"] == admitted
    assert sum(delayed) == admitted - SHAPED_BURST
    assert all(d <= MAX_DELAYED for d in delayed), delayed


async def test_past_its_max_delayed_each_gateway_rejects_instead_of_delaying(fleet):
    """A debt of 120 tokens, far more than the fleet's 4 × 3 waiting slots: with the burst
    spent first, each gateway delays exactly 3 requests and rejects the rest, charging nothing.
    Exact only while the flood is decided before the first wait ends (0.5 s after the burst
    was spent): a released slot may then take another request, as it should. So the flood is
    300 requests, 75 a gateway, far past the 3 slots each, decided in a fraction of 0.5 s
    (1000 took 120-330 ms on a loaded 2-core machine)."""
    started = time.monotonic()
    denied_at: list[float] = []
    answers = await flood(fleet, [("/capped", "capped")] * 300, first=("/capped", "capped"), denied_at=denied_at)
    counts = await decisions(fleet)
    delayed = [c["shaped_capped", "delayed"] for c in counts]
    by_gateway = collections.Counter(g for g, *_, status in answers if status == 200)
    print(f"\ncapped: {collections.Counter(s for *_, s in answers)}, delayed per gateway {delayed}, "
          f"last 429 {1000 * (max(denied_at) - denied_at[0]):.0f} ms after the burst was spent, {time.monotonic() - started:.2f} s")
    assert delayed == [MAX_DELAYED] * GATEWAYS
    assert by_gateway == {g: MAX_DELAYED for g in range(GATEWAYS)}
    assert fleet.arrivals["/capped", "capped"] == 1 + GATEWAYS * MAX_DELAYED


async def test_a_quota_admits_exactly_its_limit_across_the_fleet(fleet):
    answers = await flood(fleet, [("/quota", "billed")] * 1000)
    counts = await decisions(fleet)
    assert collections.Counter(s for *_, s in answers) == {200: QUOTA, 429: 1000 - QUOTA}
    assert fleet.arrivals["/quota", "billed"] == QUOTA
    assert total(counts, "daily", "allow") == QUOTA


async def test_two_limits_on_a_route_are_all_or_nothing_across_the_fleet(fleet):
    """20 clients with 5 each, behind one global bucket of 40: exactly 40 pass, and each
    client's own bucket was charged only for its requests that passed, which shows when
    each then gets exactly the rest of its 5 on a route with its bucket alone."""
    clients = [f"pair-{i}" for i in range(20)]
    answers = await flood(fleet, spread([("/pair", key) for key in clients], 40))
    got = passed(answers)
    rest = await flood(fleet, spread([("/solo", key) for key in clients], 8))
    counts = await decisions(fleet)
    print(f"\npair: {sum(got.values())} passed of {len(answers)}, per client {sorted(got.values())}")
    assert sum(got.values()) == PAIR_GLOBAL_BURST
    assert all(got["/pair", key] <= PAIR_CLIENT_BURST for key in clients)
    assert passed(rest) == {("/solo", key): PAIR_CLIENT_BURST - got["/pair", key] for key in clients
                            if got["/pair", key] < PAIR_CLIENT_BURST}
    assert total(counts, "everyone", "allow") == PAIR_GLOBAL_BURST
    assert total(counts, "per_client", "allow") == len(clients) * PAIR_CLIENT_BURST


async def test_composite_keys_give_each_key_and_path_exactly_its_burst(fleet):
    specs = [(path, f"composite-{i}") for i in range(6) for path in ("/a", "/b", "/c")]
    answers = await flood(fleet, spread(specs, 50))
    counts = await decisions(fleet)
    assert passed(answers) == {spec: ENDPOINT_BURST for spec in specs}
    assert total(counts, "per_endpoint", "allow") == len(specs) * ENDPOINT_BURST


async def test_leases_on_a_global_key_never_admit_more_than_the_burst(fleet):
    answers = await flood(fleet, [("/hot", f"anyone-{n}") for n in range(1000)])
    counts = await decisions(fleet)
    admitted = sum(1 for *_, s in answers if s == 200)
    arrived = sum(n for (path, _), n in fleet.arrivals.items() if path == "/hot")
    print(f"\nhot: {admitted} of 1000 admitted against a burst of {HOT_BURST}, lease {LEASE} × {GATEWAYS} processes")
    assert {s for *_, s in answers} == {200, 429}
    assert arrived == admitted == total(counts, "hot", "allow")
    assert HOT_BURST - LEASE * GATEWAYS <= admitted <= HOT_BURST
