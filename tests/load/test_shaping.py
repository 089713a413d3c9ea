"""Shaping instead of rejecting (`mode: delay`), end to end: the gateway started as
users start it, a real upstream that notes when each request arrives, and Redis
(a dedicated redis-server, at the default 10 ms store.timeout, failing open) or
the in-process store.

At 2/s, burst 1, max_delay 2.5 s, 30 concurrent requests of one client: exactly
one goes at once, five wait about 0.5, 1, ... 2.5 s, in that order, and the
other 24 get 429. A token takes 500 ms to refill, far longer than a loaded
machine takes to send the 30 (up to about 150 ms seen in CI), so no token refills
while they arrive and the counts are exact. Upstream arrivals never outrun the bucket: any run of them from
a_i to a_j holds at most burst + rate × (a_j - a_i + JITTER), where JITTER covers
what the proxy adds between a request's release and its arrival. With
`max_delayed: 2`, at most two requests wait.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import time

import aiohttp
import pytest
from aiohttp import web

from tests.processes import GatewayProcess, RedisServer, store_block_for
from tests.scrape import scrape, settled_decisions, value
from tests.upstream import serving

pytestmark = pytest.mark.timing  # measures time, load or memory: one such module runs at a time

RATE, BURST, MAX_DELAY = 2.0, 1, 2.5
STEP_MS = 1000 / RATE  # a token's refill: the spacing of the waits
CONCURRENT = 30
# From a request's release to its arrival upstream: one hop on loopback, on a shared
# 2-core machine. A release 50 ms early would show as a wait short by half a token.
JITTER = 0.05

SHAPED_LIMIT = """  shaped:
    rate: 2/second
    burst: 1
    mode: delay
    max_delay: 2500ms
    key: header:X-API-Key
    on_store_error: open
"""


def shaping_config(
    upstream: str, *, store: str = "", extra: str = "", shaped: str = "", before: str = "", after: str = ""
) -> str:
    """One route limited by `shaped` (2/second, burst 1, waits up to 2.5 s; `shaped` adds
    lines to it), with the limits `before` and `after` it (YAML lines under `limits:`, each
    `  NAME: {...}`) on the route in that order."""
    names = [line.split(":")[0].strip() for line in (before + after).splitlines()]
    route = ", ".join([*names[: before.count("\n")], "shaped", *names[before.count("\n") :]])
    return (
        f"listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\n{store}\n{extra}\nlimits:\n{before}{SHAPED_LIMIT}{shaped}{after}"
        f"routes:\n  - match: {{path: /}}\n    upstream: {upstream}\n    limits: [{route}]\n"
    )



@contextlib.asynccontextmanager
async def arrivals_upstream():
    """An upstream that answers 200 and notes the monotonic time each request arrived."""
    arrived: list[float] = []

    async def handler(request: web.BaseRequest) -> web.Response:
        arrived.append(time.monotonic())
        return web.Response(text="ok")

    async with serving(handler) as url:
        yield url, arrived


async def flood(http: aiohttp.ClientSession, url: str, arrived: list[float]) -> tuple[list[int], list[str | None], float]:
    """CONCURRENT requests of one client at once, after one of another client that opens
    the gateway's connection to the upstream (a first connection costs milliseconds the
    measured arrivals should not hold); the statuses, Retry-After values, and the monotonic
    time the flood was sent. No wait can have begun before then, so each request's arrival
    after it bounds its wait from above, whatever the load: the first request's own arrival
    does not, as a loaded gateway may forward it well after the waits began (159 ms seen)."""
    async with http.get(url + "/warm-up", headers={"X-API-Key": "another-client"}) as response:
        assert response.status == 200
    arrived.clear()

    async def one() -> tuple[int, str | None]:
        async with http.get(url + "/shaped", headers={"X-API-Key": "one-client"}) as response:
            await response.read()
            return response.status, response.headers.get("Retry-After")

    sent = time.monotonic()
    answers = await asyncio.gather(*(one() for _ in range(CONCURRENT)))
    return [status for status, _ in answers], [retry for _, retry in answers], sent


def assert_waited_their_turn(delays: list[int]) -> None:
    """The k-th request to arrive upstream (ms after the flood was sent) waited k refills:
    never released early (the bucket was first charged after the flood was sent), and not
    a whole refill late either. Only the lower bound is exact; the upper one leaves a shared
    machine's scheduler a refill, and still fails a wait counted twice or a turn skipped."""
    for k, delay in enumerate(delays):
        assert k * STEP_MS - 1000 * JITTER <= delay < (k + 1) * STEP_MS, delays


@pytest.mark.parametrize("store_kind", ["redis", "in-process"])
async def test_a_flood_is_shaped_one_at_once_five_waiting_in_order_the_rest_rejected(store_kind):
    async with arrivals_upstream() as (upstream, arrived):
        with store_block_for(store_kind) as store_block, GatewayProcess(
            shaping_config(upstream, store=store_block)
        ) as gateway:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
                statuses, retries, sent = await flood(http, gateway.url, arrived)
                counts = await settled_decisions(http, gateway.admin_url)
                _, samples = await scrape(http, gateway.admin_url)

    delays = [round((t - sent) * 1000) for t in arrived]
    print(f"{store_kind}: statuses {collections.Counter(statuses)}, arrivals after the flood was sent (ms): {delays}")
    assert collections.Counter(statuses) == {200: 1 + 5, 429: CONCURRENT - 6}
    assert set(retries) - {None} == {"1"}
    assert len(arrived) == 6 and arrived == sorted(arrived)
    assert_waited_their_turn(delays)
    # The five waiting requests were told their waits in one script call each, at once:
    # they are released a token's refill apart (half a refill of slack above, for the
    # scheduler; a spacing of two refills still fails). The first request is not one of
    # them: a loaded gateway may forward it late, shortening the gap after it.
    for earlier, later in itertools.pairwise(delays[1:]):
        assert STEP_MS - 1000 * JITTER <= later - earlier < 1.5 * STEP_MS, delays
    # Never more than the bucket allows in any span between the waiting requests' releases.
    for i in range(1, len(arrived)):
        for j in range(i, len(arrived)):
            assert j - i + 1 <= BURST + RATE * (arrived[j] - arrived[i] + JITTER), (i, j, delays)
    assert (counts["shaped", "allow"], counts["shaped", "delayed"], counts["shaped", "deny"]) == (1 + 1, 5, 24)
    assert counts["shaped", "fail_open"] == 0
    assert value(samples, "gateway_limiter_delay_seconds_count") == 5
    # 1 + 2 + ... + 5 refills, less the refill between the first check and the others';
    # above, each of the five may be a refill late on a loaded machine, not more.
    step = 1 / RATE
    assert 15 * step - 5 * step < value(samples, "gateway_limiter_delay_seconds_sum") < 15 * step + 5 * step


async def test_past_max_delayed_waiting_requests_a_worker_rejects_instead():
    """`max_delayed: 2`: two requests wait, the third that would have waited is
    rejected with 429 and charges nothing, so the fourth does not wait longer."""
    async with arrivals_upstream() as (upstream, arrived):
        with GatewayProcess(shaping_config(upstream, extra="max_delayed: 2")) as gateway:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
                statuses, _, sent = await flood(http, gateway.url, arrived)
                counts = await settled_decisions(http, gateway.admin_url)
    delays = [round((t - sent) * 1000) for t in arrived]
    assert collections.Counter(statuses) == {200: 1 + 2, 429: CONCURRENT - 3}, delays
    assert (counts["shaped", "allow"], counts["shaped", "delayed"], counts["shaped", "deny"]) == (1 + 1, 2, 27)
    assert len(delays) == 3
    assert_waited_their_turn(delays)


async def test_a_leased_limit_on_the_route_does_not_cut_a_shaped_wait_short():
    """A leased limit (`lease: N`) beside a shaping one: the leased limit allows from its
    lease, the shaping one is charged into debt and tells the request to wait, and the
    request waits, as it would without the lease."""
    async with arrivals_upstream() as (upstream, arrived):
        with RedisServer(dedicated=True) as server, GatewayProcess(
            shaping_config(
                upstream,
                store=f"store: {{url: '{server.url}'}}",
                before="  hot: {rate: 1000/second, burst: 100, lease: 10, key: global, on_store_error: open}\n",
            )
        ) as gateway:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
                statuses, _, sent = await flood(http, gateway.url, arrived)
                counts = await settled_decisions(http, gateway.admin_url)
    delays = [round((t - sent) * 1000) for t in arrived]
    assert collections.Counter(statuses) == {200: 1 + 5, 429: CONCURRENT - 6}, delays
    assert_waited_their_turn(delays)
    assert (counts["shaped", "allow"], counts["shaped", "delayed"], counts["shaped", "deny"]) == (1 + 1, 5, 24)
    assert counts["hot", "fail_open"] == counts["shaped", "fail_open"] == 0


@pytest.mark.parametrize("store_kind", ["redis", "in-process"])
async def test_a_shaping_limit_that_could_delay_is_not_named_as_denying_beside_one_that_denies(store_kind):
    """A shaping limit in debt that could still delay a request did not deny it: when the
    route's other limit denies, the 429 is that limit's (not the shaping limit's 503), and
    the shaping limit counts as skipped. Both are charged for the three admitted only."""
    async with arrivals_upstream() as (upstream, arrived):
        with store_block_for(store_kind) as store_block, GatewayProcess(
            shaping_config(
                upstream,
                store=store_block,
                shaped="    response: {status: 503}\n",
                after="  strict: {rate: 1/hour, burst: 3, key: header:X-API-Key, on_store_error: open}\n",
            )
        ) as gateway:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
                statuses, _, sent = await flood(http, gateway.url, arrived)
                async with http.get(gateway.url + "/", headers={"X-API-Key": "one-client"}) as response:
                    body = await response.json(content_type=None)
                counts = await settled_decisions(http, gateway.admin_url)
    delays = [round((t - sent) * 1000) for t in arrived]
    assert collections.Counter(statuses) == {200: 3, 429: CONCURRENT - 3}, delays
    assert_waited_their_turn(delays)
    assert "strict" in str(body) and "shaped" not in str(body), body
    assert (counts["shaped", "allow"], counts["shaped", "delayed"], counts["shaped", "deny"]) == (1 + 1, 2, 0)
    assert (counts["strict", "allow"], counts["strict", "deny"]) == (1 + 3, CONCURRENT - 3 + 1)
    assert counts["shaped", "fail_open"] == counts["strict", "fail_open"] == 0
