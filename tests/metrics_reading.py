"""Reading a gateway's /metrics in tests, as Prometheus would."""

from __future__ import annotations

import collections

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tests.processes import eventually


async def decisions(http: aiohttp.ClientSession, admin_url: str) -> dict[tuple[str, str], float]:
    """gateway_limiter_decisions_total by (limit, decision), from /metrics."""
    async with http.get(admin_url + "/metrics") as response:
        text = await response.text()
    counts: dict[tuple[str, str], float] = collections.defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "gateway_limiter_decisions_total":
                counts[sample.labels["limit"], sample.labels["decision"]] += sample.value
    return counts


async def settled_decisions(http: aiohttp.ClientSession, admin_url: str) -> dict[tuple[str, str], float]:
    """`decisions` once no request is in flight: a load generator that stopped leaves
    requests still being answered, and each is counted only when it is decided."""

    async def idle() -> bool:
        async with http.get(admin_url + "/metrics") as response:
            text = await response.text()
        return any(
            sample.name == "gateway_requests_in_flight" and sample.value == 0
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        )

    await eventually(idle, what="the gateway to finish the requests in flight")
    return await decisions(http, admin_url)
