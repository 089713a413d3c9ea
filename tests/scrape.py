"""Reading a running gateway's /metrics in tests, through the Prometheus text parser."""

from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


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
