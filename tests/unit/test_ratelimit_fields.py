"""The RateLimit fields of limits whose units are not requests (gateway.ratelimit_headers),
as pure functions of the config: the draft's `qu` for a response's bytes, for units the
response reports, and none for requests."""

from __future__ import annotations

import pytest

from gateway.config import parse_config
from gateway.limiter.decision import LimitStatus
from gateway.ratelimit_headers import RateLimitFields, policy, quota_unit

CONFIG = """
limits:
  units:
    rate: 1000/minute
    burst: 600
    key: header:X-API-Key
    cost: {{from: '{source}', reserve: 10}}
  per_client:
    rate: 10/second
    burst: 5
    key: header:X-API-Key
routes:
  - match: {{path: /}}
    upstream: http://127.0.0.1:9
    limits: [units, per_client]
"""


def limits(source: str):
    config = parse_config(CONFIG.format(source=source), source="t.yaml", environ={})
    return {limit.name: limit for limit in config.limits}


@pytest.mark.parametrize(
    ("source", "item"),
    [
        ("response-bytes", '"units";q=600;w=36;qu="content-bytes"'),
        ("json:usage.total_tokens", '"units";q=600;w=36;qu="json:usage.total_tokens"'),
        ("sse-json:usage.total_tokens", '"units";q=600;w=36;qu="sse-json:usage.total_tokens"'),
        ("header:X-Usage-Units", '"units";q=600;w=36;qu="header:X-Usage-Units"'),
    ],
)
def test_a_response_cost_names_its_unit_in_the_policy(source, item):
    assert policy(limits(source)["units"]) == item


def test_a_request_counting_limit_keeps_the_default_unit():
    per_client = limits("response-bytes")["per_client"]
    assert quota_unit(per_client) is None
    assert policy(per_client) == '"per_client";q=5;w=1'


def test_a_path_a_structured_field_string_cannot_carry_is_percent_encoded():
    """An sf-string holds printable ASCII, `"` and `\\` escaped (RFC 9651 3.3.3): a key with
    a quote, a backslash or a non-ASCII letter is percent-encoded, `%` too, so the value
    stays one valid string and still spells the path."""
    unit = quota_unit(limits('json:usage."tokens\\\\".compté%')["units"])
    assert unit == "json:usage.%22tokens%5C%5C%22.compt%C3%A9%25"


def test_the_route_lists_both_units_and_names_the_one_closest_to_exhaustion():
    found = limits("json:usage.total_tokens")
    units, per_client = found["units"], found["per_client"]
    fields = RateLimitFields.of([(units, units), (per_client, per_client)])
    statuses = [
        LimitStatus(limit=units, cost=10, remaining=20.0, outcome="allow"),  # 2 requests' reservations left
        LimitStatus(limit=per_client, cost=1, remaining=4.0, outcome="allow"),
    ]
    assert fields.headers(statuses) == {
        "RateLimit-Policy": '"units";q=600;w=36;qu="json:usage.total_tokens", "per_client";q=5;w=1',
        "RateLimit": '"units";r=20;t=1',  # r counts units, as the policy's qu says
    }


def test_a_bucket_in_debt_shows_no_units_left():
    units = limits("response-bytes")["units"]
    fields = RateLimitFields.of([(units, units)])
    headers = fields.headers([LimitStatus(limit=units, cost=10, remaining=-53.0, outcome="deny")])
    assert headers["RateLimit-Policy"] == '"units";q=600;w=36;qu="content-bytes"'
    # 54 units owed and one more at 1000 a minute: 3.24 s.
    assert headers["RateLimit"] == '"units";r=0;t=4'
