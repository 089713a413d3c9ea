"""`cost: {from, reserve, missing}` in the config: what `gateway check` says of it, the one
line each mistake gets, the combinations refused, and /config reading it back."""

from __future__ import annotations

import pytest

from gateway.cli import describe
from gateway.config import parse_config
from gateway.config.model import ResponseCost
from gateway.config.usage import parse_usage_source
from tests.helpers import error_of
from tests.unit.test_config_view import round_trip

LIMIT = """
limits:
  tokens:
    rate: 100000/hour
    burst: 20000
    key: header:X-API-Key
{extra}    cost: {cost}
routes:
  - match: {{path: /v1}}
    upstream: http://127.0.0.1:9
    limits: [{route_limit}]
"""


def text(cost: str = "{from: json:usage.total_tokens, reserve: 1000}", extra: str = "", route_limit: str = "tokens") -> str:
    return LIMIT.format(cost=cost, extra=extra, route_limit=route_limit)


def test_a_response_cost_reserves_and_is_explained():
    config = parse_config(text("{from: 'header:X-Usage-Units', reserve: 1000, missing: 500}"), source="t.yaml", environ={})
    limit = config.limits[0]
    assert limit.cost == ResponseCost(source=parse_usage_source("header:X-Usage-Units"), reserve=1000, missing=500)
    assert config.routes[0].limits[0].cost == 1000  # the check before forwarding takes the reservation
    assert (
        "cost from header:X-Usage-Units: reserves 1000 before forwarding, settles the difference after the response "
        "(into debt when more), 500 when the response does not say"
    ) in describe(config)
    assert parse_config(text(), source="t.yaml", environ={}).limits[0].cost.missing == 1000  # default: the reservation


@pytest.mark.parametrize(
    ("cost", "extra", "route_limit", "expected"),
    [
        ("{from: 'xml:usage', reserve: 1}", "", "tokens",
         "limits.tokens.cost.from: expected json:PATH, sse-json:PATH, header:NAME or response-bytes, got 'xml:usage'"),
        ("{from: 'json:usage..total', reserve: 1}", "", "tokens",
         "limits.tokens.cost.from: expected a dotted path of keys after 'json:' such as usage.total_tokens, got 'usage..total'"),
        ("{from: response-bytes}", "", "tokens",
         "limits.tokens.cost: `reserve` is required: the units taken before forwarding, settled when the response says its cost"),
        ("{from: response-bytes, reserve: 30000}", "", "tokens",
         "limits.tokens.cost.reserve: a reservation of 30000 is more than the burst 20000; it could never be taken"),
        ("{from: response-bytes, reserve: 10, missing: -1}", "", "tokens",
         "limits.tokens.cost.missing: expected an integer >= 0, got -1"),
        ("{from: response-bytes, reserve: 10}", "    lease: 10\n", "tokens",
         "limits.tokens.cost: a leased limit spends its tokens in this process, where a settlement after the response cannot reach"),
        ("{from: response-bytes, reserve: 10}", "    mode: delay\n    max_delay: 1s\n", "tokens",
         "limits.tokens.cost: a cost settled after the response may put the bucket into debt, which a delaying limit spends on waits"),
        ("{from: response-bytes, reserve: 10}", "", "{name: tokens, cost: 5}",
         "routes[0].limits[0].cost: limit 'tokens' takes its cost from the response, reserving 10 (its cost.reserve)"),
    ],
)
def test_each_mistake_is_one_line_naming_its_path(cost, extra, route_limit, expected):
    assert error_of(text(cost, extra, route_limit)) == f"gw.yaml: {expected}"


def test_a_quota_is_refused():
    quota = """
limits:
  tokens:
    quota: {limit: 100000, per: day}
    cost: {from: response-bytes, reserve: 10}
routes: [{match: {path: /}, upstream: "http://127.0.0.1:9", limits: [tokens]}]
"""
    assert error_of(quota).endswith(
        "limits.tokens.cost: a cost settled after the response needs a `rate`: a quota's window may end before it is settled"
    )


def test_config_reads_back_into_an_equal_config(tmp_path):
    config = parse_config(text("{from: 'sse-json:usage.total_tokens', reserve: 1000, missing: 2000}"), source="t.yaml", environ={})
    view, again = round_trip(config, {}, tmp_path)
    assert again == config
    assert view["config"]["limits"]["tokens"]["cost"] == {"from": "sse-json:usage.total_tokens", "reserve": 1000, "missing": 2000}
    assert view["config"]["routes"][0]["limits"] == ["tokens"]
