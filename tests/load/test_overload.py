"""Overload is explicit: past `max_in_flight` requests in one process, a request gets
503 problem+json with Retry-After: 1 at once, without reaching the limiter or the
upstream, and is counted in gateway_requests_shed_total and gateway_requests_total.

The upstream's /held route keeps requests in flight until the test releases them,
and reports how many arrived, so nothing here waits on a clock."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from gateway.testing import running_gateway
from tests.processes import eventually
from tests.scrape import scrape, value

pytestmark = pytest.mark.timing  # measures time, load or memory: one such module runs at a time

CAP = 2
BEYOND = 3


def overload_config(upstream: str) -> str:
    return f"""
max_in_flight: {CAP}
limits:
  everyone: {{rate: 1000/second, burst: 1000}}
routes:
  - match: {{path: /}}
    upstream: {upstream}
    limits: [everyone]
"""


async def fetch(client: aiohttp.ClientSession, method: str, url: str) -> tuple[int, dict[str, str], bytes]:
    async with client.request(method, url) as response:
        return response.status, dict(response.headers), await response.read()


async def arrived(client: aiohttp.ClientSession, upstream: str) -> int:
    return json.loads((await fetch(client, "GET", upstream + "/held/arrived"))[2])["arrived"]


async def test_past_max_in_flight_requests_are_shed_with_503_and_counted(upstream, client):
    async with running_gateway(overload_config(upstream)) as gw:
        admitted = [asyncio.ensure_future(fetch(client, "GET", gw.url + "/held")) for _ in range(CAP)]
        beyond: list[asyncio.Future] = []
        try:

            async def cap_in_flight() -> bool:
                return await arrived(client, upstream) == CAP

            await eventually(cap_in_flight, what=f"{CAP} requests held at the upstream")
            beyond = [asyncio.ensure_future(fetch(client, "GET", gw.url + "/held")) for _ in range(BEYOND)]

            async def settled() -> bool:
                # Answered, or (were the cap not kept) held at the upstream too.
                return all(task.done() for task in beyond) or await arrived(client, upstream) > CAP

            await eventually(settled, what="the requests beyond the cap to be answered")
        finally:
            await fetch(client, "POST", upstream + "/held/release")
        assert await arrived(client, upstream) == CAP  # exactly the cap was proxied
        assert [(status, body) for status, _, body in await asyncio.gather(*admitted)] == [(200, b"held")] * CAP
        for status, headers, body in await asyncio.gather(*beyond):
            assert status == 503
            assert headers["Content-Type"] == "application/problem+json; charset=utf-8"
            assert headers["Retry-After"] == "1"
            problem = json.loads(body)
            assert (problem["status"], problem["title"]) == (503, "Service Unavailable")

        # Once requests finish, there is room again.
        assert (await fetch(client, "GET", gw.url + "/echo/after"))[0] == 200

        _, samples = await scrape(client, gw.admin_url)
    assert value(samples, "gateway_requests_shed_total") == BEYOND
    assert value(samples, "gateway_requests_total", route="/", method="GET", status_class="5xx") == BEYOND
    assert value(samples, "gateway_requests_total", route="/", method="GET", status_class="2xx") == CAP + 1
    # The limiter was asked about the admitted requests only.
    assert value(samples, "gateway_limiter_decisions_total", route="/", limit="everyone", decision="allow") == CAP + 1
    assert value(samples, "gateway_requests_in_flight") == 0
