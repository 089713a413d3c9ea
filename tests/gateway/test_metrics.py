"""/metrics as prometheus_client would write it: the request path's plain counters,
gauges and histograms (gateway.metrics) give the same exposition, byte for byte but
for the values of `_created`, as prometheus_client's own metrics given the same
increments; and a gateway with several workers, which keeps prometheus_client's
files, exposes the families, series and totals that one process does.

The reference is `Metrics(multiprocess=True)` in this process: prometheus_client's
metrics throughout, in memory, since no PROMETHEUS_MULTIPROC_DIR is set here."""

from __future__ import annotations

import os
import re

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.limiter.circuit_breaker import BreakerState
from gateway.metrics import LIMITER_BUCKETS, UNMATCHED_ROUTE, Children, Metrics, PlainHistogram, breaker_gauge_setter
from gateway.testing import running_gateway
from tests.processes import GatewayProcess, eventually, free_port

_CREATED = re.compile(rb"^(\w+_created(?:\{[^}]*\})?) \S+$", re.MULTILINE)


def masked(registry: CollectorRegistry) -> bytes:
    """The exposition, each `_created` value (a clock reading) replaced by `T`."""
    return _CREATED.sub(rb"\1 T", generate_latest(registry))


def drive(metrics: Metrics) -> None:
    """The same counts, through the same calls the request path makes, on `metrics`."""
    requests = Children(metrics.requests, ("method", "status_class"), route="/api")
    for method, status in (("GET", "2xx"), ("GET", "2xx"), ("POST", "4xx"), ("OTHER", "5xx")):
        requests(method, status).inc()
    Children(metrics.requests, ("method", "status_class"), route=UNMATCHED_ROUTE)("GET", "4xx").inc()
    decisions = Children(metrics.decisions, ("decision",), route="/api", limit="per_key")
    for decision in ("allow", "allow", "deny", "fail_open"):
        decisions(decision).inc()
    # On a bucket's bound, between bounds, past the last (+Inf), and 0.
    for seconds in (0.0002, 0.0003, 0.01, 0.7, 0.0):
        metrics.limiter_latency.observe(seconds)
    metrics.delay.observe(0.3)
    upstream = Children(metrics.upstream_latency, route="/api")
    upstream().observe(0.02)
    upstream().observe(61.0)
    Children(metrics.client_closed, route="/api")().inc()
    for target in ("a", "b"):
        metrics.target_requests.labels(target=target).inc(3)
        metrics.target_latency.labels(target=target).observe(0.05)
        metrics.target_ejections.labels(target=target).inc()
        errors = Children(metrics.target_errors, ("kind",), target=target)
        errors("connect").inc()
        errors("5xx").inc()
    metrics.keep_targets(frozenset({"a", "b"}))
    metrics.keep_targets(frozenset({"b"}))  # a reload dropped `a`: its series go
    metrics.retries.labels(route="/pool").inc()
    Children(metrics.upstream_unavailable, ("reason",), route="/pool")("queue_full").inc()
    metrics.shed.inc()
    metrics.in_flight.inc()
    metrics.in_flight.inc()
    metrics.in_flight.dec()
    conns = metrics.concurrency_in_flight.labels(limit="conns")
    conns.inc()
    breaker_gauge_setter(metrics.store_breaker)(BreakerState.OPEN)
    metrics.target_healthy.labels(target="b").set(1)
    metrics.lease_release_failures.inc()
    metrics.access_log_dropped.inc(2)
    metrics.reload_failures.inc()
    metrics.reload_success.set(1_700_000_000.5)


def test_the_plain_metrics_expose_what_prometheus_clients_own_would():
    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ
    plain, reference = Metrics(), Metrics(multiprocess=True)
    for metrics in (plain, reference):
        drive(metrics)
    assert masked(plain.registry) == masked(reference.registry)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(plain.registry).decode())
        for s in family.samples
    }
    assert samples[("gateway_requests_total", (("method", "GET"), ("route", "/api"), ("status_class", "2xx")))] == 2
    assert samples[("gateway_limiter_latency_seconds_bucket", (("le", "0.0002"),))] == 2  # 0 and the bound itself
    assert samples[("gateway_limiter_latency_seconds_bucket", (("le", "+Inf"),))] == 5
    assert samples[("gateway_upstream_latency_seconds_count", (("route", "/api"),))] == 2
    assert samples[("gateway_requests_in_flight", ())] == 1
    targets = {dict(labels)["target"] for name, labels in samples if name.startswith("gateway_upstream_target_")}
    assert targets == {"b"}
    kinds = {dict(labels)["kind"] for name, labels in samples if name == "gateway_upstream_target_errors_total"}
    assert kinds == {"connect", "5xx"}


def test_a_fresh_gateway_exposes_what_prometheus_clients_own_would():
    # Before any request: the unlabelled series at 0, the labelled families with no series.
    assert masked(Metrics().registry) == masked(Metrics(multiprocess=True).registry)


@given(st.lists(st.one_of(st.sampled_from(LIMITER_BUCKETS), st.floats(0, 2, allow_nan=False)), max_size=50))
def test_a_plain_histogram_files_each_observation_in_the_bucket_prometheus_client_does(observations):
    plain = PlainHistogram("h_seconds", "h", ["route"], buckets=LIMITER_BUCKETS)
    reference = Histogram("h_seconds", "h", ["route"], buckets=LIMITER_BUCKETS, registry=None)
    for seconds in observations:
        plain.labels(route="/").observe(seconds)
        reference.labels(route="/").observe(seconds)

    def samples(metric) -> list[tuple[str, dict[str, str], float]]:
        return [(s.name, s.labels, s.value) for f in metric.collect() for s in f.samples if not s.name.endswith("_created")]

    assert samples(plain) == samples(reference)


COUNTED = """
limits:
  per_key: {rate: 1/hour, burst: 2, key: header:X-Api-Key}
routes:
  - match: {path: /api}
    upstream: UPSTREAM
    limits: [per_key]
  - match: {path: /open}
    upstream: UPSTREAM
"""


async def exchange(client: aiohttp.ClientSession, url: str) -> None:
    """The same requests for each gateway: allowed, denied, unlimited, unmatched."""
    for path, headers in [("/api/x", {"X-Api-Key": "k"})] * 5 + [("/open", {})] * 3 + [("/nowhere", {})]:
        async with client.get(url + path, headers=headers) as response:
            await response.read()


def families(text: str) -> dict[str, tuple[str, str, dict[tuple[str, tuple], float]]]:
    """name -> (type, help, {(sample name, labels): value}), `_created` left out (workers expose none, as before)."""
    return {
        f.name: (f.type, f.documentation, {
            (s.name, tuple(sorted(s.labels.items()))): s.value for s in f.samples if not s.name.endswith("_created")
        })
        for f in text_string_to_metric_families(text)
    }


async def test_with_workers_metrics_show_the_families_series_and_totals_of_one_process(upstream, redis_server):
    text = COUNTED.replace("UPSTREAM", upstream)
    store = f"store: {{url: '{redis_server.url}', prefix: 'one:'}}\n"
    # A connection per request, so the kernel spreads them over both workers.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as client:
        async with running_gateway(store + text) as gw:
            await exchange(client, gw.url)
            async with client.get(gw.admin_url + "/metrics") as response:
                alone = families(await response.text())
        workers = (
            f"workers: 2\nlisten: 127.0.0.1:{free_port()}\nadmin_listen: 127.0.0.1:{free_port()}\n"
            f"store: {{url: '{redis_server.url}', prefix: 'two:'}}\n"
        )
        with GatewayProcess(workers + text) as gw:
            await eventually(lambda: sum("listening on" in line for line in gw.stderr_lines) == 2, what="both workers")
            await exchange(client, gw.url)
            async with client.get(gw.admin_url + "/metrics") as response:
                shared = families(await response.text())
            gw.stop()
    # Only families with a series are in the workers' files, as before.
    assert set(shared) <= set(alone)
    assert {"gateway_requests", "gateway_limiter_decisions", "gateway_upstream_latency_seconds"} <= set(shared)
    for name, (kind, help_text, samples) in shared.items():
        assert (kind, help_text) == alone[name][:2], name
        assert samples.keys() == alone[name][2].keys(), name
    for name in ("gateway_requests", "gateway_limiter_decisions"):
        assert shared[name][2] == alone[name][2]
    assert shared["gateway_upstream_latency_seconds"][2][
        ("gateway_upstream_latency_seconds_count", (("route", "/api"),))
    ] == 2


@pytest.mark.parametrize("disabled", ["True", "false"])
async def test_prometheus_disable_created_series_drops_the_created_series_of_the_gateways_counters(upstream, disabled):
    # As prometheus_client reads it: "true", "1" or "t", in any case, turn them off.
    text = "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\n" + COUNTED.replace("UPSTREAM", upstream)
    with GatewayProcess(text, env={"PROMETHEUS_DISABLE_CREATED_SERIES": disabled}) as gw:
        async with aiohttp.ClientSession() as client:
            await exchange(client, gw.url)
            async with client.get(gw.admin_url + "/metrics") as response:
                exposition = await response.text()
    created = [line for line in exposition.splitlines() if re.match(r"\w+_created[{ ]", line)]
    assert "gateway_requests_total{" in exposition  # the request path's plain counters did count
    if disabled == "True":
        assert created == []
    else:
        names = {line.split("{")[0].split(" ")[0] for line in created}
        assert {"gateway_requests_created", "gateway_limiter_decisions_created", "gateway_upstream_latency_seconds_created"} <= names
