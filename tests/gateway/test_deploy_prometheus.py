"""deploy/prometheus/ and deploy/grafana/ proven against real components.

promtool checks the alert rules and Prometheus config and runs the rules' unit tests
(deploy/prometheus/alerts_test.yml), and every alert must have one that makes it fire
and one that keeps it quiet. Then a real Prometheus (Debian's package, its own port and
storage) scrapes a real gateway (`python -m gateway run -c FILE`, a private
redis-server, a real aiohttp upstream, a pool of two more, and a pool of one) every second, with
deploy/prometheus/alerts.yml loaded, while traffic goes through: allowed, limited and
shadow-limited, delayed by a `mode: delay` limit, allowlisted, refused by a concurrency
limit, spread over the pool, and clients hanging up on a slow path before their answer
(a raw socket: send, close); then with one target of the two-target pool stopped
(connect errors, retries to the other, a passive ejection, failing health checks) and
the one-target pool's target too (its route answers 503 with no target in rotation,
counted by reason), then with Redis
stopped (SIGSTOP: checks time out, the failure policies answer, the circuit breaker
opens, concurrency leases cannot be released), then with Redis back, then a reload of
a bad config file. Every PromQL expression of the dashboard (with Grafana's variables
made concrete) and of the alert rules is then evaluated through the HTTP API and must
return at least one series, on metrics and label values the gateway really exports.
Each alert's threshold is really crossed by the scenario, so each alert expression
returns its series with the comparison in place, and Prometheus itself has each alert
pending or firing: store errors and failing open while Redis is stopped, half of
/open's answers 429 (the `flood` client), limiter latency because the checks sent to
the stopped Redis wait out the 10 ms store.timeout (before the breaker opens, and its
probes after), which puts p99 past 5 ms, the refused reload, half of /pool's requests
hung up, the stopped targets out of rotation, and the one-target pool's route answering
503 for want of a target. No expression is run without its comparison.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import re
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import grpc
import yaml
from aiohttp import web

from gateway.envoy.generated import ratelimit_pb2, rls_pb2, rls_pb2_grpc
from tests.processes import GatewayProcess, RedisServer, free_port
from tests.prometheus import PrometheusServer, promtool
from tests.upstream import upstream_app

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
ALERTS = PROMETHEUS_DIR / "alerts.yml"
ALERT_TESTS = PROMETHEUS_DIR / "alerts_test.yml"
PROMETHEUS_CONFIG = PROMETHEUS_DIR / "prometheus.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "gateway-dashboard.json"

# Grafana's own interval variables as concrete durations. The scenario's data spans well
# under a minute at a 1 s scrape, so a 1m rate window holds all of it.
GRAFANA_BUILTINS = {"__rate_interval": "1m", "__interval": "15s", "__range": "5m"}
PHASE_DEADLINE = 15.0  # seconds of traffic at most until Prometheus shows a phase's data
QUERY_DEADLINE = 20.0  # seconds at most until every query answers


# --- the files ------------------------------------------------------------------------------


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"] if "alert" in rule]


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def all_panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows included."""
    found = []
    for panel in panels:
        found.append(panel)
        found.extend(all_panels(panel.get("panels", [])))
    return found


_VARIABLE = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\[\[(\w+)(?::[^\]]*)?\]\]|\$(\w+)")


def substitute(expr: str, variables: dict[str, str]) -> str:
    """`expr` with Grafana's `$name`, `${name}`, `${name:format}` and `[[name]]` replaced; a
    variable the dashboard does not define fails the test."""

    def value(match: re.Match[str]) -> str:
        name = next(group for group in match.groups() if group)
        assert name in variables, f"{expr!r}: variable ${name} is neither Grafana's nor the dashboard's"
        return variables[name]

    return _VARIABLE.sub(value, expr)


def dashboard_variables(board: dict[str, Any]) -> dict[str, str]:
    """Grafana's interval variables, and each template variable as its "All" value."""
    variables = dict(GRAFANA_BUILTINS)
    for variable in board["templating"]["list"]:
        if variable["type"] == "datasource":
            continue
        assert variable.get("includeAll") and variable.get("allValue"), f"variable {variable['name']} needs an allValue"
        variables[variable["name"]] = variable["allValue"]
    return variables


_LABEL_VALUES = re.compile(r"^label_values\((.+),\s*(\w+)\)$")


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable, ready to run."""
    board = dashboard()
    variables = dashboard_variables(board)
    queries = []
    for panel in all_panels(board["panels"]):
        for target in panel.get("targets", []):
            queries.append((f"panel {panel['title']!r} target {target['refId']}", substitute(target["expr"], variables)))
    for variable in board["templating"]["list"]:
        if variable["type"] != "query":
            continue
        text = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        match = _LABEL_VALUES.match(text)
        assert match, f"variable {variable['name']}: only label_values(SELECTOR, LABEL) is understood here: {text}"
        selector, label = match.groups()
        queries.append((f"variable {variable['name']}", f"count by ({label}) ({substitute(selector, variables)})"))
    return queries


# --- promtool ---------------------------------------------------------------------------------


def test_the_alert_rules_pass_promtool_check():
    result = promtool("check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in result.stdout


def test_the_prometheus_config_passes_promtool_check():
    result = promtool("check", "config", str(PROMETHEUS_CONFIG))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_says_how_long_how_bad_and_what_happened():
    for rule in alert_rules():
        assert "for" in rule, rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


def test_every_alert_has_a_unit_test_that_fires_it_and_one_that_keeps_it_quiet_and_they_pass():
    fires, quiet = set(), set()
    for test in yaml.safe_load(ALERT_TESTS.read_text())["tests"]:
        for case in test.get("alert_rule_test", []):
            (fires if case.get("exp_alerts") else quiet).add(case["alertname"])
    names = {rule["alert"] for rule in alert_rules()}
    assert names - fires == set(), f"alerts no unit test fires: {sorted(names - fires)}"
    assert names - quiet == set(), f"alerts no unit test keeps quiet: {sorted(names - quiet)}"
    assert fires | quiet <= names, f"unit tests of alerts that do not exist: {sorted((fires | quiet) - names)}"
    result = promtool("test", "rules", ALERT_TESTS.name, cwd=PROMETHEUS_DIR)
    assert result.returncode == 0, result.stdout + result.stderr


def test_grafana_variables_are_made_concrete_and_an_unknown_one_fails():
    variables = {**GRAFANA_BUILTINS, "instance": ".*"}
    assert substitute('rate(x{instance=~"$instance"}[$__rate_interval])', variables) == 'rate(x{instance=~".*"}[1m])'
    assert substitute("increase(x[${__range}]) [[__interval]]", variables) == "increase(x[5m]) 15s"
    try:
        substitute("rate(x[$window])", variables)
    except AssertionError as exc:
        assert "$window" in str(exc)
    else:
        raise AssertionError("an unknown variable passed")


# --- the live scrape --------------------------------------------------------------------------


# Envoy's rate-limit service: a domain whose one limit fails closed, as /closed does.
RLS_CONFIG = """\
domain: beside
descriptors:
  - key: client
    rate_limit: {unit: second, requests_per_unit: 1000}
    on_store_error: closed
"""


def gateway_yaml(upstream: str, redis_url: str, pool: tuple[str, str], lone: str, beside: tuple[int, int, Path]) -> str:
    """A limit of each failure policy, a shadow limit, a shaping limit with an allowlist, a
    concurrency limit, a pool of two targets, a pool of one (`lone`) on /down, an unlimited
    route, and beside them (`beside`: its ports and rls_config directory) the decision
    listener and Envoy's rate-limit service. Buckets on /open hold
    3 and refill once an hour, so the `flood` key is denied from its 4th request. /paced
    refills a token every 20 ms, so the second of two requests sent at once waits for it.
    /slow lets a client hold two requests in flight. The pools' targets are checked every
    500 ms and ejected after two failed requests in a row."""
    decision_port, rls_port, rls_config = beside
    return f"""\
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
decision_listen: 127.0.0.1:{decision_port}
trusted_proxies: [127.0.0.1/32]
rls_listen: 127.0.0.1:{rls_port}
rls_config: {rls_config}
store: {{url: "{redis_url}"}}
limits:
  per_client: {{rate: 1/hour, burst: 3, key: [header:X-API-Key, ip], on_store_error: open}}
  would_cap: {{rate: 1/hour, burst: 2, key: [header:X-API-Key, ip], shadow: true}}
  strict: {{rate: 1000/second, burst: 1000, key: [header:X-API-Key, ip], on_store_error: closed}}
  spread: {{rate: 1000/second, burst: 1000, key: [header:X-API-Key, ip], on_store_error: local}}
  paced:
    rate: 50/second
    burst: 1
    mode: delay
    max_delay: 100ms
    key: [header:X-API-Key, ip]
    allow: ["header:X-API-Key=ops-key"]
  # A release Redis fails is tried again until the lease would have expired: a short TTL
  # lets the stopped-Redis phase see releases given up in seconds, not in the default 60 s.
  conns: {{concurrency: 2, lease_ttl: 1s, key: [header:X-API-Key, ip]}}
routes:
  - match: {{path: /open}}
    upstream: {upstream}
    limits: [per_client, would_cap]
  - match: {{path: /closed}}
    upstream: {upstream}
    limits: [strict]
  - match: {{path: /local}}
    upstream: {upstream}
    limits: [spread]
  - match: {{path: /paced}}
    upstream: {upstream}
    limits: [paced]
  - match: {{path: /slow}}
    upstream: {upstream}
    limits: [conns]
  - match: {{path: /pool}}
    strip_prefix: true
    upstream:
      targets: [{{url: "{pool[0]}", name: pool-a}}, {{url: "{pool[1]}", name: pool-b}}]
      health: {{path: /healthz, interval: 500ms, timeout: 200ms, unhealthy_after: 2, healthy_after: 2}}
      passive: {{eject_after: 2, eject_for: 1s}}
      retries: 1
  - match: {{path: /down}}
    strip_prefix: true
    upstream:
      targets: [{{url: "{lone}", name: down-a}}]
      health: {{path: /healthz, interval: 500ms, timeout: 200ms, unhealthy_after: 2, healthy_after: 2}}
      passive: {{eject_after: 2, eject_for: 1s}}
  - match: {{path: /}}
    upstream: {upstream}
"""


class PoolTarget:
    """tests.upstream's app on a port of its own: a pool target the scenario stops midway."""

    def __init__(self) -> None:
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def __aenter__(self) -> PoolTarget:
        self._runner = web.AppRunner(upstream_app(), access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


@contextlib.asynccontextmanager
async def off_the_loop(process: GatewayProcess | PrometheusServer) -> AsyncIterator[Any]:
    """`process` started and stopped in a thread: meanwhile the event loop goes on serving
    the upstreams, whose health checks would otherwise fail while it waits."""
    entered = await asyncio.to_thread(process.__enter__)
    try:
        yield entered
    finally:
        await asyncio.to_thread(process.__exit__, None, None, None)


def prometheus_config(admin_url: str) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml, made to scrape and evaluate every half second, with
    its gateway job pointed at the running gateway's admin listener."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"].update(scrape_interval="500ms", scrape_timeout="500ms", evaluation_interval="500ms")
    config["rule_files"] = [str(PROMETHEUS_DIR / name) for name in config["rule_files"]]
    (job,) = [job for job in config["scrape_configs"] if job["job_name"] == "gateway"]
    job["static_configs"] = [{"targets": [admin_url.removeprefix("http://")]}]
    return config


class Traffic:
    """Rounds of requests: a `flood` client over its limit and a new client on /open, a new
    client each on /closed and /local and the unlimited route, two requests of one client
    at once on /paced (the second is delayed) and one of an allowlisted client, three of one
    client at once on /slow (held 20 ms upstream: two are admitted, one is concurrency
    limited), one on each pool, a client that sends a request for the pool's slow path
    and hangs up before the answer; and beside them, Traefik's question about a new
    client's request to /closed, and Envoy's about a new client."""

    def __init__(self, client: aiohttp.ClientSession, url: str, decision_url: str, rls: Any) -> None:
        self._client, self._url = client, url
        self._decision_url, self._rls = decision_url, rls
        self._clients = itertools.count()
        self.statuses: collections.Counter[tuple[str, int]] = collections.Counter()
        self.hung_up = 0

    async def _get(self, path: str, key: str | None) -> None:
        headers = {"X-API-Key": key} if key else {}
        async with self._client.get(self._url + path, headers=headers) as response:
            await response.read()
            self.statuses[path, response.status] += 1

    async def _hang_up(self, path: str) -> None:
        """Send GET `path` on a connection of its own and close it without reading."""
        parts = urlsplit(self._url)
        _, writer = await asyncio.open_connection(parts.hostname, parts.port)
        writer.write(f"GET {path} HTTP/1.1\r\nHost: gateway\r\n\r\n".encode())
        await writer.drain()
        writer.close()
        await writer.wait_closed()
        self.hung_up += 1

    async def _decide(self, path: str, key: str) -> None:
        """Traefik's ForwardAuth question about GET `path` from client `key`."""
        headers = {"X-Forwarded-Method": "GET", "X-Forwarded-Uri": path, "X-Forwarded-Host": "gateway", "X-API-Key": key}
        async with self._client.get(self._decision_url + "/decide/traefik", headers=headers) as response:
            await response.read()
            self.statuses["decide " + path, response.status] += 1

    async def _should_rate_limit(self, key: str) -> None:
        entry = ratelimit_pb2.RateLimitDescriptor.Entry(key="client", value=key)
        request = rls_pb2.RateLimitRequest(domain="beside", descriptors=[ratelimit_pb2.RateLimitDescriptor(entries=[entry])])
        response = await self._rls.ShouldRateLimit(request)
        self.statuses["rls beside", response.overall_code] += 1

    async def round(self) -> None:
        fresh = f"client-{next(self._clients)}"
        await asyncio.gather(
            self._get("/open/a", "flood"), self._get("/open/a", fresh), self._get("/closed/a", fresh),
            self._get("/local/a", fresh), self._get("/free", None),
            self._get("/paced/a", "pacer"), self._get("/paced/a", "pacer"), self._get("/paced/a", "ops-key"),
            *(self._get("/slow?seconds=0.02", "holder") for _ in range(3)),
            self._get("/pool/a", None), self._get("/down/a", None), self._hang_up("/pool/slow?seconds=5"),
            self._decide("/closed/a", fresh), self._should_rate_limit(fresh),
        )


async def empty_queries(prom: PrometheusServer, client: aiohttp.ClientSession, exprs: list[str]) -> list[str]:
    return [expr for expr in exprs if not await prom.query(client, expr)]


async def drive_until(
    traffic: Traffic, prom: PrometheusServer, client: aiohttp.ClientSession, exprs: list[str], what: str
) -> None:
    """Send rounds of requests, 20 ms apart, until Prometheus answers every one of `exprs`."""
    end = time.monotonic() + PHASE_DEADLINE
    next_look = 0.0
    while True:
        await traffic.round()
        if time.monotonic() >= next_look:
            empty = await empty_queries(prom, client, exprs)
            if not empty:
                return
            assert time.monotonic() < end, f"Prometheus never showed {what}: no series for {empty}"
            next_look = time.monotonic() + 0.25
        await asyncio.sleep(0.02)


def increased(selector: str) -> str:
    return f"increase({selector}[1m]) > 0"


_METRIC = re.compile(r"\bgateway_[a-z0-9_]+\b")
_SELECTOR = re.compile(r"\b(gateway_[a-z0-9_]+)\s*\{([^}]*)\}")
_MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"')
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


async def problems(prom: PrometheusServer, client: aiohttp.ClientSession, expr: str, labels: set[str]) -> list[str]:
    """What is wrong with `expr` against what the gateway exported: no series at all, a
    metric never scraped, a label value no series carries, or grouping by a label no
    series has (each of which a query could hide behind an `or`, a regex or a `by`)."""
    found = []
    if not await prom.query(client, expr):
        found.append("no series")
    for name in sorted(set(_METRIC.findall(expr))):
        if not await prom.query(client, f'count({{__name__="{name}"}})'):
            found.append(f"{name} is not exported")
    for name, matchers in _SELECTOR.findall(expr):
        for label, op, value in _MATCHER.findall(matchers):
            if op not in ("=", "=~") or not re.fullmatch(r"[\w/:.-]+(\|[\w/:.-]+)*", value):
                continue  # a negation, or a pattern such as .*: nothing to look up
            for one in value.split("|"):
                if not await prom.query(client, f'count({name}{{{label}="{one}"}})'):
                    found.append(f'no {name} has {label}="{one}"')
    for grouping in _GROUPING.findall(expr):
        for label in (part.strip() for part in grouping.split(",")):
            if label and label not in labels:
                found.append(f"no series has the label {label!r}")
    return found


async def all_problems(
    prom: PrometheusServer, client: aiohttp.ClientSession, queries: list[tuple[str, str]]
) -> dict[str, list[str]]:
    labels = set(await prom.api(client, "labels"))
    found = {}
    for where, expr in queries:
        wrong = await problems(prom, client, expr, labels)
        if wrong:
            found[f"{where}: {expr}"] = wrong
    return found


async def test_every_dashboard_and_alert_query_answers_from_a_real_prometheus_scraping_a_real_gateway(upstream, tmp_path):
    dashboard_exprs = dashboard_queries()
    rules = alert_rules()
    alert_exprs = [(f"alert {rule['alert']}", rule["expr"].strip()) for rule in rules]
    started = time.monotonic()
    (tmp_path / "beside.yaml").write_text(RLS_CONFIG)
    beside = (free_port(), free_port(), tmp_path)
    async with PoolTarget() as target_a, PoolTarget() as target_b, PoolTarget() as lone:
        with RedisServer() as redis:
            gateway = GatewayProcess(gateway_yaml(upstream, redis.url, (target_a.url, target_b.url), lone.url, beside))
            gateway.decision_url = f"http://127.0.0.1:{beside[0]}"
            gateway.rls_target = f"127.0.0.1:{beside[1]}"
            async with off_the_loop(gateway) as gw, off_the_loop(PrometheusServer(prometheus_config(gw.admin_url))) as prom:
                traffic, states, values, caught = await scenario(
                    gw, prom, redis, (target_a, lone), dashboard_exprs, rules, alert_exprs
                )
    print(f"\nDEPLOY-PROOF {len(dashboard_exprs)} dashboard queries and {len(alert_exprs)} alert rules answered; "
          f"alert states {states}; alert values {values}; requests {dict(traffic.statuses)}, hung up {traffic.hung_up}; "
          f"canaries caught {len(caught)}; {time.monotonic() - started:.1f} s")


async def scenario(
    gw: GatewayProcess,
    prom: PrometheusServer,
    redis: RedisServer,
    stopped: tuple[PoolTarget, PoolTarget],
    dashboard_exprs: list[tuple[str, str]],
    rules: list[dict[str, Any]],
    alert_exprs: list[tuple[str, str]],
) -> tuple[Traffic, dict[str, str], dict[str, list[float]], dict[str, list[str]]]:
    """The traffic, its phases and the checks of every query; what it found, for the report.
    `stopped`: the pool target stopped midway (pool-a) and the one-target pool's (down-a)."""
    async with aiohttp.ClientSession() as client, grpc.aio.insecure_channel(gw.rls_target) as channel:
        traffic = Traffic(client, gw.url, gw.decision_url, rls_pb2_grpc.RateLimitServiceStub(channel))
        # Every counter is first seen at its starting value, so that increases are seen.
        await drive_until(traffic, prom, client, ["gateway_config_reload_failures_total == 0"], "a first scrape")

        # Healthy: allowed, limited (429) and shadow-limited, delayed, allowlisted and
        # concurrency limited, both pool targets in rotation, clients hanging up; each seen to grow.
        await drive_until(traffic, prom, client, [
            increased('gateway_limiter_decisions_total{decision="allow"}'),
            increased('gateway_limiter_decisions_total{decision="deny"}'),
            increased('gateway_limiter_decisions_total{decision="shadow_limited"}'),
            increased('gateway_limiter_decisions_total{limit="paced",decision="delayed"}'),
            increased('gateway_limiter_decisions_total{limit="paced",decision="allowlisted"}'),
            increased('gateway_limiter_decisions_total{limit="conns",decision="concurrency_limited"}'),
            increased("gateway_limiter_delay_seconds_count"),
            'max_over_time(gateway_concurrency_in_flight{limit="conns"}[1m]) == 2',
            increased("gateway_upstream_latency_seconds_count"),
            increased('gateway_upstream_target_requests_total{target="pool-a"}'),
            increased('gateway_upstream_target_requests_total{target="pool-b"}'),
            'gateway_upstream_target_healthy{target="pool-a"} == 1',
            'gateway_upstream_target_healthy{target="pool-b"} == 1',
            increased('gateway_client_closed_requests_total{route="/pool"}'),
            increased('gateway_upstream_target_requests_total{target="down-a"}'),
            increased('gateway_decision_requests_total{mode="traefik",status="200"}'),
            increased('gateway_rls_descriptors_total{domain="beside",decision="allow"}'),
        ], "allowed, limited, shadow-limited, delayed, allowlisted and concurrency-limited decisions, the pool, hang-ups, "
           "and decisions beside a proxy")
        assert traffic.statuses["/open/a", 429] > 0
        assert traffic.statuses["/slow?seconds=0.02", 429] > 0
        assert traffic.statuses["/paced/a", 429] == 0  # the wait never passes max_delay
        # Every target in rotation: nothing was answered 503 for want of one.
        assert not await prom.query(client, "gateway_upstream_unavailable_total > 0")
        assert traffic.statuses["/down/a", 503] == 0

        # One target of the two-target pool stopped: connect errors, each retried on the
        # other target, until two in a row eject it and its health checks take it out of
        # rotation. The one-target pool's target too: once it is ejected, /down answers 503.
        for target in stopped:
            await target.stop()
        await drive_until(traffic, prom, client, [
            'gateway_upstream_target_errors_total{target="pool-a",kind="connect"} > 0',
            increased('gateway_upstream_target_ejections_total{target="pool-a"}'),
            increased('gateway_upstream_retries_total{route="/pool"}'),
            'gateway_upstream_target_healthy{target="pool-a"} == 0',
            'gateway_upstream_target_healthy{target="pool-b"} == 1',
            'gateway_upstream_target_healthy{target="down-a"} == 0',
            increased('gateway_upstream_unavailable_total{route="/down",reason="no_target"}'),
        ], "stopped pool targets: errors, retries, ejections, failed health checks, a route with no target")
        pool_answers = {status for (path, status) in traffic.statuses if path == "/pool/a"}
        assert 200 in pool_answers and pool_answers <= {200, 502}, pool_answers
        down_answers = {status for (path, status) in traffic.statuses if path == "/down/a"}
        assert {200, 503} <= down_answers <= {200, 502, 503}, down_answers

        # Redis stopped: checks time out, each failure policy answers, the breaker opens.
        redis.pause()
        try:
            await drive_until(traffic, prom, client, [
                increased('gateway_limiter_decisions_total{decision="fail_open"}'),
                increased('gateway_limiter_decisions_total{decision="fail_closed"}'),
                increased('gateway_limiter_decisions_total{decision="fail_local"}'),
                'max_over_time(gateway_store_breaker{state="open"}[1m]) == 1',
                increased("gateway_concurrency_lease_release_failures_total"),
                increased('gateway_decision_requests_total{mode="traefik",status="503"}'),
                increased('gateway_rls_descriptors_total{domain="beside",decision="fail_closed"}'),
            ], "failure-policy decisions, an open breaker, leases that could not be released, and undecided questions")
        finally:
            redis.resume()
        assert traffic.statuses["/closed/a", 503] > 0
        assert traffic.statuses["decide /closed/a", 503] > 0
        assert traffic.statuses["rls beside", rls_pb2.RateLimitResponse.Code.OVER_LIMIT] > 0
        # Redis back: decisions resume and the breaker closes again.
        await drive_until(traffic, prom, client, ['gateway_store_breaker{state="closed"} == 1'], "the breaker closed")

        # A bad config on SIGHUP: refused, counted, the old config serves on.
        gw.config_path.write_text("routes: [{match: {path: /}, upstream: 'not a url'}]\n")
        gw.signal(signal.SIGHUP)
        await drive_until(traffic, prom, client, [increased("gateway_config_reload_failures_total")], "a failed reload")
        assert gw.process.poll() is None

        # Every dashboard query and every alert expression, thresholds included, answers;
        # the rules Prometheus loaded have every alert pending (its `for:` running) or firing.
        queries = dashboard_exprs + alert_exprs
        end = time.monotonic() + QUERY_DEADLINE
        while True:
            found = await all_problems(prom, client, queries)
            alerts = (await prom.api(client, "alerts"))["alerts"]
            states = {alert["labels"]["alertname"]: alert["state"] for alert in alerts}
            silent = sorted(rule["alert"] for rule in rules if states.get(rule["alert"]) not in ("pending", "firing"))
            if (not found and not silent) or time.monotonic() > end:
                break
            await asyncio.sleep(0.25)
        assert found == {}, "queries that do not answer from the gateway's metrics:\n" + "\n".join(
            f"  {where}: {wrong}" for where, wrong in found.items()
        )
        assert silent == [], f"alerts Prometheus neither has pending nor firing: {silent} (states: {states})"
        assert states["GatewayConfigReloadFailed"] == "firing"  # `for: 0m`
        # The stopped targets alone are out of rotation, the route down is the one whose pool
        # has none left (not /pool, which has pool-b), and the hang-ups are those on /pool.
        def labelled(alertname: str, label: str) -> set[str]:
            return {a["labels"][label] for a in alerts if a["labels"]["alertname"] == alertname}

        assert labelled("GatewayUpstreamTargetUnhealthy", "target") == {"pool-a", "down-a"}
        assert labelled("GatewayUpstreamPoolDown", "route") == {"/down"}
        assert labelled("GatewayClientAbortsHigh", "route") == {"/pool"}

        # The check itself catches a query on a metric or a label value the gateway does not
        # export, also when an `or` or a regex would have given it a series.
        canaries = [
            ("a misspelt metric", "sum(rate(gateway_request_total[1m]))"),
            ("a decision the gateway never makes", 'sum(rate(gateway_limiter_decisions_total{decision=~"allow|limited"}[1m]))'),
            ("a hidden metric", "sum(rate(gateway_store_errors_total[1m])) or vector(0)"),
            ("a label no series has", "sum by (status_code) (rate(gateway_requests_total[1m]))"),
        ]
        caught = await all_problems(prom, client, canaries)
        assert len(caught) == len(canaries), caught
        values = {where: [float(series["value"][1]) for series in await prom.query(client, expr)] for where, expr in alert_exprs}
    return traffic, states, values, caught


# --- a quiet gateway: 0, not "No data" ----------------------------------------------------------


def quiet_gateway_yaml(upstream: str, redis_url: str, pool: str | None) -> str:
    """A limit of each failure policy, a shadow limit, a shaping limit with an allowlist and
    a concurrency limit, and, given `pool`, a checked pool of that one target."""
    pooled = (
        f"""  - match: {{path: /pool}}
    strip_prefix: true
    upstream:
      targets: [{{url: "{pool}", name: quiet-a}}]
      health: {{path: /healthz, interval: 500ms, timeout: 200ms}}
      retries: 1
"""
        if pool
        else ""
    )
    return f"""\
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
store: {{url: "{redis_url}"}}
limits:
  per_client: {{rate: 100/second, burst: 100, key: [header:X-API-Key, ip], on_store_error: open}}
  would_cap: {{rate: 100/second, burst: 100, key: [header:X-API-Key, ip], shadow: true}}
  strict: {{rate: 100/second, burst: 100, key: [header:X-API-Key, ip], on_store_error: closed}}
  spread: {{rate: 100/second, burst: 100, key: [header:X-API-Key, ip], on_store_error: local}}
  paced: {{rate: 100/second, burst: 100, mode: delay, max_delay: 100ms, key: [header:X-API-Key, ip], allow: ["header:X-API-Key=ops-key"]}}
  conns: {{concurrency: 10, key: [header:X-API-Key, ip]}}
routes:
  - {{match: {{path: /open}}, upstream: "{upstream}", limits: [per_client, would_cap]}}
  - {{match: {{path: /closed}}, upstream: "{upstream}", limits: [strict]}}
  - {{match: {{path: /local}}, upstream: "{upstream}", limits: [spread]}}
  - {{match: {{path: /paced}}, upstream: "{upstream}", limits: [paced]}}
  - {{match: {{path: /slow}}, upstream: "{upstream}", limits: [conns]}}
{pooled}  - {{match: {{path: /}}, upstream: "{upstream}"}}
"""


async def test_every_dashboard_panel_reads_a_value_on_gateways_that_saw_no_failure(upstream):
    """Two gateways, one without a pool and one with, each given a few requests that every
    limit allows and no failure: every panel query of the dashboard, for either gateway's
    instance, returns a series. Each series the config makes known is exported at 0 (each
    limit's decisions by its failure policy, each route's 503 reasons and hang-ups, each
    target's error kinds), and the pool panels of the gateway without a pool read 0."""
    paths = ["/open/a", "/closed/a", "/local/a", "/paced/a", "/slow/a", "/free"]
    async with PoolTarget() as target:
        with RedisServer() as redis:
            plain = GatewayProcess(quiet_gateway_yaml(upstream, redis.url, None))
            pooled = GatewayProcess(quiet_gateway_yaml(upstream, redis.url, target.url))
            async with off_the_loop(plain) as gw_plain, off_the_loop(pooled) as gw_pool:
                config = prometheus_config(gw_plain.admin_url)
                (job,) = [job for job in config["scrape_configs"] if job["job_name"] == "gateway"]
                job["static_configs"][0]["targets"].append(gw_pool.admin_url.removeprefix("http://"))
                async with off_the_loop(PrometheusServer(config)) as prom, aiohttp.ClientSession() as client:
                    for gw, extra in ((gw_plain, []), (gw_pool, ["/pool/a"])):
                        for path in paths + extra:
                            async with client.get(gw.url + path, headers={"X-API-Key": "quiet"}) as response:
                                assert response.status == 200, (path, response.status)
                    board = dashboard()
                    empty: dict[str, list[str]] = {}
                    end = time.monotonic() + QUERY_DEADLINE
                    while True:
                        for gw in (gw_plain, gw_pool):
                            instance = gw.admin_url.removeprefix("http://")
                            variables = {**dashboard_variables(board), "instance": instance}
                            queries = [
                                (panel["title"], substitute(t["expr"], variables))
                                for panel in all_panels(board["panels"])
                                for t in panel.get("targets", [])
                            ]
                            empty[instance] = [
                                title for title, expr in queries if not await prom.query(client, expr)
                            ]
                        if not any(empty.values()) or time.monotonic() > end:
                            break
                        await asyncio.sleep(0.25)
    assert not any(empty.values()), f"panels with no series, by instance: {empty}"
