"""Fixed-window quotas end to end: the gateway started as users start it, a real
upstream, and a dedicated redis-server at the default 10 ms store.timeout with the
limit failing open (or the in-process store).

- 300 concurrent requests against a quota of 50 a day: exactly 50 pass, and every
  429 says to come back when the UTC day ends (Retry-After and RateLimit `t`).
- A quota and a token bucket on one route are all-or-nothing: requests the quota
  denies charge the bucket nothing.
- A window boundary crossed for real: the gateway (in-process store) runs under
  libfaketime, its clock set to 1.5 s before 2027-01-01 00:00 UTC once it serves. A
  monthly quota of 3 is spent in December, its 429 says to wait out the seconds left of
  the year, and once the clock passes midnight the January window admits 3 more and
  asks for 31 days.

The first two share one gateway per store, each spending limits of its own; the clock's
test runs its own under libfaketime.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import email.utils
import glob
import math
import time

import aiohttp
import pytest

from tests.processes import GatewayProcess, eventually, store_block_for
from tests.scrape import settled_decisions

UTC = datetime.UTC
LIBFAKETIME = sorted(glob.glob("/usr/lib/*/faketime/libfaketimeMT.so.1"))
# Seconds of December left once the gateway serves: time for four requests, waited out for real.
BEFORE_MIDNIGHT = 1.5

CONFIG = """
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
{store}
limits:
  daily: {{quota: {{limit: 50, per: day, reset: "00:00 UTC"}}, key: header:X-API-Key, on_store_error: open}}
  monthly: {{quota: {{limit: 3, per: month}}, key: header:X-API-Key, on_store_error: open}}
  tokens: {{rate: 1/day, burst: 5, key: header:X-API-Key, on_store_error: open}}
routes:
  - match: {{path: /daily}}
    upstream: {upstream}
    limits: [daily]
  - match: {{path: /monthly}}
    upstream: {upstream}
    limits: [monthly]
  - match: {{path: /both}}
    upstream: {upstream}
    limits: [tokens, monthly]
  - match: {{path: /tokens}}
    upstream: {upstream}
    limits: [tokens]
"""


@pytest.fixture(scope="module")
def quota_gateway(module_upstream):
    """`quota_gateway(store_kind)`: the module's gateway on that store ("redis" or
    "in-process"), started at the first test that asks and shared by the others; each test
    spends limits (and keys) of its own."""
    started: dict[str, GatewayProcess] = {}
    with contextlib.ExitStack() as stack:

        def gateway(store_kind: str) -> GatewayProcess:
            if store_kind not in started:
                store_block = stack.enter_context(store_block_for(store_kind))
                config = CONFIG.format(store=store_block, upstream=module_upstream)
                started[store_kind] = stack.enter_context(GatewayProcess(config))
            return started[store_kind]

        yield gateway


def seconds_to_midnight() -> float:
    now = datetime.datetime.now(UTC)
    midnight = datetime.datetime.combine(now.date() + datetime.timedelta(days=1), datetime.time(), UTC)
    return (midnight - now).total_seconds()


async def get(http: aiohttp.ClientSession, url: str, key: str) -> tuple[int, dict[str, str]]:
    async with http.get(url, headers={"X-API-Key": key}) as response:
        await response.read()
        return response.status, dict(response.headers)


@pytest.mark.parametrize("store_kind", ["redis", "in-process"])
async def test_exactly_the_quota_passes_a_concurrent_flood_and_429s_wait_for_the_day_to_end(quota_gateway, store_kind):
    """The only test of the shared gateway that spends `daily`."""
    gateway = quota_gateway(store_kind)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        answers = await asyncio.gather(*(get(http, gateway.url + "/daily", "flood") for _ in range(300)))
        # One more, after the flood's denials came back: with Redis, the gateway's denial
        # cache answers it, and must advertise the window's end as Redis measured it.
        answers.append(await get(http, gateway.url + "/daily", "flood"))
        counts = await settled_decisions(http, gateway.admin_url)
    statuses = collections.Counter(status for status, _ in answers)
    print(f"{store_kind}: {dict(statuses)}")
    assert statuses == {200: 50, 429: 251}
    assert counts["daily", "allow"] == 50 and counts["daily", "fail_open"] == 0
    expected = seconds_to_midnight()
    for status, headers in answers:
        if status == 429:
            assert expected - 5 <= int(headers["Retry-After"]) <= expected + 5, headers
            name, remaining, reset = headers["RateLimit"].split(";")
            assert (name, remaining) == ('"daily"', "r=0")
            assert expected - 5 <= int(reset.removeprefix("t=")) <= expected + 5, headers
    assert answers[0][1]["RateLimit-Policy"] == '"daily";q=50;w=86400'


@pytest.mark.parametrize("store_kind", ["redis", "in-process"])
async def test_requests_a_quota_denies_charge_the_bucket_beside_it_nothing(quota_gateway, store_kind):
    """/both is a bucket of 5 and a quota of 3: of 10 requests, 3 pass, so the bucket,
    charged for those 3 only, lets exactly 2 more through on /tokens. The only test of the
    shared gateway that spends `monthly` and `tokens`."""
    gateway = quota_gateway(store_kind)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        both = await asyncio.gather(*(get(http, gateway.url + "/both", "pair") for _ in range(10)))
        tokens = await asyncio.gather(*(get(http, gateway.url + "/tokens", "pair") for _ in range(10)))
        counts = await settled_decisions(http, gateway.admin_url)
    assert collections.Counter(status for status, _ in both) == {200: 3, 429: 7}
    assert collections.Counter(status for status, _ in tokens) == {200: 2, 429: 8}
    assert counts["monthly", "deny"] == 7 and counts["tokens", "skipped"] == 7


@pytest.mark.skipif(not LIBFAKETIME, reason="libfaketime is not installed (apt-get install faketime)")
async def test_a_monthly_quota_resets_when_the_clock_crosses_into_the_new_year(upstream, tmp_path):
    """The in-process store under libfaketime: its wall clock starts 30 s before
    2027-01-01 00:00 UTC, whatever the start-up takes within that, and once the gateway
    serves is moved on to BEFORE_MIDNIGHT before it; midnight then comes in real time.
    (redis-server 7 does not start under libfaketime here: its allocator's first
    clock_gettime recurses into libfaketime. The script crosses the same boundaries at
    computed times in tests/store/test_quota.py.)"""
    new_year = datetime.datetime(2027, 1, 1, tzinfo=UTC)
    offset = tmp_path / "faketime"

    def set_clock(before: float) -> None:
        """The gateway's clock `before` seconds before the new year, from its next reading on."""
        (tmp_path / "next").write_text(f"+{new_year.timestamp() - time.time() - before:.3f}\n")
        (tmp_path / "next").replace(offset)  # whole: the gateway reads the file at every reading of its clock

    set_clock(30)
    env = {"LD_PRELOAD": LIBFAKETIME[0], "FAKETIME_TIMESTAMP_FILE": str(offset), "FAKETIME_NO_CACHE": "1"}
    with GatewayProcess(CONFIG.format(store="", upstream=upstream), env=env) as gateway:
        set_clock(BEFORE_MIDNIGHT)
        async with aiohttp.ClientSession() as http:
            december = [await get(http, gateway.url + "/monthly", "boundary") for _ in range(4)]
            crossed: list[tuple[int, dict[str, str]]] = []

            async def admitted_again() -> bool:
                crossed.append(await get(http, gateway.url + "/monthly", "boundary"))
                return crossed[-1][0] == 200

            await eventually(admitted_again, what="the quota to admit again in January", deadline=10)
            january = [crossed[-1], *[await get(http, gateway.url + "/monthly", "boundary") for _ in range(3)]]
            counts = await settled_decisions(http, gateway.admin_url)

    def date(headers: dict[str, str]) -> datetime.datetime:
        return email.utils.parsedate_to_datetime(headers["Date"])

    print(f"December: {[s for s, _ in december]}, Retry-After {december[3][1]['Retry-After']} at {date(december[3][1])}; "
          f"{len(crossed) - 1} denied until January: {[s for s, _ in january]}, Retry-After "
          f"{january[3][1]['Retry-After']} at {date(january[3][1])}")
    assert [status for status, _ in december] == [200, 200, 200, 429]
    assert date(december[3][1]) < new_year  # the 429 is the gateway's own: its Date is its clock
    assert 1 <= int(december[3][1]["Retry-After"]) <= math.ceil(BEFORE_MIDNIGHT)
    assert all(status == 429 for status, _ in crossed[:-1])
    assert [status for status, _ in january] == [200, 200, 200, 429]
    assert date(january[3][1]) >= new_year
    assert 31 * 86400 - 10 <= int(january[3][1]["Retry-After"]) <= 31 * 86400
    assert counts["monthly", "allow"] == 6
