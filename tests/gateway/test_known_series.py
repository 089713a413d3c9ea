"""The series a config makes known are on /metrics at 0 from the start, and go with a reload
that removes their route or limit: each limit's decisions (by its kind and failure policy),
each route's 503 reasons, hang-ups and upstream latency, each pool route's retries and each
target's error kinds. A gateway in one process and one with two workers (prometheus_client's
files, which cannot forget a series) show the same."""

from __future__ import annotations

import signal

import aiohttp

from gateway.config.loader import load_config
from gateway.testing import running_gateway
from tests.processes import GatewayProcess, eventually, free_port
from tests.scrape import scrape

LIMITS = """\
limits:
  open_one: {rate: 1/hour, burst: 3, on_store_error: open}
  closed_one: {rate: 1/hour, burst: 3, on_store_error: closed, shadow: true}
  local_one: {rate: 1/hour, burst: 3, on_store_error: local, mode: delay, max_delay: 100ms, allow: [10.0.0.0/8]}
  conns: {concurrency: 2}
"""


def known_config(upstream: str, *, second_route: bool = True) -> str:
    second = (
        f"""  - match: {{path: /b}}
    upstream: {{targets: [{{url: "{upstream}", name: tb}}], retries: 1}}
    limits: [local_one, conns]
"""
        if second_route
        else ""
    )
    return f"""{LIMITS}routes:
  - match: {{path: /a}}
    upstream: {upstream}
    limits: [open_one, closed_one]
{second}"""


def series(samples, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {tuple(sorted(s.labels.items())): s.value for s in samples if s.name == name}


EXPECTED_DECISIONS = {
    ("/a", "open_one"): {"allow", "deny", "fail_open"},
    ("/a", "closed_one"): {"allow", "shadow_limited", "fail_closed"},
    ("/b", "local_one"): {"allow", "deny", "delayed", "allowlisted", "fail_local"},
    ("/b", "conns"): {"allow", "concurrency_limited", "fail_open"},
}


def decisions_by_route_and_limit(samples) -> dict[tuple[str, str], set[str]]:
    found: dict[tuple[str, str], set[str]] = {}
    for labels, count in series(samples, "gateway_limiter_decisions_total").items():
        labels = dict(labels)
        assert count == 0, labels
        found.setdefault((labels["route"], labels["limit"]), set()).add(labels["decision"])
    return found


def check_fresh(samples) -> None:
    assert decisions_by_route_and_limit(samples) == EXPECTED_DECISIONS
    unavailable = series(samples, "gateway_upstream_unavailable_total")
    assert unavailable == {
        (("reason", "queue_full"), ("route", "/a")): 0,
        (("reason", "queue_full"), ("route", "/b")): 0,
        (("reason", "no_target"), ("route", "/b")): 0,  # only a pool can have no target in rotation
    }
    assert set(series(samples, "gateway_client_closed_requests_total")) == {(("route", "/a"),), (("route", "/b"),)}
    assert set(series(samples, "gateway_upstream_latency_seconds_count")) == {(("route", "/a"),), (("route", "/b"),)}
    assert series(samples, "gateway_upstream_retries_total") == {(("route", "/b"),): 0}
    kinds = {dict(labels)["kind"] for labels in series(samples, "gateway_upstream_target_errors_total")}
    assert kinds == {"connect", "reset", "timeout", "5xx"}


def check_reloaded(samples) -> None:
    """After a reload that removed /b and its limits: their series are gone, /a's kept."""
    assert decisions_by_route_and_limit(samples) == {k: v for k, v in EXPECTED_DECISIONS.items() if k[0] == "/a"}
    assert {dict(labels)["route"] for labels in series(samples, "gateway_upstream_unavailable_total")} == {"/a"}
    assert set(series(samples, "gateway_client_closed_requests_total")) == {(("route", "/a"),)}
    assert series(samples, "gateway_upstream_retries_total") == {}
    assert [s for s in samples if s.name.startswith("gateway_upstream_target_")] == []
    assert not any(s.labels.get("limit") in ("local_one", "conns") for s in samples)


async def test_a_config_exports_its_known_series_at_0_and_a_reload_drops_those_it_removed(upstream, tmp_path):
    path = tmp_path / "gateway.yaml"
    path.write_text(known_config(upstream))
    async with running_gateway(load_config(str(path))) as gateway, aiohttp.ClientSession() as client:
        check_fresh((await scrape(client, gateway.admin_url))[1])
        path.write_text(known_config(upstream, second_route=False))
        assert gateway.gateway.reload()
        check_reloaded((await scrape(client, gateway.admin_url))[1])


async def test_with_workers_the_known_series_are_at_0_and_a_reload_drops_those_it_removed(upstream, redis_server):
    ports = f"listen: 127.0.0.1:{free_port()}\nadmin_listen: 127.0.0.1:{free_port()}\n"
    head = f"workers: 2\nstore: {{url: '{redis_server.url}'}}\n{ports}"
    async with aiohttp.ClientSession() as client:
        with GatewayProcess(head + known_config(upstream)) as gateway:
            await eventually(lambda: sum("listening on" in line for line in gateway.stderr_lines) == 2, what="both workers")
            check_fresh((await scrape(client, gateway.admin_url))[1])
            gateway.config_path.write_text(head + known_config(upstream, second_route=False))
            gateway.signal(signal.SIGHUP)
            await eventually(lambda: sum("config reloaded" in line for line in gateway.stderr_lines) == 2, what="both reloaded")
            check_reloaded((await scrape(client, gateway.admin_url))[1])
