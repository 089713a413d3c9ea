"""The admin page's charts, in headless Chromium, against a real gateway (`python -m
gateway run`), a real redis-server and the tests' aiohttp upstream, under a load the
test counts: what each chart draws (the values its lines carry as data-* attributes)
must add up to the requests the test saw answered. Then the store goes away and comes
back, which the breaker's strip must show, and the gateway restarts, which resets its
counters: no chart may draw a negative rate.

The page polls by itself every second, and does so through the load. Once the test waits
for a change to be drawn, it has the page poll at once (the page's own `poll()`, which its
timer calls) before each look at the charts, rather than waiting out the rest of a second.

`GATEWAY_UPDATE_SCREENSHOT=1` makes the test write its screenshot to
docs/admin-page.png, the one docs/admin-api.md shows."""

from __future__ import annotations

import asyncio
import collections
import json
import math
import os
import time
from pathlib import Path

import aiohttp
import pytest

from tests.gateway.test_admin_page import check_png, errors_in, needs_browser
from tests.processes import GatewayProcess, RedisServer, eventually, free_port
from tests.webdriver import Browser

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "docs" / "admin-page.png"
HEAVY, LATER = "heavy-client-key-51", "after-restart-key-33"
CHART_DEADLINE = 20.0

# Each chart as drawn: its data-* marks, and per line its values and their intervals' lengths.
CHARTS = """
const split = (text) => text === "" ? [] : text.split(",");
return Array.from(document.querySelectorAll("figure.chart")).map((figure) => ({
  marks: Object.assign({}, figure.dataset),
  lines: Object.fromEntries(Array.from(figure.querySelectorAll("path.line")).map((path) => [path.dataset.series, {
    values: split(path.dataset.values).map((v) => v === "" ? null : Number(v)),
    seconds: split(path.dataset.seconds).map(Number),
  }])),
  states: Array.from(figure.querySelectorAll("g.states")).flatMap((g) => split(g.dataset.states)),
}));
"""


def chart(charts: list[dict], **marks: str) -> dict:
    return next((c for c in charts if all(c["marks"].get(k) == v for k, v in marks.items())), {"lines": {}, "states": []})


def counted(line: dict | None) -> float:
    """What a line of rates counts: each rate times its interval's length, summed."""
    if not line:
        return -1.0
    return sum(value * seconds for value, seconds in zip(line["values"], line["seconds"]) if value is not None)


def whole(value: float) -> int | None:
    """`value` as the whole number it is, within float rounding; None if it is none."""
    return round(value) if math.isclose(value, round(value), abs_tol=1e-6) else None


# The page's poll, now: it resolves once the page has drawn the gateway's answers (or
# shown that it did not answer), and resets the page's timer for the next one.
POLL_NOW = "return poll();"


async def wait_for_charts(browser: Browser, measure, expected, *, what: str) -> list[dict]:
    """Have the page poll and read the drawn charts until `measure(charts) == expected`;
    fail with the last measure."""
    end = time.monotonic() + CHART_DEADLINE
    charts: list[dict] = []
    while time.monotonic() < end:
        await browser.run(POLL_NOW)
        charts = await browser.run(CHARTS)
        if measure(charts) == expected:
            return charts
        await asyncio.sleep(0.1)
    raise AssertionError(
        f"timed out waiting for {what}: {measure(charts)!r}, not {expected!r}; the charts:\n{json.dumps(charts)[:3000]}"
    )


async def send_load(url: str, seen: collections.Counter) -> None:
    """Forty rounds a tenth of a second apart: three requests from HEAVY on /api (5 a second
    pass), one to /status/200 and every fifth round one to /status/503; each answer counted."""
    async with aiohttp.ClientSession() as client:
        for round_ in range(40):
            calls = [("/api/items", HEAVY)] * 3 + [("/status/200", HEAVY)]
            if round_ % 5 == 0:
                calls.append(("/status/503", HEAVY))
            for path, key in calls:
                async with client.get(url + path, headers={"X-Api-Key": key}) as response:
                    await response.read()
                    seen[path.split("/")[1], response.status] += 1
            await asyncio.sleep(0.1)  # the load's pace, so the charts have a shape


def config(upstream: str, redis_url: str, port: int, admin_port: int) -> str:
    return f"""
listen: 127.0.0.1:{port}
admin_listen: 127.0.0.1:{admin_port}
# 1 s, not the 10 ms default: Chromium shares the cores with Redis, and a timed-out
# check (fail_open) would be neither allowed nor limited.
store: {{url: "{redis_url}", timeout: 1s}}
limits:
  per_key: {{rate: 5/second, burst: 5, key: header:X-Api-Key}}
routes:
  - match: {{path: /api}}
    upstream: {upstream}
    limits: [per_key]
  - match: {{path: /status}}
    upstream: {upstream}
"""


async def breaker_state(admin_url: str) -> str:
    async with aiohttp.ClientSession() as client, client.get(admin_url + "/readyz") as response:
        return (await response.json())["breaker"]


async def poke_until_breaker(gw: GatewayProcess, state: str) -> None:
    """Send requests through per_key (the breaker changes only when checks are made) until it is `state`."""
    async with aiohttp.ClientSession() as client:

        async def reached() -> bool:
            async with client.get(gw.url + "/api/items", headers={"X-Api-Key": "probe"}) as response:
                await response.read()
            return await breaker_state(gw.admin_url) == state

        await eventually(reached, what=f"the breaker to be {state}")


@needs_browser
@pytest.mark.timeout(120)
async def test_the_charts_draw_the_counts_of_a_known_load_the_breaker_and_a_restart(upstream, tmp_path):
    seen: collections.Counter = collections.Counter()
    port, admin_port = free_port(), free_port()
    with RedisServer() as redis_server, GatewayProcess(config(upstream, redis_server.url, port, admin_port)) as gw:
        async with Browser() as browser:
            await browser.get(gw.admin_url + "/")
            # Two polls before any request: the load is all in the charts' window.
            await browser.until("return history.samples.length >= 2;", what="two polls")
            await send_load(gw.url, seen)
            allowed, limited = seen["api", 200], seen["api", 429]
            ok, failed = seen["status", 200], seen["status", 503]
            assert allowed > 0 and limited > 0 and allowed + limited == 120 and (ok, failed) == (40, 8)

            def drawn(charts: list[dict]) -> dict[str, list[int | None]]:
                limit = chart(charts, chart="limit", route="/api", limit="per_key")["lines"]
                api = chart(charts, chart="route", route="/api")["lines"]
                status = chart(charts, chart="route", route="/status")["lines"]
                return {
                    "per_key": [whole(counted(limit.get(s))) for s in ("allowed", "limited")],
                    "/api": [whole(counted(api.get(c))) for c in ("2xx", "4xx", "5xx")],
                    "/status": [whole(counted(status.get(c))) for c in ("2xx", "4xx", "5xx")],
                }

            expected = {"per_key": [allowed, limited], "/api": [allowed, limited, 0], "/status": [ok, 0, failed]}
            charts = await wait_for_charts(browser, drawn, expected, what="the load's counts in the charts")
            assert errors_in(await browser.console()) == []
            limit = chart(charts, chart="limit", route="/api", limit="per_key")["lines"]
            assert all(v is not None and v >= 0 for line in limit.values() for v in line["values"])
            # Some interval saw both: the heavy client's rate against its 5 a second.
            assert any(a and b for a, b in zip(limit["allowed"]["values"], limit["limited"]["values"]))
            # Latency: every /api request's decision was timed; p50 <= p99, both past zero.
            latency = chart(charts, chart="latency")["lines"]
            timed = [(p50, p99) for p50, p99 in zip(latency["p50"]["values"], latency["p99"]["values"]) if p50 is not None]
            assert timed and all(0 < p50 <= p99 for p50, p99 in timed), timed
            assert all(v is None or v > 0 for v in latency["mean"]["values"])
            decided = await browser.run(
                "const s = history.samples; return s[s.length - 1].latency.count - s[0].latency.count;"
            )
            assert decided == allowed + limited
            # The quantiles are interpolated within a bucket, as Prometheus's histogram_quantile does.
            change = {"count": 10, "sum": 0.015, "buckets": [[0.001, 5], [0.002, 9], [0.005, 10]]}
            picked = await browser.run(
                "return [quantile(0.5), quantile(0.9), quantile(0.99), mean].map((pick) => pick(arguments[0]));", change
            )
            assert [round(ms, 9) for ms in picked] == [1.0, 2.0, 4.7, 1.5]
            assert set(chart(charts, chart="breaker")["states"]) == {"closed"}

            # The store goes away: the breaker opens, and the strip shows it; then it comes back.
            redis_server.stop()
            await poke_until_breaker(gw, "open")
            last_state = lambda c: chart(c, chart="breaker")["states"][-1:]  # noqa: E731
            await wait_for_charts(browser, last_state, ["open"], what="the open breaker")
            redis_server.start()
            await poke_until_breaker(gw, "closed")
            charts = await wait_for_charts(browser, last_state, ["closed"], what="the closed breaker")
            states = chart(charts, chart="breaker")["states"]
            first_open = states.index("open")
            assert set(states[:first_open]) == {"closed"} and states[-1] == "closed"
            png = await browser.screenshot()

            # A restart: every counter starts again from zero, and no chart may go below it.
            gw.stop()
            with GatewayProcess(config(upstream, redis_server.url, port, admin_port)) as restarted:
                # The page has polled the new process before its requests: its counts start from zero.
                await browser.until(
                    "return poll().then(() => { const s = history.samples;"
                    " return s.length > 0 && (s[s.length - 1].totals.get(arguments[0]) || 0) === 0; });",
                    "dec\u0000/api\u0000per_key\u0000allow", what="a poll of the restarted gateway",
                )
                async with aiohttp.ClientSession() as client:
                    for _ in range(3):
                        async with client.get(restarted.url + "/api/items", headers={"X-Api-Key": LATER}) as response:
                            assert response.status == 200

                def across_restart(charts: list[dict]) -> tuple[int, int | None]:
                    """The allowed line's gaps, and what it counts after the last one."""
                    line = chart(charts, chart="limit", route="/api", limit="per_key")["lines"]["allowed"]
                    values = line["values"]
                    gap = max((i for i, v in enumerate(values) if v is None), default=len(values))
                    return values.count(None), whole(counted({"values": values[gap + 1:], "seconds": line["seconds"][gap + 1:]}))

                # One interval, the one across the restart, has no rate; the 3 requests after it are drawn.
                charts = await wait_for_charts(browser, across_restart, (1, 3), what="the restarted gateway's 3 requests")
    limit = chart(charts, chart="limit", route="/api", limit="per_key")["lines"]
    gap = limit["allowed"]["values"].index(None)
    before = {"values": limit["allowed"]["values"][:gap], "seconds": limit["allowed"]["seconds"][:gap]}
    # The load before the restart is still drawn (with the probes', which pass too when the store is up).
    assert counted(before) >= allowed
    for figure in charts:
        for name, line in figure["lines"].items():
            assert all(v is None or v >= 0 for v in line["values"]), (figure["marks"], name, line)
    check_png(png)
    update = os.environ.get("GATEWAY_UPDATE_SCREENSHOT") == "1"
    target = SCREENSHOT if update else tmp_path / "admin-page.png"
    target.write_bytes(png)
    check_png(target.read_bytes())
