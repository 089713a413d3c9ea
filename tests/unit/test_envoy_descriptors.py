"""The descriptor walk of Envoy's rate-limit service, without gRPC or a store: which rule
a descriptor falls under (gateway.envoy.descriptors), wildcards anywhere in a value,
`replaces`, the bucket identity (`share_threshold`), and how the files map onto gateway
limits (gateway.config.rls). envoyproxy/ratelimit's own config vectors are in
tests/gateway/test_rls_reference_config.py."""

from __future__ import annotations

import textwrap

import pytest

from gateway.admin.config_view import redacted_config
from gateway.config import parse_config
from gateway.config.model import RlsRateLimit
from gateway.config.rls import override_limit
from gateway.envoy.descriptors import identity_of, rate_limit_of, request_over_limit, wildcard_matches, without_replaced

FILE = """
domain: d
descriptors:
  - key: k
    value: exact
    rate_limit: {unit: second, requests_per_unit: 1, name: exact}
  - key: k
    value: pre*
    rate_limit: {unit: second, requests_per_unit: 2}
  - key: k
    value: prefix*
    rate_limit: {unit: second, requests_per_unit: 3}
  - key: k
    rate_limit: {unit: second, requests_per_unit: 4, replaces: [{name: exact}]}
    descriptors:
      - key: inner
        rate_limit: {unit: day, requests_per_unit: 5, algorithm: fixed_window}
  - key: bare
    descriptors:
      - key: leaf
        rate_limit: {unit: minute, requests_per_unit: 6}
"""


def domains(tmp_path):
    (tmp_path / "d.yaml").write_text(textwrap.dedent(FILE))
    config = parse_config(
        f"rls_listen: 127.0.0.1:0\nrls_config: {tmp_path}\nroutes: [{{match: {{path: /}}, upstream: http://a}}]\n",
        source="gw.yaml", environ={},
    )
    assert config.rls is not None
    return config


def count(config, *entries):
    found, _ = rate_limit_of(config.rls.domains, "d", entries)
    return None if found is None else found.requests_per_unit


def test_an_exact_value_wins_then_the_first_wildcard_in_the_files_order_then_the_key_alone(tmp_path):
    config = domains(tmp_path)
    assert count(config, ("k", "exact")) == 1
    assert count(config, ("k", "prex")) == 2
    assert count(config, ("k", "prefix-1")) == 2  # `pre*` comes first, as envoyproxy/ratelimit picks
    assert count(config, ("k", "other")) == 4


@pytest.mark.parametrize(
    ("pattern", "value", "matches"),
    [
        ("foo*", "foo", True),
        ("foo*", "fo", False),
        ("foo*bar", "foobar", True),
        ("foo*bar", "foo-x-bar", True),
        ("foo*bar", "foobarx", False),
        ("foo*bar", "xfoobar", False),
        ("/api*v1", "/api/v1", True),
        ("/api*v1", "/api/v2", False),
        ("a*a", "a", False),  # the prefix and the suffix may not share a character
        ("a*a", "aa", True),
        ("*", "", True),
        ("*x*", "abc", False),
        ("*x*", "axc", True),
        ("a*b*c", "acb", False),  # in order
        ("a*b*c", "abbc", True),
        ("a*bc*c", "abcc", True),
        ("a*bc*c", "abc", False),
        ("svc*ep*rpc", "svceprpc", True),
    ],
)
def test_a_wildcard_matches_any_run_of_characters_anywhere_in_the_value(pattern, value, matches):
    assert wildcard_matches(pattern.split("*"), value) is matches


def test_share_threshold_keys_the_bucket_by_the_pattern_and_other_wildcards_by_the_value(tmp_path):
    (tmp_path / "d.yaml").write_text(textwrap.dedent("""
        domain: d
        descriptors:
          - key: path
            value: /api/*/users
            share_threshold: true
            descriptors:
              - key: user
                rate_limit: {unit: second, requests_per_unit: 1}
          - key: file
            value: f*
            rate_limit: {unit: second, requests_per_unit: 2}
    """))
    config = parse_config(
        f"rls_listen: 127.0.0.1:0\nrls_config: {tmp_path}\nroutes: [{{match: {{path: /}}, upstream: http://a}}]\n",
        source="gw.yaml", environ={},
    )
    domains = config.rls.domains
    one, keyed_one = rate_limit_of(domains, "d", [("path", "/api/v1/users"), ("user", "u")])
    two, keyed_two = rate_limit_of(domains, "d", [("path", "/api/v2/users"), ("user", "u")])
    assert one is two and one.requests_per_unit == 1
    assert keyed_one == keyed_two == [("path", "/api/*/users"), ("user", "u")]
    assert rate_limit_of(domains, "d", [("path", "/api/v2/users"), ("user", "w")])[1][1] == ("user", "w")
    assert rate_limit_of(domains, "d", [("path", "/api/v2/other"), ("user", "u")]) == (None, [("path", "/api/v2/other"), ("user", "u")])
    entries = [("file", "f1")]
    assert rate_limit_of(domains, "d", entries)[1] is entries


def test_the_last_entry_decides_and_a_walk_that_stops_short_matches_nothing(tmp_path):
    config = domains(tmp_path)
    assert count(config, ("k", "other"), ("inner", "x")) == 5
    assert count(config, ("bare", "x")) is None  # a node without a rate_limit
    assert count(config, ("bare", "x"), ("leaf", "y")) == 6
    assert count(config, ("k", "other"), ("nothing", "x")) is None
    assert count(config, ("nope", "x")) is None
    assert rate_limit_of(config.rls.domains, "other-domain", [("k", "exact")])[0] is None


def test_the_mapping_onto_gateway_limits(tmp_path):
    config = domains(tmp_path)
    bucket = rate_limit_of(config.rls.domains, "d", [("k", "other")])[0].limit
    assert (bucket.burst, bucket.rate.per_second, bucket.quota) == (4, 4.0, None)
    window = rate_limit_of(config.rls.domains, "d", [("k", "o"), ("inner", "x")])[0].limit
    assert window.quota is not None and (window.quota.limit, window.quota.per) == (5, "day")
    assert "{" not in window.name and ":" not in window.name


def test_replaces_drops_the_named_limit_only_when_both_apply(tmp_path):
    config = domains(tmp_path)
    exact, _ = rate_limit_of(config.rls.domains, "d", [("k", "exact")])
    replacing, _ = rate_limit_of(config.rls.domains, "d", [("k", "other")])
    assert without_replaced([exact, replacing]) == [None, replacing]
    assert without_replaced([exact, None]) == [exact, None]


def test_identities_of_different_descriptors_never_meet():
    assert identity_of([("a", "b/c")]) != identity_of([("a", "b"), ("c", "")])
    assert identity_of([("a=b", "c")]) != identity_of([("a", "b=c")])


def test_the_admin_config_view_names_the_files_of_the_trees(tmp_path):
    config = domains(tmp_path)
    assert config.rls is not None
    shown = redacted_config(config)["config"]
    assert (shown["rls_config"], shown["rls_merge_domains"]) == (config.rls.config_path, False)


def test_a_request_is_over_its_limit_when_a_plain_descriptor_is_or_every_quota_mode_one_is():
    plain = RlsRateLimit(limit=None, unit="minute", requests_per_unit=1)
    quota = RlsRateLimit(limit=override_limit("d", 1, "minute"), unit="minute", requests_per_unit=1, quota_mode=True)
    unlimited_quota = RlsRateLimit(limit=None, unit="unknown", requests_per_unit=0, quota_mode=True)
    assert request_over_limit([plain, quota], [True, False]) is True
    assert request_over_limit([plain, quota, quota], [False, True, False]) is False
    assert request_over_limit([plain, quota, quota], [False, True, True]) is True
    assert request_over_limit([quota, unlimited_quota], [True, False]) is True  # an unlimited one is no quota
    assert request_over_limit([None, None], [False, False]) is False
