"""The descriptor walk of Envoy's rate-limit service, without gRPC or a store: which rule
a descriptor falls under (gateway.envoy.descriptors), `replaces`, the bucket identity, and
how the files map onto gateway limits (gateway.config.rls)."""

from __future__ import annotations

import textwrap

from gateway.admin.config_view import redacted_config
from gateway.config import parse_config
from gateway.envoy.descriptors import identity_of, rate_limit_of, without_replaced

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
    found = rate_limit_of(config.rls.domains, "d", entries)
    return None if found is None else found.requests_per_unit


def test_an_exact_value_wins_then_the_longest_prefix_then_the_key_alone(tmp_path):
    config = domains(tmp_path)
    assert count(config, ("k", "exact")) == 1
    assert count(config, ("k", "prex")) == 2
    assert count(config, ("k", "prefix-1")) == 3
    assert count(config, ("k", "other")) == 4


def test_the_last_entry_decides_and_a_walk_that_stops_short_matches_nothing(tmp_path):
    config = domains(tmp_path)
    assert count(config, ("k", "other"), ("inner", "x")) == 5
    assert count(config, ("bare", "x")) is None  # a node without a rate_limit
    assert count(config, ("bare", "x"), ("leaf", "y")) == 6
    assert count(config, ("k", "other"), ("nothing", "x")) is None
    assert count(config, ("nope", "x")) is None
    assert rate_limit_of(config.rls.domains, "other-domain", [("k", "exact")]) is None


def test_the_mapping_onto_gateway_limits(tmp_path):
    config = domains(tmp_path)
    bucket = rate_limit_of(config.rls.domains, "d", [("k", "other")]).limit
    assert (bucket.burst, bucket.rate.per_second, bucket.quota) == (4, 4.0, None)
    window = rate_limit_of(config.rls.domains, "d", [("k", "o"), ("inner", "x")]).limit
    assert window.quota is not None and (window.quota.limit, window.quota.per) == (5, "day")
    assert "{" not in window.name and ":" not in window.name


def test_replaces_drops_the_named_limit_only_when_both_apply(tmp_path):
    config = domains(tmp_path)
    exact = rate_limit_of(config.rls.domains, "d", [("k", "exact")])
    replacing = rate_limit_of(config.rls.domains, "d", [("k", "other")])
    assert without_replaced([exact, replacing]) == [None, replacing]
    assert without_replaced([exact, None]) == [exact, None]


def test_identities_of_different_descriptors_never_meet():
    assert identity_of([("a", "b/c")]) != identity_of([("a", "b"), ("c", "")])
    assert identity_of([("a=b", "c")]) != identity_of([("a", "b=c")])


def test_the_admin_config_view_shows_the_trees(tmp_path):
    shown = redacted_config(domains(tmp_path))["rls"]
    assert shown["domains"]["d"]["children"]["k_exact"]["rate_limit"]["requests_per_unit"] == 1
