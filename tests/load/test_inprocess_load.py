"""The in-process store (no `store:`, workers: 1) at the load users put on it: 1000
requests sent at once, each on a connection of its own, against the gateway started
as users start it and a real upstream. Every count is exact:

- a token bucket of burst 25 (1/hour, so nothing refills) admits exactly 25;
- `mode: delay` with burst 1 at 1/s and max_delay 3 s admits the one at once and
  three that wait, the rest are rejected; with `max_delayed: 2`, one and two. A
  token takes 1 s to refill, longer than 1000 requests on open connections take to
  be decided;
- a quota of 40 a day admits exactly 40;
- `concurrency: 7` in front of an upstream that holds every request: exactly 7
  reach it, the rest get 429 while those 7 are held, and never more than 7 are in
  flight there at once;
- tiers from a key file: 1000 requests spread over a gold, a silver and an unlisted
  key admit each tier's burst exactly;
- a global limit (`key: []`) admits its burst over 1000 different clients.
"""

from __future__ import annotations

import asyncio
import collections
from urllib.parse import urlsplit

import aiohttp
import pytest

from tests.processes import GatewayProcess, eventually
from tests.scrape import decisions as decisions_now
from tests.scrape import settled_decisions
from tests.upstream import CountingUpstream, serving

pytestmark = pytest.mark.timing  # measures time, load or memory: one such module runs at a time

FLOOD = 1000
CONNECT_AT_ONCE = 100
HEAD = "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\n"


def config(limits: str, upstream: str, names: str, extra: str = "") -> str:
    return (
        f"{HEAD}{extra}limits:\n{limits}routes:\n  - match: {{path: /}}\n    upstream: {upstream}\n"
        f"    limits: [{names}]\n"
    )


async def flood(url: str, keys: list[str]) -> list[int]:
    """One request per key, each on its own connection, all sent at once: the connections
    are opened first, in groups the listener's accept backlog (128) holds, and only then
    is every request written. Connected as they are sent, 1000 would overflow the backlog,
    and a refused SYN is retried a second later: past a token's refill."""
    parts = urlsplit(url)
    connections: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        for start in range(0, len(keys), CONNECT_AT_ONCE):
            group = keys[start : start + CONNECT_AT_ONCE]
            connections += await asyncio.gather(*(asyncio.open_connection(parts.hostname, parts.port) for _ in group))
        for (_, writer), key in zip(connections, keys):
            writer.write(
                f"GET {parts.path or '/'} HTTP/1.1\r\nHost: gateway\r\nX-API-Key: {key}\r\nConnection: close\r\n\r\n".encode()
            )

        async def status(reader: asyncio.StreamReader) -> int:
            answer = await reader.read()  # to the end: the gateway closes after its answer
            return int(answer.split(b" ", 2)[1])

        return await asyncio.gather(*(status(reader) for reader, _ in connections))
    finally:
        for _, writer in connections:
            writer.close()


async def decisions(admin_url: str) -> collections.Counter:
    async with aiohttp.ClientSession() as http:
        return await settled_decisions(http, admin_url)


async def test_a_burst_of_25_admits_exactly_25_of_1000_at_once(upstream):
    limits = "  flood: {rate: 1/hour, burst: 25, key: header:X-API-Key}\n"
    with GatewayProcess(config(limits, upstream, "flood")) as gateway:
        statuses = collections.Counter(await flood(gateway.url + "/", ["one-client"] * FLOOD))
        counts = await decisions(gateway.admin_url)
    assert statuses == {200: 25, 429: FLOOD - 25}
    assert (counts["flood", "allow"], counts["flood", "deny"]) == (25, FLOOD - 25)


@pytest.mark.parametrize(("max_delayed", "delayed"), [(256, 3), (2, 2)])
async def test_delay_mode_admits_one_at_once_and_max_delay_or_max_delayed_of_1000(upstream, max_delayed, delayed):
    limits = "  shaped: {rate: 1/second, burst: 1, mode: delay, max_delay: 3s, key: header:X-API-Key}\n"
    text = config(limits, upstream, "shaped", f"max_delayed: {max_delayed}\n")
    with GatewayProcess(text) as gateway:
        statuses = collections.Counter(await flood(gateway.url + "/", ["one-client"] * FLOOD))
    assert statuses == {200: 1 + delayed, 429: FLOOD - 1 - delayed}


async def test_a_quota_of_40_admits_exactly_40_of_1000_at_once(upstream):
    limits = "  daily: {quota: {limit: 40, per: day}, key: header:X-API-Key}\n"
    with GatewayProcess(config(limits, upstream, "daily")) as gateway:
        statuses = collections.Counter(await flood(gateway.url + "/", ["one-client"] * FLOOD))
    assert statuses == {200: 40, 429: FLOOD - 40}


async def test_concurrency_7_lets_exactly_7_of_1000_reach_a_holding_upstream():
    counting = CountingUpstream()
    async with serving(counting.handle) as upstream:
        limits = "  conns: {concurrency: 7, key: header:X-API-Key}\n"
        with GatewayProcess(config(limits, upstream, "conns", "max_in_flight: 2048\n")) as gateway:
            sent = asyncio.create_task(flood(gateway.url + "/held", ["one-client"] * FLOOD))

            async def all_refused_but_the_held() -> bool:
                async with aiohttp.ClientSession() as http:
                    counts = await decisions_now(http, gateway.admin_url)
                # The 7 admitted may still be on their way to the upstream when the last
                # refusal is counted: wait for both.
                refused = counts["conns", "concurrency_limited"] >= FLOOD - 7
                return refused and counting.in_flight["one-client"] >= 7

            await eventually(all_refused_but_the_held, what="every request but the held ones to be refused", deadline=60)
            assert counting.in_flight["one-client"] == 7
            counting.gate.set()
            statuses = collections.Counter(await sent)
    assert statuses == {200: 7, 429: FLOOD - 7}
    assert counting.most["one-client"] == 7


async def test_tiers_from_a_key_file_each_admit_their_own_burst(upstream, tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text("gold: [key-gold]\nsilver: [key-silver]\n")
    limits = (
        f"  api:\n    rate: 1/hour\n    burst: 3\n    key: header:X-API-Key\n"
        f"    tiers: {{from: {{file: '{keys}'}}, gold: {{rate: 1/hour, burst: 40}}, silver: {{rate: 1/hour, burst: 15}}}}\n"
    )
    sent = ["key-gold", "key-silver", "key-unlisted"] * (FLOOD // 3)
    with GatewayProcess(config(limits, upstream, "api")) as gateway:
        statuses = await flood(gateway.url + "/", sent)
        counts = await decisions(gateway.admin_url)
    admitted = collections.Counter(key for key, status in zip(sent, statuses) if status == 200)
    assert admitted == {"key-gold": 40, "key-silver": 15, "key-unlisted": 3}
    assert collections.Counter(statuses) == {200: 58, 429: len(sent) - 58}
    assert (counts["api", "allow"], counts["api", "deny"]) == (58, len(sent) - 58)


async def test_a_global_limit_admits_its_burst_over_1000_clients(upstream):
    limits = "  everyone: {rate: 1/hour, burst: 30, key: []}\n"
    with GatewayProcess(config(limits, upstream, "everyone")) as gateway:
        statuses = collections.Counter(await flood(gateway.url + "/", [f"client-{i}" for i in range(FLOOD)]))
    assert statuses == {200: 30, 429: FLOOD - 30}
