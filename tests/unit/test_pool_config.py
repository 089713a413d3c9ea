"""`upstream:` as a pool: parsed into frozen typed objects, or refused with one line naming
the YAML path."""

import pytest

from gateway.config import GatewayConfig, parse_config
from gateway.config.pool_model import Balance, HealthCheck, PassiveEjection, Target, UpstreamPool
from tests.helpers import SOURCE, error_of
from tests.processes import run_cli

ISSUE_POOL = """
routes:
  - match: {path: /api}
    upstream:
      targets: [http://10.0.0.5:9000, {url: http://10.0.0.6:9000, weight: 2}]
      balance: round_robin
      health: {path: /healthz, interval: 5s, timeout: 1s, unhealthy_after: 3, healthy_after: 2}
      passive: {eject_after: 5, eject_for: 30s}
      retries: 2
    timeout: {total: 10s}
"""


def parse(text: str) -> GatewayConfig:
    return parse_config(text, source=SOURCE, environ={})


def pool_route(pool: str, path: str = "/") -> str:
    return f"  - match: {{path: {path}}}\n    upstream:\n" + "".join(f"      {line}\n" for line in pool.strip().splitlines())


def test_the_issue_example_parses_into_a_pool():
    route = parse(ISSUE_POOL).routes[0]
    assert route.upstream == UpstreamPool(
        targets=(
            Target(url="http://10.0.0.5:9000", name="10.0.0.5:9000", weight=1),
            Target(url="http://10.0.0.6:9000", name="10.0.0.6:9000", weight=2),
        ),
        balance=Balance.ROUND_ROBIN,
        health=HealthCheck(path="/healthz", interval=5.0, timeout=1.0, unhealthy_after=3, healthy_after=2),
        passive=PassiveEjection(eject_after=5, eject_for=30.0),
        retries=2,
    )
    assert route.timeout.total == 10.0


def test_a_pool_has_defaults_and_a_url_stays_a_url():
    config = parse("routes:\n" + pool_route("targets: [http://a:1/, 'https://b']") + "  - match: {path: /x}\n    upstream: http://c:3/\n")
    pool = config.routes[0].upstream
    assert pool == UpstreamPool(
        targets=(Target(url="http://a:1", name="a:1"), Target(url="https://b", name="b:443")),
        balance=Balance.ROUND_ROBIN,
        health=None,
        passive=PassiveEjection(eject_after=5, eject_for=30.0),
        retries=1,
    )
    assert config.routes[1].upstream == "http://c:3"
    assert config.routes[1].timeout.total is None


def test_a_target_name_labels_it_and_passive_off_turns_ejection_off():
    pool = parse("routes:\n" + pool_route("targets: [{url: http://a:1, name: blue}]\npassive: off")).routes[0].upstream
    assert pool.targets[0].name == "blue" and pool.passive is None


def test_routes_may_share_a_pool_by_anchor():
    text = "routes:\n  - match: {path: /a}\n    upstream: &pool {targets: [http://a:1, http://b:2], health: {path: /h}}\n" \
        "  - match: {path: /b}\n    upstream: *pool\n"
    config = parse(text)
    assert config.routes[0].upstream == config.routes[1].upstream


@pytest.mark.parametrize(
    ("pool", "expected"),
    [
        ("targets: []", "routes[0].upstream.targets: expected at least one target"),
        ("targets: [ftp://a:1]", "routes[0].upstream.targets[0]: expected an http:// or https:// URL"),
        ("targets: [{url: http://a:1, weight: 0}]", "routes[0].upstream.targets[0].weight: expected an integer >= 1"),
        ("targets: [{url: http://a:1, name: 'a b'}]", "routes[0].upstream.targets[0].name: target names may use"),
        ("targets: [{url: http://a:1, port: 2}]", "routes[0].upstream.targets[0].port: unknown key"),
        ("targets: ['http://[zz]:1']", "routes[0].upstream.targets[0]: not a URL ('zz' does not appear to be an IPv4 or IPv6 address)"),
        ("targets: [http://a:1, http://a:1/]", "routes[0].upstream.targets[1]: http://a:1 is listed twice"),
        ("targets: [http://a:1]\nbalance: fastest", "routes[0].upstream.balance: expected round_robin, least_requests"),
        ("targets: [http://a:1]\nretries: -1", "routes[0].upstream.retries: expected an integer >= 0"),
        ("targets: [http://a:1]\nhealth: {interval: 5s}", "routes[0].upstream.health.path: required key is missing"),
        ("targets: [http://a:1]\nhealth: {path: healthz}", "routes[0].upstream.health.path: expected a path starting with /"),
        (
            "targets: [http://a:1]\nhealth: {path: /h, interval: 1s, timeout: 2s}",
            "routes[0].upstream.health.timeout: a check's timeout (2s) may not exceed its interval (1s)",
        ),
        ("targets: [http://a:1]\nhealth: {path: /h, unhealthy_after: 0}", "routes[0].upstream.health.unhealthy_after: expected an integer >= 1"),
        ("targets: [http://a:1]\npassive: {eject_for: soon}", "routes[0].upstream.passive.eject_for: expected a duration"),
        ("targets: [http://a:1]\nretry: 2", "routes[0].upstream.retry: unknown key"),
    ],
)
def test_a_bad_pool_is_one_line_naming_its_yaml_path(pool, expected):
    assert f"{SOURCE}: {expected}" in error_of("routes:\n" + pool_route(pool))


def test_an_upstream_list_is_refused_with_a_hint():
    assert "routes[0].upstream: expected a URL, or a pool as {targets: [URL, ...]}, got a list" in error_of(
        "routes:\n  - match: {path: /}\n    upstream: [http://a:1]\n"
    )


def test_a_target_has_one_name_and_one_set_of_settings_across_routes():
    named_twice = "routes:\n" + pool_route("targets: [{url: http://a:1, name: x}]") + pool_route("targets: [{url: http://a:1, name: y}]", "/b")
    assert "routes[1].upstream.targets[0]: http://a:1 is named 'x' at routes[0].upstream.targets[0]" in error_of(named_twice)
    name_reused = "routes:\n" + pool_route("targets: [{url: http://a:1, name: x}]") + pool_route("targets: [{url: http://b:1, name: x}]", "/b")
    assert "routes[1].upstream.targets[0]: name 'x' is already http://a:1 at routes[0].upstream.targets[0]" in error_of(name_reused)
    other_settings = "routes:\n" + pool_route("targets: [http://a:1]") + pool_route("targets: [http://a:1]\npassive: {eject_after: 2}", "/b")
    assert "routes[1].upstream.targets[0]: http://a:1 has other health or passive settings at routes[0]" in error_of(other_settings)


def test_same_targets_with_other_weights_or_balance_are_fine():
    text = "routes:\n" + pool_route("targets: [http://a:1, http://b:1]") + pool_route(
        "targets: [{url: http://a:1, weight: 3}]\nbalance: least_requests", "/b"
    )
    assert len(parse(text).routes) == 2


def test_gateway_check_shows_the_pool(tmp_path):
    path = tmp_path / "pool.yaml"
    path.write_text(ISSUE_POOL)
    result = run_cli("check", "-c", str(path))
    assert result.returncode == 0, result.stderr
    assert (
        "/api -> round_robin over http://10.0.0.5:9000, http://10.0.0.6:9000 (weight 2); retries 2; "
        "health /healthz every 5s; eject after 5 failures for 30s:"
    ) in result.stdout
    assert "total 10s" in result.stdout
