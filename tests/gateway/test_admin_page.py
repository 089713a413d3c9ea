"""The admin page: `/` on the admin listener, loaded in headless Chromium while
traffic flows through a real gateway (`python -m gateway run`, a real redis-server
and the tests' aiohttp upstream), some of it allowed and some limited, some to a
pool of two upstreams of which the test stops one. The test reads the rendered
page: routes and limits, live rates, allowed against limited, each pool target's
health and rates, the store, breaker and reload status, and the top limited client. Also /stats,
the counter totals the page computes its rates from, summed over the workers.

The browser is Debian's chromium, driven by chromedriver over the WebDriver
protocol (tests/webdriver.py). The charts, and docs/admin-page.png, are
tests/gateway/test_admin_charts.py's."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import json
import signal
import struct
import time

import aiohttp
import pytest

from gateway.metrics import LIMITER_BUCKETS
from gateway.testing import config_from_yaml, running_gateway
from tests.processes import GatewayProcess, eventually, free_port
from tests.upstream import running_upstream
from tests.webdriver import WINDOW, Browser, browser_installed

ADMIN_TOKEN = "admin-token-page-4b7e0c19d2"
LIGHT = "light-client-key-07"
HEAVY = "heavy-client-key-51"
# A client whose identity is markup: with raw identities the page shows it, as text.
MARKUP_KEY = """<img src=x id=injected onerror="document.title='pwned'">"""
RELOADED, RELOAD_FAILED = "config reloaded from", "config reload failed"
PAGE_DEADLINE = 15.0

needs_browser = pytest.mark.skipif(
    not browser_installed(), reason="chromium and chromedriver are not installed (apt-get install chromium chromium-driver)"
)


def page_config(upstream: str, redis_url: str, pool: tuple[str, str], extra: str = "") -> str:
    live, stopped = pool
    return f"""
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
# 100 ms, not the 10 ms default: Chromium shares the test machine's cores with Redis.
store: {{url: "{redis_url}"}}
{extra}
limits:
  per_key: {{rate: 2/second, burst: 2, key: header:X-Api-Key}}
  per_ip: {{rate: 100/second, burst: 200, key: ip}}
  conns: {{concurrency: 50, key: ip}}
routes:
  - match: {{path: /api}}
    upstream: {upstream}
    limits: [per_key]
  - match: {{path: /echo, methods: [GET]}}
    upstream: {upstream}
    limits: [per_ip, conns]
  - match: {{path: /status}}
    upstream: {upstream}
  - match: {{path: /pool}}
    upstream:
      targets: [{{url: "{live}", name: live}}, {{url: "{stopped}", name: stopped}}]
      # Three failed checks, not one: Chromium shares the cores, and a slow answer must not take `live` out.
      health: {{path: /status/200, interval: 200ms, timeout: 200ms, unhealthy_after: 3, healthy_after: 1}}
      retries: 1
"""


async def send_traffic(url: str, heavy: str, seen: collections.Counter) -> None:
    """About 40 requests a second from `heavy` on /api (2 a second are allowed), one a second
    from a light client (all allowed), 10 a second on /echo and on /pool, and one on /status;
    until cancelled."""
    async with aiohttp.ClientSession() as client:
        for round_ in range(1_000_000):
            calls = [("/api/items", heavy)] * 4 + [("/echo/x", LIGHT), ("/pool/x", LIGHT)]
            if round_ % 10 == 0:
                calls += [("/api/items", LIGHT), ("/status/200", LIGHT)]
            for path, key in calls:
                async with client.get(url + path, headers={"X-Api-Key": key}) as response:
                    await response.read()
                    seen[key, response.status] += 1
            await asyncio.sleep(0.1)


async def reload_twice(gw: GatewayProcess) -> tuple[float, float]:
    """A reload that takes effect, then one of a bad file, which counts a failure; the good
    file is put back. Returns the times around the good one."""

    def logged(fragment: str) -> int:
        return sum(fragment in line for line in gw.stderr_lines)

    good = gw.config_path.read_text()
    before = time.time()
    gw.signal(signal.SIGHUP)
    await eventually(lambda: logged(RELOADED) == 1, what="the reload")
    after = time.time()
    gw.config_path.write_text("limits: [not, a, mapping\n")
    gw.signal(signal.SIGHUP)
    await eventually(lambda: logged(RELOAD_FAILED) == 1, what="the failed reload")
    gw.config_path.write_text(good)
    return before, after


# What the test reads from the page: text as rendered, per element.
PAGE_STATE = """
const text = (id) => document.getElementById(id).textContent;
const cell = (tr, cls) => { const td = tr.querySelector('.' + cls); return td ? td.textContent : null; };
const rows = (id) => Array.from(document.querySelectorAll('#' + id + ' tbody tr'));
return {
  login: !document.getElementById('login').hidden,
  data: !document.getElementById('data').hidden,
  problem: text('problem'),
  version: text('version'),
  store_state: text('store-state'),
  store: text('store'),
  breaker: text('breaker'),
  ready: text('ready'),
  reload_success: text('reload-success'),
  reload_failures: text('reload-failures'),
  routes: rows('routes').map((tr) => ({
    route: tr.dataset.route, cells: Array.from(tr.cells).map((td) => td.textContent),
    rate: cell(tr, 'rate'), rate_4xx: cell(tr, 'rate-4xx'), total: cell(tr, 'total'),
  })),
  limits: rows('limits').map((tr) => ({
    route: tr.dataset.route, limit: tr.dataset.limit, policy: tr.cells[2] && tr.cells[2].textContent,
    allowed_rate: cell(tr, 'allowed-rate'), limited_rate: cell(tr, 'limited-rate'),
    allowed: cell(tr, 'allowed'), limited: cell(tr, 'limited'),
  })),
  targets: rows('targets').map((tr) => ({
    target: tr.dataset.target, routes: cell(tr, 'routes'), health: cell(tr, 'health'), rate: cell(tr, 'rate'),
    total: cell(tr, 'total'), ejections: cell(tr, 'ejections'),
    good: tr.querySelector('.state.good') !== null, bad: tr.querySelector('.state.bad') !== null,
  })),
  unavailable: text('unavailable'),
  top: rows('top').map((tr) => ({limit: cell(tr, 'limit'), identity: cell(tr, 'identity'), denials: cell(tr, 'denials')})),
  injected: document.getElementById('injected') !== null || document.querySelectorAll('#top img').length > 0,
  title: document.title,
};
"""


def number(text: str | None) -> float:
    try:
        return float(text or "")
    except ValueError:
        return 0.0


def limit_row(state: dict, route: str, limit: str) -> dict:
    return next((row for row in state["limits"] if row["route"] == route and row["limit"] == limit), {})


def route_row(state: dict, route: str) -> dict:
    return next((row for row in state["routes"] if row["route"] == route), {})


def target_row(state: dict, target: str) -> dict:
    return next((row for row in state["targets"] if row["target"] == target), {})


async def wait_for_page(browser: Browser, predicate, *, what: str, deadline: float = PAGE_DEADLINE) -> dict:
    """Poll the rendered page until `predicate(state)` holds; fail with the last state."""
    end = time.monotonic() + deadline
    state: dict = {}
    while time.monotonic() < end:
        state = await browser.run(PAGE_STATE)
        if predicate(state):
            return state
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; the page shows:\n{json.dumps(state, indent=1)}")


def errors_in(entries: list[dict]) -> list[dict]:
    return [entry for entry in entries if entry["level"] in ("SEVERE", "WARNING")]


async def refused_loads(browser: Browser, count: int) -> list[dict]:
    """The browser's log until it holds `count` entries (the log reaches the driver a moment after
    the page saw the answers); fails on any entry that is not a 401."""
    entries: list[dict] = []
    end = time.monotonic() + PAGE_DEADLINE
    while len(entries) < count and time.monotonic() < end:
        entries += errors_in(await browser.console())
        await asyncio.sleep(0.05)
    assert len(entries) == count and all("status of 401" in entry["message"] for entry in entries), entries
    return entries


def check_png(data: bytes) -> tuple[int, int]:
    """The width and height of a PNG, after checking it is one and is not blank."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    # A page of text and tables compresses to tens of KB; a blank one to a few hundred bytes.
    assert len(data) > 20_000, len(data)
    return width, height


@needs_browser
@pytest.mark.timeout(60)
@pytest.mark.parametrize("variant", ["token", "raw-identities"])
async def test_the_admin_page_shows_routes_targets_rates_status_and_top_clients_in_a_browser(
    upstream, redis_server, variant
):
    token = variant == "token"
    extra = "admin_token_env: GATEWAY_TEST_ADMIN_TOKEN" if token else "admin_raw_identities: true"
    heavy = HEAVY if token else MARKUP_KEY
    seen: collections.Counter = collections.Counter()
    async with running_upstream() as live, contextlib.AsyncExitStack() as stopping:
        stopped = await stopping.enter_async_context(running_upstream())
        config = page_config(upstream, redis_server.url, (live, stopped), extra)
        with GatewayProcess(config, env={"GATEWAY_TEST_ADMIN_TOKEN": ADMIN_TOKEN}) as gw:
            reload_started, reload_done = await reload_twice(gw)
            async with aiohttp.ClientSession() as client:
                for _ in range(4):  # round robin: two to each target
                    async with client.get(gw.url + "/pool/x") as response:
                        assert response.status == 200
            await stopping.aclose()  # its health checks fail from now on
            traffic = asyncio.create_task(send_traffic(gw.url, heavy, seen))
            try:
                await eventually(lambda: seen[heavy, 429] > 0 and seen[LIGHT, 200] > 0, what="allowed and limited traffic")
                auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"} if token else {}
                async with aiohttp.ClientSession(headers=auth) as admin:
                    async with admin.get(gw.admin_url + "/buckets/per_key", params={"value": heavy}) as response:
                        assert response.status == 200
                        heavy_shown = (await response.json())["identity"]
                if token:
                    assert heavy_shown.startswith("header:x-api-key#") and HEAVY not in heavy_shown
                else:
                    assert heavy_shown == f"header:x-api-key={MARKUP_KEY}"

                async with Browser() as browser:
                    await browser.get(gw.admin_url + "/")
                    if token:
                        # The shell holds no data: it asks for the token before fetching any.
                        state = await wait_for_page(browser, lambda s: s["login"], what="the token form")
                        assert not state["data"] and state["routes"] == [] and state["version"] == ""
                        assert errors_in(await browser.console()) == []
                        await browser.type("#token", "not-the-token-0000000000")
                        await browser.click("#login button")
                        state = await wait_for_page(browser, lambda s: s["login"] and s["problem"], what="the refusal")
                        assert state["problem"] == "The token was refused." and not state["data"]
                        # Chromium logs each 401 as a failed load, one per request of the poll; the page
                        # decides only once all three are answered, so none comes after the form.
                        refusals = await refused_loads(browser, 3)
                        assert sorted(entry["message"].split()[0].rsplit("/", 1)[1] for entry in refusals) == [
                            "readyz", "stats", "top-limited?n=10"], refusals
                        await browser.type("#token", ADMIN_TOKEN)
                        await browser.click("#login button")

                    def complete(s: dict) -> bool:
                        per_key = limit_row(s, "/api", "per_key")
                        return (
                            s["data"]
                            and number(per_key.get("allowed_rate")) > 0
                            and number(per_key.get("limited_rate")) > 0
                            and number(route_row(s, "/api").get("rate")) > 0
                            and any(row["identity"] == heavy_shown for row in s["top"])
                            and target_row(s, "stopped").get("health") == "unhealthy"
                            and number(target_row(s, "live").get("rate")) > 0
                        )

                    state = await wait_for_page(browser, complete, what="rates, targets and the top limited client")
                    png = await browser.screenshot()
                    console = await browser.console()
                    stored_token = await browser.run("return sessionStorage.getItem('gateway-admin-token');")
            finally:
                traffic.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await traffic

    assert not state["login"] and state["problem"] == ""
    assert stored_token == (ADMIN_TOKEN if token else None)
    # The routes and their limits, from the effective config.
    assert [row["route"] for row in state["routes"]] == ["/api", "/echo GET", "/status", "/pool"]
    assert route_row(state, "/api")["cells"][1] == upstream
    assert route_row(state, "/api")["cells"][2] == "per_key"
    assert route_row(state, "/status")["cells"][2] == "none" and number(route_row(state, "/status")["total"]) > 0
    assert [(row["route"], row["limit"]) for row in state["limits"]] == [
        ("/api", "per_key"), ("/echo GET", "per_ip"), ("/echo GET", "conns"),
    ]
    assert limit_row(state, "/echo GET", "conns")["policy"] == "50 in flight, by ip, store down: open"
    assert number(limit_row(state, "/echo GET", "conns")["allowed"]) > 0
    per_key = limit_row(state, "/api", "per_key")
    assert per_key["policy"] == "2/second, burst 2, by header:x-api-key, store down: open"
    # Allowed against limited: the heavy client sends about 40 a second and 2 pass.
    assert number(per_key["allowed_rate"]) > 0 and number(per_key["limited_rate"]) > 0
    assert 0 < number(per_key["allowed"]) < number(per_key["limited"])
    assert number(route_row(state, "/api")["rate_4xx"]) > 0
    per_ip = limit_row(state, "/echo GET", "per_ip")
    assert number(per_ip["allowed_rate"]) > 0 and per_ip["limited_rate"] == "0.00" and per_ip["limited"] == "0"
    # The pool's targets: the stopped one out by its health checks, after its two requests.
    live_row, stopped_row = target_row(state, "live"), target_row(state, "stopped")
    assert [row["target"] for row in state["targets"]] == ["live", "stopped"]
    assert live_row["routes"] == stopped_row["routes"] == "/pool"
    assert live_row["health"] == "healthy" and live_row["good"] and not live_row["bad"]
    assert stopped_row["health"] == "unhealthy" and stopped_row["bad"] and not stopped_row["good"]
    assert number(live_row["rate"]) > 0 and number(live_row["total"]) > 2
    assert number(stopped_row["total"]) >= 2  # more if traffic reached it before the checks took it out
    assert live_row["ejections"] == stopped_row["ejections"] == "0"  # no passive ejection configured
    # Connect failures on `stopped` were retried on `live`: no 503 for want of a target.
    assert state["unavailable"].endswith(": none."), state["unavailable"]
    # Store, breaker and reloads.
    assert state["store_state"] == "ok" and state["store"] == f"redis redis://127.0.0.1:{redis_server.port}/0"
    assert state["breaker"] == "closed" and state["ready"] == "yes"
    assert state["reload_failures"] == "1"
    shown = datetime.datetime.strptime(state["reload_success"][:19], "%Y-%m-%d %H:%M:%S").replace(tzinfo=datetime.UTC)
    assert state["reload_success"][19:].startswith(" UTC (")
    assert int(reload_started) <= shown.timestamp() <= reload_done
    # The limited client, as the admin API names it: hashed, or with raw identities as sent, as text.
    top = next(row for row in state["top"] if row["identity"] == heavy_shown)
    assert top["limit"] == "per_key" and int(top["denials"]) > 0
    assert all(LIGHT not in row["identity"] for row in state["top"])
    if token:
        assert all(HEAVY not in row["identity"] for row in state["top"])
    assert not state["injected"] and state["title"] == "ratelimit-gateway admin"
    assert errors_in(console) == [], console

    width, height = check_png(png)
    assert (width, height) <= WINDOW and width >= WINDOW[0] * 0.9, (width, height)


# --- /stats and the page's shell, without a browser ------------------------------------


COUNTED = """
limits:
  per_key: {rate: 1/hour, burst: 2, key: header:X-Api-Key}
routes:
  - match: {path: /api}
    upstream: UPSTREAM
    limits: [per_key]
  - match: {path: /sink, methods: [POST]}
    upstream: UPSTREAM
"""


async def test_stats_has_the_routes_limits_and_counter_totals(upstream, client):
    async with running_gateway(COUNTED.replace("UPSTREAM", upstream)) as gw:
        for expected in (200, 200, 429):
            async with client.get(gw.url + "/api/x", headers={"X-Api-Key": "k"}) as response:
                assert response.status == expected
        async with client.get(gw.url + "/nowhere") as response:
            assert response.status == 404
        before = time.time()
        async with client.get(gw.admin_url + "/stats") as response:
            assert response.status == 200
            stats = await response.json()
    assert before <= stats["time"] <= time.time()
    assert stats["routes"] == [
        {"route": "/api", "upstream": upstream, "limits": [{"name": "per_key", "cost": 1}]},
        {"route": "/sink POST", "upstream": upstream, "limits": []},
    ]
    assert stats["limits"] == [{
        "name": "per_key", "rate": "1/hour", "burst": 2, "key": ["header:x-api-key"], "on_store_error": "open",
        "shadow": False,
    }]
    assert sorted(stats["requests"], key=json.dumps) == sorted([
        {"route": "/api", "method": "GET", "status_class": "2xx", "total": 2},
        {"route": "/api", "method": "GET", "status_class": "4xx", "total": 1},
        {"route": "unmatched", "method": "GET", "status_class": "4xx", "total": 1},
    ], key=json.dumps)
    assert sorted(stats["decisions"], key=json.dumps) == [
        {"route": "/api", "limit": "per_key", "decision": "allow", "total": 2},
        {"route": "/api", "limit": "per_key", "decision": "deny", "total": 1},
        {"route": "/api", "limit": "per_key", "decision": "fail_open", "total": 0},  # exported from the start
    ]
    assert stats["breaker"] == {"closed": 1, "open": 0, "half_open": 0}
    # One decision timed for each request of /api; the cumulative counts end at that count.
    latency = stats["limiter_latency"]
    assert latency["count"] == 3 and latency["sum"] > 0
    assert [bound for bound, _ in latency["buckets"]] == list(LIMITER_BUCKETS)
    counts = [count for _, count in latency["buckets"]]
    assert counts == sorted(counts) and counts[-1] <= 3
    assert stats["reload"] == {"failures": 0, "last_success": None}
    assert stats["in_flight"] == 0 and stats["shed"] == 0


async def test_stats_lists_a_routes_concurrency_limits_beside_its_rate_limits(upstream, client):
    text = COUNTED.replace("UPSTREAM", upstream).replace(
        "limits:\n", "limits:\n  conns: {concurrency: 3, key: header:X-Api-Key}\n", 1
    ).replace("limits: [per_key]", "limits: [per_key, conns]", 1)
    async with running_gateway(text) as gw:
        async with client.get(gw.admin_url + "/stats") as response:
            stats = await response.json()
    assert stats["routes"][0]["limits"] == [{"name": "per_key", "cost": 1}, {"name": "conns", "cost": 1}]
    assert stats["limits"][1] == {
        "name": "conns", "concurrency": 3, "key": ["header:x-api-key"], "on_store_error": "open",
    }


async def test_stats_sums_every_workers_counters(upstream, redis_server):
    text = (
        f"workers: 2\nlisten: 127.0.0.1:{free_port()}\nadmin_listen: 127.0.0.1:{free_port()}\n"
        f"store: {{url: '{redis_server.url}'}}\n" + COUNTED.replace("UPSTREAM", upstream)
        + f"  - match: {{path: /pool}}\n    upstream: {{targets: [{{url: '{upstream}', name: up}}], "
        "health: {path: /status/200, interval: 1h}}\n"
    )
    with GatewayProcess(text) as gw:
        await eventually(lambda: sum("listening on" in line for line in gw.stderr_lines) == 2, what="both workers")
        # A connection per request, so the kernel spreads them over both workers.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as client:
            statuses = []
            for _ in range(8):
                async with client.get(gw.url + "/api/x", headers={"X-Api-Key": "k"}) as response:
                    statuses.append(response.status)
            assert statuses == [200] * 2 + [429] * 6
            for _ in range(4):  # whichever worker answers
                async with client.get(gw.admin_url + "/stats") as response:
                    stats = await response.json()
                decisions = {row["decision"]: row["total"] for row in stats["decisions"]}
                assert decisions == {"allow": 2, "deny": 6, "fail_open": 0}
                assert stats["breaker"] == {"closed": 2, "open": 0, "half_open": 0}
                assert stats["limiter_latency"]["count"] == 8
                assert [bound for bound, _ in stats["limiter_latency"]["buckets"]] == list(LIMITER_BUCKETS)

            async def both_workers_see_the_target_healthy() -> bool:
                async with client.get(gw.admin_url + "/stats") as response:
                    stats = await response.json()
                return [(t["target"], t["healthy"]) for t in stats["targets"]] == [("up", 2)]

            await eventually(both_workers_see_the_target_healthy, what="each worker's health check of the target")
            assert stats["workers"] == 2


@pytest.mark.parametrize("token", [True, False])
async def test_the_page_is_served_without_the_token_and_holds_no_data(upstream, client, token):
    text = COUNTED.replace("UPSTREAM", upstream) + ("admin_token_env: ADMIN_TOKEN\n" if token else "")
    async with running_gateway(config_from_yaml(text, environ={"ADMIN_TOKEN": ADMIN_TOKEN})) as gw:
        pages = {}
        for path, kind in (
            ("/", "text/html"), ("/admin.js", "text/javascript"), ("/charts.js", "text/javascript"), ("/admin.css", "text/css"),
        ):
            async with client.get(gw.admin_url + path) as response:
                assert response.status == 200
                assert response.headers["Content-Type"] == f"{kind}; charset=utf-8"
                assert "script-src 'self'" in response.headers["Content-Security-Policy"]
                assert response.headers["X-Content-Type-Options"] == "nosniff"
                pages[path] = await response.text()
        async with client.get(gw.admin_url + "/stats") as response:
            assert response.status == (401 if token else 200)
    html = pages["/"]
    assert ('data-auth="bearer"' if token else 'data-auth="none"') in html
    for data in ("per_key", "/api", "/sink", upstream, ADMIN_TOKEN):
        assert all(data not in page for page in pages.values())
    # Nothing inline and nothing from elsewhere: the policy allows neither.
    assert "<script>" not in html and "<style" not in html and "://" not in html
