"""The config of the listeners beside a proxy, as `gateway check` shows it and as it is
refused: the decision listener and its paths, and every rate limit of Envoy's rate-limit
service by its descriptor's path, with its unit, algorithm, failure policy, shadow mode
and replaces; a decision listener no proxy may ask (no trusted_proxies) is a config error.
"""

from __future__ import annotations

import textwrap

import pytest

from gateway.config import ConfigError, parse_config
from tests.processes import run_cli
from tests.test_envoy_rls import EXAMPLES


def test_gateway_check_lists_the_decision_listener_and_every_rls_rate_limit(tmp_path):
    rls_dir = tmp_path / "rls"
    rls_dir.mkdir()
    for name in ("messaging.yaml", "replaces.yaml"):  # envoyproxy/ratelimit's README examples
        (rls_dir / name).write_text(textwrap.dedent(EXAMPLES[name]))
    (rls_dir / "strict.yaml").write_text(
        "domain: strict\ndescriptors: [{key: k, on_store_error: closed, rate_limit: {unit: second, requests_per_unit: 1}}]\n"
    )
    config = tmp_path / "gateway.yaml"
    config.write_text(
        "decision_listen: 127.0.0.1:8082\ntrusted_proxies: [10.0.0.0/8]\n"
        f"rls_listen: 127.0.0.1:8081\nrls_config: {rls_dir}\n"
        "routes: [{match: {path: /}, upstream: 'http://127.0.0.1:9'}]\n"
    )
    result = run_cli("check", "-c", str(config))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "decision listener 127.0.0.1:8082: /decide/nginx, /decide/traefik, /decide/envoy/<path>" in lines
    start = lines.index(f"envoy rate-limit service 127.0.0.1:8081: 3 domain(s) from {rls_dir}")
    assert lines[start + 1] == "  domain messaging:"
    assert sorted(lines[start + 2 : start + 7]) == sorted([
        "    message_type_marketing > to_number: 2/day, fixed window, on_store_error open",
        "    to_number: 4/day, token bucket, on_store_error open",
        "    key1_prefix*: 1/minute, token bucket, on_store_error open",
        "    bay: unlimited",
        "    tenant_loud: 1/minute, token bucket, on_store_error open, shadow mode",
    ]), lines[start:]
    assert lines[start + 7 : start + 13] == [
        "  domain replaces:",
        "    key1_value1 > subkey1: 1/minute, token bucket, on_store_error open, name subkey_limit",
        "    key2_value2: 3/minute, token bucket, on_store_error open, replaces subkey_limit",
        "  domain strict:",
        "    k: 1/second, token bucket, on_store_error closed",
        "limits:",
    ], lines[start:]


def test_a_decision_listener_without_trusted_proxies_is_refused():
    with pytest.raises(ConfigError, match=r"gw\.yaml: decision_listen: needs trusted_proxies"):
        parse_config(
            "decision_listen: 127.0.0.1:0\nroutes: [{match: {path: /}, upstream: 'http://127.0.0.1:9'}]\n",
            source="gw.yaml",
            environ={},
        )
