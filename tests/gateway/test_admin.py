"""The admin listener: /metrics in the Prometheus text format, /healthz and
/readyz. Metrics count by route, method and status class and never carry a
client identity in a label; none of these paths is served on the public listener."""

from __future__ import annotations

import asyncio
import json

import pytest

from gateway import __version__
from gateway.identity.methods import KNOWN_METHODS
from gateway.metrics import UNMATCHED_ROUTE
from gateway.testing import running_gateway
from tests.processes import RedisServer, eventually
from tests.scrape import scrape, until_in_flight, value

POLL_DEADLINE = 10.0

# Things a client chose; none may ever appear in /metrics.
API_KEY = "sekrit-key-4f1b9"
FORGED_IP = "198.51.100.77"
DISTINCT_PATH = "/api/users/distinctive-path-8c2e"
QUERY_TOKEN = "qtok-3a7d"
UNMATCHED_PATH = "/nowhere-zz91"


def admin_config(upstream: str) -> str:
    return f"""
limits:
  per_key: {{rate: 1/hour, burst: 2, key: [header:X-Api-Key, ip]}}
routes:
  - match: {{path: /api}}
    upstream: {upstream}
    limits: [per_key]
  - match: {{path: /sink, methods: [POST]}}
    upstream: {upstream}
"""


async def test_metrics_count_requests_decisions_and_latencies_by_route(upstream, client):
    async with running_gateway(admin_config(upstream)) as gw:
        spoof = {"X-Api-Key": API_KEY, "X-Forwarded-For": FORGED_IP, "User-Agent": "agent-zq77"}
        for expected in (200, 200, 429):
            async with client.get(gw.url + f"{DISTINCT_PATH}?token={QUERY_TOKEN}", headers=spoof) as response:
                assert response.status == expected
        async with client.request("PURGE", gw.url + "/api/cache") as response:
            assert response.status == 200
        async with client.get(gw.url + UNMATCHED_PATH) as response:
            assert response.status == 404
        text, samples = await scrape(client, gw.admin_url)

    requests = "gateway_requests_total"
    assert value(samples, requests, route="/api", method="GET", status_class="2xx") == 2
    assert value(samples, requests, route="/api", method="GET", status_class="4xx") == 1
    assert value(samples, requests, route="/api", method="OTHER", status_class="2xx") == 1
    assert value(samples, requests, route=UNMATCHED_ROUTE, method="GET", status_class="4xx") == 1
    decisions = "gateway_limiter_decisions_total"
    assert value(samples, decisions, route="/api", limit="per_key", decision="allow") == 3
    assert value(samples, decisions, route="/api", limit="per_key", decision="deny") == 1
    assert value(samples, "gateway_limiter_latency_seconds_count") == 4
    assert value(samples, "gateway_limiter_latency_seconds_bucket", le="+Inf") == 4
    assert value(samples, "gateway_upstream_latency_seconds_count", route="/api") == 3
    assert value(samples, "gateway_upstream_latency_seconds_sum", route="/api") > 0
    assert value(samples, "gateway_requests_in_flight") == 0
    assert value(samples, "gateway_build_info", version=__version__) == 1

    for chosen_by_client in (API_KEY, FORGED_IP, "distinctive", QUERY_TOKEN, "nowhere", "PURGE", "/api/cache", "zq77"):
        assert chosen_by_client not in text
    for sample in samples:
        assert sample.labels.get("route", "/api") in ("/api", "/sink POST", UNMATCHED_ROUTE)
        assert sample.labels.get("method", "GET") in KNOWN_METHODS | {"OTHER"}


async def test_limiter_latency_times_each_request_that_had_limits_decided_once(upstream, client):
    """A concurrency limit's admission is a store call too: a route with only concurrency limits
    is timed, and a route with both kinds is one observation a request, not two."""
    yaml = f"""
limits:
  per_ip: {{rate: 100/second, burst: 100}}
  conns: {{concurrency: 10}}
routes:
  - match: {{path: /conns}}
    upstream: {upstream}
    limits: [conns]
  - match: {{path: /both}}
    upstream: {upstream}
    limits: [per_ip, conns]
  - match: {{path: /}}
    upstream: {upstream}
"""
    async with running_gateway(yaml) as gw:
        for path in ("/conns", "/conns", "/conns", "/both", "/both", "/free"):
            async with client.get(gw.url + path) as response:
                assert response.status == 200
        samples = (await scrape(client, gw.admin_url))[1]
    assert value(samples, "gateway_limiter_latency_seconds_count") == 5
    assert value(samples, "gateway_limiter_latency_seconds_bucket", le="+Inf") == 5


async def test_a_method_outside_the_known_set_is_labelled_other(upstream, client):
    async with running_gateway(admin_config(upstream)) as gw:
        for method in ("PROPFIND", "MKCOL", "BREW"):
            async with client.request(method, gw.url + "/api/x", headers={"X-Api-Key": method}) as response:
                # The HTTP parser may refuse a method it has never heard of before the gateway sees it.
                assert response.status == 200 or (method == "BREW" and response.status == 400)
        text, samples = await scrape(client, gw.admin_url)
    methods = {s.labels["method"] for s in samples if s.name == "gateway_requests_total"}
    assert methods == {"OTHER"}
    assert value(samples, "gateway_requests_total", route="/api", method="OTHER", status_class="2xx") == 2
    for method in ("PROPFIND", "MKCOL", "BREW"):
        assert method not in text


async def test_requests_in_flight_counts_a_request_until_it_finishes(upstream, client):
    release = asyncio.Event()

    async def held_body():
        yield b"first part"
        await release.wait()
        yield b", last part"

    async with running_gateway(admin_config(upstream)) as gw:

        async def upload() -> dict:
            async with client.post(gw.url + "/sink", data=held_body()) as response:
                return await response.json()

        task = asyncio.ensure_future(upload())
        try:
            await until_in_flight(client, gw.admin_url, deadline=POLL_DEADLINE)
        finally:
            release.set()
        assert await task == {"received": len(b"first part, last part")}
        _, samples = await scrape(client, gw.admin_url)
        assert value(samples, "gateway_requests_in_flight") == 0
        assert value(samples, "gateway_requests_total", route="/sink POST", method="POST", status_class="2xx") == 1


async def test_healthz_and_readyz_answer_with_the_in_process_store(upstream, client):
    async with running_gateway(admin_config(upstream)) as gw:
        async with client.get(gw.admin_url + "/healthz") as response:
            assert response.status == 200
            assert (await response.json())["status"] == "alive"
        async with client.get(gw.admin_url + "/readyz") as response:
            assert response.status == 200
            body = await response.json()
    assert body["ready"] is True
    assert body["store"] == "in-process"


async def test_readyz_answers_once_the_store_is_reachable(upstream, client):
    redis_server = RedisServer()  # its port is chosen now; nothing listens there yet
    config = f"""
store: {{url: "{redis_server.url}", timeout: 500ms}}
limits:
  strict: {{rate: 10/second, on_store_error: closed}}
routes:
  - match: {{path: /}}
    upstream: {upstream}
    limits: [strict]
"""
    try:
        async with running_gateway(config) as gw:
            async with client.get(gw.admin_url + "/readyz") as response:
                assert response.status == 503
                body = await response.json()
                assert body["ready"] is False and body["store_state"] == "unreachable"
            async with client.get(gw.admin_url + "/healthz") as response:
                assert response.status == 200  # alive, though not ready
            redis_server.start()

            async def ready() -> bool:
                async with client.get(gw.admin_url + "/readyz") as response:
                    return response.status == 200 and (await response.json())["ready"] is True

            await eventually(ready, what="/readyz to answer 200 once redis-server is up", deadline=POLL_DEADLINE)
            async with client.get(gw.url + "/echo") as response:
                assert response.status == 200
    finally:
        redis_server.__exit__(None, None, None)


@pytest.mark.parametrize("path", ["/metrics", "/healthz", "/readyz"])
async def test_admin_paths_are_proxied_not_served_on_the_public_listener(upstream, client, path):
    config = f"""
routes:
  - match: {{path: /}}
    upstream: {upstream}
"""
    async with running_gateway(config) as gw:
        async with client.get(gw.url + path) as response:
            assert response.status == 200
            echo = await response.json()  # the upstream's echo, not the gateway's own answer
    assert echo["path"] == path


@pytest.mark.parametrize("path", ["/metrics", "/healthz", "/readyz"])
async def test_admin_paths_without_a_public_route_are_404(upstream, client, path):
    async with running_gateway(admin_config(upstream)) as gw:
        async with client.get(gw.url + path) as response:
            assert response.status == 404
            assert response.headers["Content-Type"].split(";")[0] == "application/problem+json"
            body = await response.read()
    assert b"gateway_requests" not in body
    assert json.loads(body)["status"] == 404


async def test_the_admin_listener_proxies_nothing(upstream, client):
    async with running_gateway(admin_config(upstream)) as gw:
        async with client.get(gw.admin_url + "/api/echo") as response:
            assert response.status == 404
        _, samples = await scrape(client, gw.admin_url)
    assert not [s for s in samples if s.name == "gateway_requests_total"]
