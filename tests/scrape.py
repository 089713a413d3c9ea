"""Reading a running gateway's /metrics in tests, through the Prometheus text parser."""

from __future__ import annotations

import collections

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.processes import START_DEADLINE, eventually


async def scrape(client: aiohttp.ClientSession, admin_url: str) -> tuple[str, list[Sample]]:
    """The exposition text and every sample in it."""
    async with client.get(admin_url + "/metrics") as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = await response.text()
    samples = [sample for family in text_string_to_metric_families(text) for sample in family.samples]
    return text, samples


def value(samples: list[Sample], name: str, **labels: str) -> float:
    """The one sample called `name` that carries `labels` (and any others)."""
    matching = [s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matching) == 1, f"{name} {labels}: {matching}"
    return matching[0]


async def decisions(client: aiohttp.ClientSession, admin_url: str) -> dict[tuple[str, str], float]:
    """gateway_limiter_decisions_total by (limit, decision)."""
    counts: dict[tuple[str, str], float] = collections.defaultdict(float)
    for sample in (await scrape(client, admin_url))[1]:
        if sample.name == "gateway_limiter_decisions_total":
            counts[sample.labels["limit"], sample.labels["decision"]] += sample.value
    return counts


async def settled_decisions(client: aiohttp.ClientSession, admin_url: str) -> dict[tuple[str, str], float]:
    """`decisions` once no request is in flight: a load generator that stopped leaves
    requests still being answered, and each is counted only when it is decided."""

    await until_in_flight(client, admin_url, 0)
    return await decisions(client, admin_url)


async def until_in_flight(client: aiohttp.ClientSession, admin_url: str, count: int = 1, *, deadline: float = START_DEADLINE) -> None:
    """Waits until gateway_requests_in_flight reads `count`."""

    async def reached() -> bool:
        return value((await scrape(client, admin_url))[1], "gateway_requests_in_flight") == count

    await eventually(reached, what=f"{count} request(s) in flight", deadline=deadline)
