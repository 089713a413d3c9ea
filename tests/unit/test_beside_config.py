"""The config of the listeners beside a proxy, as `gateway check` shows it and as it is
refused: the decision listener and its paths, and every rate limit of Envoy's rate-limit
service by its descriptor's path, with its unit, algorithm, failure policy, shadow mode,
quota mode, shared bucket and replaces; a decision listener no proxy may ask (no
trusted_proxies) is a config error. The `rls_config` files: text fields read as
envoyproxy/ratelimit reads them, and each error naming the file it is in, a file nested
too deeply included.
"""

from __future__ import annotations

import textwrap

import pytest

from gateway.config import ConfigError, parse_config
from tests.load.test_envoy_rls import EXAMPLES
from tests.processes import run_cli


def test_gateway_check_lists_the_decision_listener_and_every_rls_rate_limit(tmp_path):
    rls_dir = tmp_path / "rls"
    rls_dir.mkdir()
    for name in ("messaging.yaml", "replaces.yaml"):  # envoyproxy/ratelimit's README examples
        (rls_dir / name).write_text(textwrap.dedent(EXAMPLES[name]))
    (rls_dir / "strict.yaml").write_text(
        "domain: strict\ndescriptors: [{key: k, on_store_error: closed, rate_limit: {unit: second, requests_per_unit: 1}}]\n"
    )
    (rls_dir / "new.yaml").write_text(textwrap.dedent("""
        domain: new
        descriptors:
          - {key: files, value: 'files/*', share_threshold: true, rate_limit: {unit: hour, requests_per_unit: 10}}
          - {key: service, value: s1, quota_mode: true, metadata: {tier: gold}, rate_limit: {unit: minute, requests_per_unit: 1}}
          - {key: banned, detailed_metric: true, value_to_metric: true, rate_limit: {unit: minute, requests_per_unit: 0}}
    """))
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
    start = lines.index(f"envoy rate-limit service 127.0.0.1:8081: 4 domain(s) from {rls_dir}")
    assert lines[start + 1] == "  domain messaging:"
    assert sorted(lines[start + 2 : start + 7]) == sorted([
        "    message_type_marketing > to_number: 2/day, fixed window, on_store_error open",
        "    to_number: 4/day, token bucket, on_store_error open",
        "    key1_prefix*: 1/minute, token bucket, on_store_error open",
        "    bay: unlimited",
        "    tenant_loud: 1/minute, token bucket, on_store_error open, shadow mode",
    ]), lines[start:]
    assert lines[start + 7 : start + 11] == [
        "  domain new:",
        "    files_files/*: 10/hour, token bucket, on_store_error open, one bucket for all values of files_files/*",
        "    service_s1: 1/minute, token bucket, on_store_error open, quota mode",
        "    banned: 0/minute, token bucket (always over the limit), on_store_error open",
    ], lines[start:]
    assert lines[start + 11 : start + 17] == [
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


def _rls(tmp_path, text: str, extra: str = ""):
    (tmp_path / "r.yaml").write_text(text)
    return parse_config(
        f"rls_listen: 127.0.0.1:0\nrls_config: {tmp_path}\n{extra}routes: [{{match: {{path: /}}, upstream: 'http://127.0.0.1:9'}}]\n",
        source="gw.yaml",
        environ={},
    )


@pytest.mark.parametrize(
    ("written", "read"),
    [("5", "5"), ("05", "05"), ("0x1F", "0x1F"), ("true", "true"), ("yes", "yes"), ("2024-01-31", "2024-01-31"), ("'1.5'", "1.5")],
)
def test_a_scalar_value_is_read_as_its_text_as_envoyproxy_ratelimit_reads_it(tmp_path, written, read):
    config = _rls(tmp_path, f"domain: 7\ndescriptors: [{{key: 10, value: {written}, rate_limit: {{unit: Second, requests_per_unit: 3}}}}]\n")
    assert list(config.rls.domains) == ["7"]
    assert list(config.rls.domains["7"].children) == [f"10_{read}"]


@pytest.mark.parametrize("written", ["null", "''", "~"])
def test_a_null_or_empty_value_is_no_value(tmp_path, written):
    config = _rls(tmp_path, f"domain: d\ndescriptors: [{{key: k, value: {written}, rate_limit: {{unit: second, requests_per_unit: 3}}}}]\n")
    assert list(config.rls.domains["d"].children) == ["k"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("domain: d\ndescriptors: [{key: k, value: 1.5}]\n", "r.yaml: descriptors[0].value: a number with a fraction (1.5) is refused"),
        ("domain: d\ndescriptors: [{key: ''}]\n", "r.yaml: descriptors[0].key: must not be empty"),
        ("domain: ''\n", "r.yaml: domain: must not be empty"),
        ("", "r.yaml: the file is empty; it needs a domain"),
        ("domain: d\ndescriptors: [{key: k, 5: x}]\n", "r.yaml: descriptors[0]: a key must be text, got an integer 5"),
        ("domain: d\ndescriptors: [{key: k, metadata: [a]}]\n", "r.yaml: descriptors[0].metadata: expected a mapping, got a list"),
        ("domain: d\ndescriptors: [{key: k, share_threshold: yes please}]\n", "r.yaml: descriptors[0].share_threshold: expected true or false"),
        ("domain: d\ndescriptors: [{key: k, on_store_error: closed}]\n", "r.yaml: descriptors[0].on_store_error: applies to a descriptor's rate_limit"),
        ("domain: d\ndescriptors: [{key: k, rate_limit: {unlimited: true, algorithm: fixed_window}}]\n",
         "r.yaml: descriptors[0].rate_limit.algorithm: an unlimited rate_limit counts nothing"),
        ("domain: d\ndescriptors: [{key: k, rate_limit: {unit: second, requests_per_unit: 4294967296}}]\n",
         "r.yaml: descriptors[0].rate_limit.requests_per_unit: expected an integer <= 4,294,967,295"),
        ("domain: d\ndescriptors: " + "[" * 3000 + "]" * 3000 + "\n", "r.yaml: nested too deeply"),
        ("domain: d\ndescriptors:\n" + "".join(f"{'  ' * i}- key: k{i}\n{'  ' * i}  descriptors:\n" for i in range(600)), "r.yaml: nested too deeply"),
    ],
)
def test_an_rls_config_file_error_names_that_file_and_its_yaml_path(tmp_path, text, expected):
    with pytest.raises(ConfigError) as error:
        _rls(tmp_path, text)
    message = str(error.value)
    assert message.startswith(f"{tmp_path}/{expected}"), message
    assert "\n" not in message and "gw.yaml" not in message


def test_an_unlimited_rate_limit_lets_requests_per_unit_be_as_the_reference_does(tmp_path):
    config = _rls(tmp_path, "domain: d\ndescriptors: [{key: k, rate_limit: {unlimited: true, requests_per_unit: 25}}]\n")
    assert config.rls.domains["d"].children["k"].rate_limit.limit is None


def test_rls_merge_domains_needs_rls_config():
    with pytest.raises(ConfigError, match=r"gw\.yaml: rls_merge_domains: applies to the files of rls_config"):
        parse_config("rls_merge_domains: true\nroutes: [{match: {path: /}, upstream: 'http://127.0.0.1:9'}]\n", source="gw.yaml", environ={})
