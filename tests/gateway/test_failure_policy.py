"""Each limit's on_store_error, with a real Redis taken away: `open` allows,
`closed` answers 503 problem+json with Retry-After: 1, `local` decides with an
in-process bucket holding this gateway's share (burst and rate divided by
store.local_divisor). Each decision shows in /metrics, failures are logged at
most once a second, and /readyz reports the store's state."""

from __future__ import annotations

import json
import logging
import time

import aiohttp

from gateway.config import load_config
from gateway.limiter.circuit_breaker import BreakerState
from gateway.testing import running_gateway
from tests.processes import eventually
from tests.scrape import decisions


def gateway_yaml(store_url: str, upstream: str, *, local_divisor: int = 1, with_closed: bool = True) -> str:
    closed_limit = """
  strict:
    rate: 1/day
    burst: 10
    key: header:X-API-Key
    on_store_error: closed
""" if with_closed else ""
    closed_routes = f"""
  - match: {{path: /closed}}
    upstream: {upstream}
    limits: [strict]
  - match: {{path: /mixed}}
    upstream: {upstream}
    limits: [fair, strict, nearby]
""" if with_closed else ""
    return f"""
store:
  url: {store_url}
  timeout: 50ms
  local_divisor: {local_divisor}
limits:
  fair:
    rate: 1/day
    burst: 10
    key: header:X-API-Key
    on_store_error: open
  nearby:
    rate: 1/day
    burst: 10
    key: header:X-API-Key
    on_store_error: local
{closed_limit}
routes:
  - match: {{path: /open}}
    upstream: {upstream}
    limits: [fair]
  - match: {{path: /local}}
    upstream: {upstream}
    limits: [nearby]
{closed_routes}
"""


async def get(http: aiohttp.ClientSession, url: str, key: str = "k") -> tuple[aiohttp.ClientResponse, bytes]:
    async with http.get(url, headers={"X-API-Key": key}) as response:
        return response, await response.read()


async def test_open_limit_allows_while_the_store_is_down(redis_server, upstream):
    async with running_gateway(gateway_yaml(redis_server.url, upstream)) as gw, aiohttp.ClientSession() as http:
        redis_server.stop()
        for _ in range(15):  # more than the burst: nothing is counted while the store is down
            response, _ = await get(http, gw.url + "/open")
            assert response.status == 200
            assert "RateLimit" not in response.headers
        assert (await decisions(http, gw.admin_url))["fair", "fail_open"] == 15


async def test_closed_limit_answers_503_problem_json_with_retry_after_1(redis_server, upstream):
    async with running_gateway(gateway_yaml(redis_server.url, upstream)) as gw, aiohttp.ClientSession() as http:
        response, _ = await get(http, gw.url + "/closed")
        assert response.status == 200
        redis_server.stop()
        response, body = await get(http, gw.url + "/closed")
        assert response.status == 503
        assert response.content_type == "application/problem+json"
        assert response.headers["Retry-After"] == "1"
        problem = json.loads(body)
        assert problem["status"] == 503 and problem["violated-policies"] == ["strict"]
        assert problem["type"] == "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity"
        # One fail-closed limit decides for the whole request, whatever the others' policies.
        response, _ = await get(http, gw.url + "/mixed")
        assert response.status == 503
        assert response.headers["Retry-After"] == "1"
        counts = await decisions(http, gw.admin_url)
        assert counts["strict", "fail_closed"] == 2
        assert (counts["fair", "fail_open"], counts["nearby", "fail_local"]) == (1, 1)


async def test_local_limit_passes_the_burst_divided_by_local_divisor(redis_server, upstream):
    config = gateway_yaml(redis_server.url, upstream, local_divisor=2)
    async with running_gateway(config) as gw, aiohttp.ClientSession() as http:
        redis_server.stop()
        for client in ("alice", "bob"):  # each client has its own local bucket
            statuses = [(await get(http, gw.url + "/local", key=client))[0] for _ in range(12)]
            assert [r.status for r in statuses] == [200] * 5 + [429] * 7
            # The local share refills at half of 1/day: one token takes two days.
            assert statuses[-1].headers["Retry-After"] == "172800"
        assert (await decisions(http, gw.admin_url))["nearby", "fail_local"] == 24


async def test_local_limit_with_divisor_1_is_the_global_limit(redis_server, upstream):
    config = gateway_yaml(redis_server.url, upstream, local_divisor=1)
    async with running_gateway(config) as gw, aiohttp.ClientSession() as http:
        redis_server.stop()
        statuses = [(await get(http, gw.url + "/local"))[0].status for _ in range(12)]
        assert statuses == [200] * 10 + [429] * 2


async def test_a_reload_that_changes_a_local_limit_changes_its_local_share(redis_server, upstream, tmp_path):
    """Reproduction: the local share was kept by limit name, so after a reload raised the
    burst from 10 to 16 a new client still got 10 while Redis was down."""
    path = tmp_path / "gateway.yaml"
    path.write_text(gateway_yaml(redis_server.url, upstream))
    async with running_gateway(load_config(str(path))) as gw, aiohttp.ClientSession() as http:
        redis_server.stop()
        statuses = [(await get(http, gw.url + "/local", key="before"))[0].status for _ in range(11)]
        assert statuses == [200] * 10 + [429]
        path.write_text(gateway_yaml(redis_server.url, upstream).replace("burst: 10\n    key: header:X-API-Key\n    on_store_error: local", "burst: 16\n    key: header:X-API-Key\n    on_store_error: local"))
        assert gw.gateway.reload()
        responses = [(await get(http, gw.url + "/local", key="after"))[0] for _ in range(17)]
        assert [r.status for r in responses] == [200] * 16 + [429]
        assert responses[-1].headers["RateLimit-Policy"] == '"nearby";q=16;w=1382400'


async def test_local_limit_burst_is_never_below_the_routes_cost(redis_server, upstream):
    """burst 10 over local_divisor 8 leaves 1.25 tokens; a route costing 5 must still pass
    once per local bucket, rather than never."""
    config = gateway_yaml(redis_server.url, upstream, local_divisor=8).replace(
        "routes:\n", f"routes:\n  - match: {{path: /heavy}}\n    upstream: {upstream}\n    limits: [{{name: nearby, cost: 5}}]\n", 1
    )
    async with running_gateway(config) as gw, aiohttp.ClientSession() as http:
        redis_server.stop()
        statuses = [(await get(http, gw.url + "/heavy"))[0].status for _ in range(3)]
        assert statuses == [200, 429, 429]


async def test_metrics_show_each_decision_kind_once_it_happened(redis_server, upstream):
    async with running_gateway(gateway_yaml(redis_server.url, upstream)) as gw, aiohttp.ClientSession() as http:

        async def kinds() -> set[str]:
            return {decision for (_, decision), value in (await decisions(http, gw.admin_url)).items() if value}

        assert await kinds() == set()
        for _ in range(10):
            await get(http, gw.url + "/open")
        assert await kinds() == {"allow"}
        assert (await get(http, gw.url + "/open"))[0].status == 429
        assert await kinds() == {"allow", "deny"}
        redis_server.stop()
        # Another client: the denied one is answered from the denial cache, without the store.
        await get(http, gw.url + "/open", key="other")
        assert await kinds() == {"allow", "deny", "fail_open"}
        await get(http, gw.url + "/closed")
        assert await kinds() == {"allow", "deny", "fail_open", "fail_closed"}
        await get(http, gw.url + "/local")
        assert await kinds() == {"allow", "deny", "fail_open", "fail_closed", "fail_local"}


async def test_store_failures_are_logged_at_most_once_a_second(redis_server, upstream, caplog):
    caplog.set_level(logging.WARNING, logger="gateway.limiter.limiter")
    async with running_gateway(gateway_yaml(redis_server.url, upstream)) as gw, aiohttp.ClientSession() as http:
        redis_server.stop()
        started = time.monotonic()
        failed = 0
        while time.monotonic() - started < 1.2:
            response, _ = await get(http, gw.url + "/open")
            assert response.status == 200
            failed += 1
        elapsed = time.monotonic() - started
    lines = [r for r in caplog.records if r.name == "gateway.limiter.limiter"]
    assert failed > 20, "too few requests to show the rate of logging"
    # One line at the first failure, then at most one more per second.
    assert 2 <= len(lines) <= 1 + int(elapsed)
    assert "fair=open" in lines[0].getMessage()


async def test_readyz_reports_the_store_state(redis_server, upstream):
    async with running_gateway(gateway_yaml(redis_server.url, upstream)) as gw, aiohttp.ClientSession() as http:
        async with http.get(gw.admin_url + "/readyz") as response:
            assert response.status == 200
            assert (await response.json())["store_state"] == "ok"
        redis_server.stop()
        async with http.get(gw.admin_url + "/readyz") as response:
            body = await response.json()
            # A fail-closed limit would reject everything: not ready.
            assert response.status == 503
            assert (body["ready"], body["store_state"]) == (False, "unreachable")
            assert body["detail"]
        redis_server.start()
        async with http.get(gw.admin_url + "/readyz") as response:
            body = await response.json()
            assert response.status == 200, body
            assert body["store_state"] == "ok"


async def test_readyz_stays_ready_when_every_limit_can_serve_without_the_store(redis_server, upstream):
    config = gateway_yaml(redis_server.url, upstream, with_closed=False)
    async with running_gateway(config) as gw, aiohttp.ClientSession() as http:
        redis_server.stop()
        async with http.get(gw.admin_url + "/readyz") as response:
            body = await response.json()
            assert response.status == 200
            assert (body["ready"], body["store_state"]) == (True, "unreachable")


async def test_the_local_stand_in_drops_its_full_buckets_once_the_store_answers_again(redis_server, upstream):
    """Reproduction: the in-process buckets of `on_store_error: local` were dropped only by
    checks of the stand-in itself, which stop when the store answers again, so every client
    of an outage's last refill period stayed in memory until the next outage (198 of 15,000
    flooding clients at 5/second; at 100/hour, every client of the outage's last hour)."""
    config = gateway_yaml(redis_server.url, upstream, with_closed=False).replace(
        "rate: 1/day\n    burst: 10\n    key: header:X-API-Key\n    on_store_error: local",
        "rate: 1/second\n    burst: 2\n    key: header:X-API-Key\n    on_store_error: local",
    )
    async with running_gateway(config) as gw, aiohttp.ClientSession() as http:
        limiter = gw.gateway.limiter
        stand_in = limiter._local_store._buckets  # its len() would drop the full ones itself
        redis_server.stop()
        for i in range(200):
            response, _ = await get(http, gw.url + "/local", key=f"flood-{i}")
            assert response.status == 200
        assert len(stand_in) == 200
        redis_server.start()

        async def breaker_closed() -> bool:
            await get(http, gw.url + "/local", key="after")
            return limiter.breaker.state is BreakerState.CLOSED

        await eventually(breaker_closed, what="the store to decide again")
        assert stand_in, "the stand-in's buckets filled before the store decided again"

        async def stand_in_empty() -> bool:
            await get(http, gw.url + "/local", key="after")
            return not stand_in

        await eventually(stand_in_empty, what="the full stand-in buckets to be dropped")
