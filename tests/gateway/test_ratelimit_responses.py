"""What clients see of the limits: RateLimit-Policy (every limit of the route)
and RateLimit (the one closest to exhaustion) on every response of a limited
route (draft-ietf-httpapi-ratelimit-headers, structured field form), and the
x-ratelimit and none styles built from a decision; on 429 a Retry-After in
whole seconds (rounded up, at least 1) and a problem+json body naming the
limit; and several limits on one request charged all or nothing."""

from __future__ import annotations

import dataclasses
import json
import math

import aiohttp
import pytest
from multidict import CIMultiDict

from gateway.config.model import ConcurrencyLimit, FailurePolicy, HeaderStyle, Limit, ResponseStyle
from gateway.decision.problems import ProblemTemplate, problem_body
from gateway.limiter.decision import LimitStatus, local_share
from gateway.ratelimit_headers import RateLimitFields, most_restrictive, retry_after_seconds
from gateway.testing import config_from_yaml, running_gateway

LIMITS = """
trusted_proxies: [127.0.0.1/32]
limits:
  per_client: {rate: 100/minute, burst: 20}
  tight: {rate: 10/minute, burst: 3}
  per_key: {rate: 1/hour, burst: 1, key: header:X-Api-Key}
  per_ip3: {rate: 1/hour, burst: 3}
  hourly: {rate: 1/hour, burst: 1}
  half_second: {rate: 2/second, burst: 1}
"""


def responses_config(upstream: str) -> str:
    routes = {
        "/single": "[per_client]",
        "/double": "[per_client, tight]",
        "/combo": "[per_key, per_ip3]",
        "/hourly": "[hourly]",
        "/fast": "[half_second]",
        "/costly": "[{name: per_client, cost: 5}]",
        "/free": "[]",
    }
    lines = [LIMITS, "routes:"]
    for path, limits in routes.items():
        lines.append(f"  - match: {{path: {path}}}\n    upstream: {upstream}\n    strip_prefix: true\n    limits: {limits}")
    return "\n".join(lines)


@pytest.fixture
async def gw(upstream):
    async with running_gateway(responses_config(upstream)) as gateway:
        yield gateway



async def get(client: aiohttp.ClientSession, url: str, **headers: str) -> tuple[int, CIMultiDict[str], bytes]:
    async with client.get(url, headers={k.replace("_", "-"): v for k, v in headers.items()}, allow_redirects=False) as r:
        return r.status, CIMultiDict(r.headers), await r.read()


# --- through the gateway -----------------------------------------------------------------


async def test_one_request_leaves_nineteen_of_a_burst_of_twenty(gw, client):
    status, headers, _ = await get(client, gw.url + "/single/echo")
    assert status == 200
    assert headers["RateLimit-Policy"] == '"per_client";q=20;w=12'
    assert headers["RateLimit"] == '"per_client";r=19;t=1'
    status, headers, _ = await get(client, gw.url + "/single/echo")
    # t is the effective window: the 19th token is due 0.6 s (one at 100/minute) from now,
    # not the 1.2 s until the bucket is full again.
    assert headers["RateLimit"] == '"per_client";r=18;t=1'


@pytest.mark.parametrize(("path", "code"), [("/status/404", 404), ("/redirect", 302), ("/status/500", 500)])
async def test_every_response_of_a_limited_route_carries_the_fields(gw, client, path, code):
    status, headers, _ = await get(client, gw.url + "/single" + path)
    assert status == code
    assert headers.getall("RateLimit-Policy") == ['"per_client";q=20;w=12']
    assert headers.getall("RateLimit") == ['"per_client";r=19;t=1']


async def test_a_route_without_limits_carries_no_ratelimit_fields(gw, client):
    status, headers, _ = await get(client, gw.url + "/free/echo")
    assert status == 200
    assert "RateLimit-Policy" not in headers and "RateLimit" not in headers


async def test_a_cost_is_charged_and_reported(gw, client):
    _, headers, _ = await get(client, gw.url + "/costly/echo")
    assert headers["RateLimit"] == '"per_client";r=15;t=1'  # the 16th token is due in 0.6 s


async def test_both_limits_are_advertised_and_ratelimit_names_the_closer_to_exhaustion(gw, client):
    for remaining in (2, 1, 0):
        status, headers, _ = await get(client, gw.url + "/double/echo")
        assert status == 200
        assert headers["RateLimit-Policy"] == '"per_client";q=20;w=12, "tight";q=3;w=18'
        assert headers["RateLimit"].startswith(f'"tight";r={remaining};t=')
    status, headers, body = await get(client, gw.url + "/double/echo")
    assert status == 429
    assert headers.getall("RateLimit-Policy") == ['"per_client";q=20;w=12, "tight";q=3;w=18']
    assert headers["RateLimit"].startswith('"tight";r=0;t=')
    problem = json.loads(body)
    assert problem["violated-policies"] == ["tight"]
    assert "tight" in problem["detail"] and "per_client" not in problem["detail"]


async def test_a_429_has_a_problem_body_naming_the_limit_and_retry_after_in_whole_seconds(gw, client):
    assert (await get(client, gw.url + "/hourly/echo"))[0] == 200
    status, headers, body = await get(client, gw.url + "/hourly/echo")
    assert status == 429
    assert headers["Content-Type"].split(";")[0] == "application/problem+json"
    # 3600 s less the moment since the first request, rounded up (rounding down would give 3599).
    assert headers["Retry-After"] == "3600"
    problem = json.loads(body)
    assert problem["status"] == 429
    assert problem["title"] == "Too Many Requests"
    assert problem["type"] == "https://iana.org/assignments/http-problem-types#quota-exceeded"
    assert problem["violated-policies"] == ["hourly"]
    assert problem["detail"] == "Rate limit 'hourly' exceeded; retry in 3600 s."
    assert headers["RateLimit"] == '"hourly";r=0;t=3600'


async def test_a_429s_effective_window_ends_no_later_than_its_retry_after(gw, client):
    """The draft: Retry-After SHOULD NOT point earlier than the end of the effective window.
    Until the bucket is full (18 s for `tight`) would be 12 s past Retry-After."""
    for _ in range(3):
        assert (await get(client, gw.url + "/double/echo"))[0] == 200
    status, headers, _ = await get(client, gw.url + "/double/echo")
    assert status == 429
    window = int(headers["RateLimit"].rpartition(";t=")[2])
    assert window == int(headers["Retry-After"]) == 6  # one token at 10/minute


def test_a_costly_requests_window_is_the_next_token_and_its_retry_after_all_it_costs():
    limit = limits_by_name()["per_client"]  # 0.6 s a token
    status = LimitStatus(limit=limit, cost=5, remaining=2.0, outcome="deny")
    assert headers_for(status)["RateLimit"] == '"per_client";r=2;t=1'
    # Retry-After waits for the 3 tokens short: 1.8 s, which the limiter works out.


async def test_retry_after_is_at_least_one_second_for_a_sub_second_wait(gw, client):
    assert (await get(client, gw.url + "/fast/echo"))[0] == 200
    status, headers, _ = await get(client, gw.url + "/fast/echo")
    assert status == 429  # the next token is at most 0.5 s away
    assert headers["Retry-After"] == "1"


async def test_several_limits_are_all_or_nothing(gw, client):
    async def combo(key: str, ip: str) -> tuple[int, CIMultiDict[str], bytes]:
        return await get(client, gw.url + "/combo/echo", X_Api_Key=key, X_Forwarded_For=ip)

    status, headers, _ = await combo("k1", "192.0.2.1")
    assert status == 200
    assert headers["RateLimit"].startswith('"per_key";r=0;')  # per_key 0 left, per_ip3 2 left
    for _ in range(5):
        status, headers, body = await combo("k1", "192.0.2.1")
        assert status == 429
        assert json.loads(body)["violated-policies"] == ["per_key"]
    # per_key denied five times; had per_ip3 been charged, it would be empty now.
    assert (await combo("k2", "192.0.2.1"))[0] == 200
    status, headers, _ = await combo("k3", "192.0.2.1")
    assert status == 200
    # Both have 0 left; the tie goes to the one slower to refill.
    assert headers["RateLimit"].startswith('"per_ip3";r=0;')
    status, headers, body = await combo("k4", "192.0.2.1")
    assert status == 429
    assert json.loads(body)["violated-policies"] == ["per_ip3"]
    assert headers["RateLimit-Policy"] == '"per_key";q=1;w=3600, "per_ip3";q=3;w=10800'
    assert headers["RateLimit"].startswith('"per_ip3";r=0;')
    # per_ip3 denied k4, so k4's own bucket was not charged: from another address it passes.
    assert (await combo("k4", "192.0.2.2"))[0] == 200


# --- pure: gateway.ratelimit_headers -----------------------------------------------


def limits_by_name() -> dict[str, Limit]:
    config = config_from_yaml(LIMITS + "routes:\n  - match: {path: /}\n    upstream: http://up.internal\n")
    return {limit.name: limit for limit in config.limits}


def headers_for(*statuses: LimitStatus, divisor: int = 1) -> dict[str, str]:
    """The fields for `statuses`, compiled as the route plan compiles them, each limit's
    local stand-in a 1/`divisor` share."""
    fields = RateLimitFields.of([(s.limit, local_share(s.limit, divisor, s.cost)) for s in statuses])
    return fields.headers(statuses)


def styled(limit: Limit, headers: HeaderStyle) -> Limit:
    return dataclasses.replace(limit, response=ResponseStyle(headers=headers))


@pytest.mark.parametrize(
    ("seconds", "header"),
    [(0.0, 1), (0.001, 1), (0.5, 1), (1.0, 1), (1.0001, 2), (1.5, 2), (59.2, 60), (3599.9, 3600), (math.inf, 86400)],
)
def test_retry_after_seconds_rounds_up_to_at_least_one(seconds, header):
    assert retry_after_seconds(seconds) == header


def test_ratelimit_headers_floor_the_remaining_and_round_the_reset_up():
    limit = limits_by_name()["per_client"]  # 100/minute: 5/3 tokens a second
    headers = headers_for(LimitStatus(limit=limit, cost=1, remaining=18.7, outcome="allow"))
    assert headers == {"RateLimit-Policy": '"per_client";q=20;w=12', "RateLimit": '"per_client";r=18;t=1'}
    full = headers_for(LimitStatus(limit=limit, cost=1, remaining=20.0, outcome="allow"))
    # Full: within 0.6 s of spending one the client has its next token, so no more than 20.
    assert full["RateLimit"] == '"per_client";r=20;t=1'


def test_the_most_restrictive_limit_counts_requests_left_not_tokens():
    limits = limits_by_name()
    big_cost = LimitStatus(limit=limits["per_client"], cost=5, remaining=10.0, outcome="allow")  # 2 requests left
    small_cost = LimitStatus(limit=limits["tight"], cost=1, remaining=3.0, outcome="allow")  # 3 requests left
    fields = RateLimitFields.of([(limits["tight"], limits["tight"]), (limits["per_client"], limits["per_client"])])
    assert most_restrictive([small_cost, big_cost], fields.ietf) is fields.ietf[1]
    assert headers_for(small_cost, big_cost) == {
        "RateLimit-Policy": '"tight";q=3;w=18, "per_client";q=20;w=12',
        "RateLimit": '"per_client";r=10;t=1',
    }


def test_a_limit_with_unknown_remaining_is_advertised_but_never_named_in_ratelimit():
    limits = limits_by_name()
    unknown = LimitStatus(limit=limits["tight"], cost=1, remaining=None, outcome="fail_open")
    known = LimitStatus(limit=limits["per_client"], cost=1, remaining=5.0, outcome="allow")
    assert headers_for(unknown) == {}  # no store decided: no fields at all
    assert headers_for(unknown, known) == {
        "RateLimit-Policy": '"tight";q=3;w=18, "per_client";q=20;w=12',
        "RateLimit": '"per_client";r=5;t=1',
    }


def test_a_limit_decided_locally_is_described_by_the_local_share_actually_applied():
    limits = limits_by_name()  # per_client: 100/minute, burst 20; a quarter is 25/minute, burst 5
    local = LimitStatus(limit=limits["per_client"], cost=1, remaining=2.0, outcome="fail_local")
    tight = LimitStatus(limit=limits["tight"], cost=1, remaining=3.0, outcome="allow")
    assert headers_for(local, tight, divisor=4) == {
        "RateLimit-Policy": '"per_client";q=5;w=12, "tight";q=3;w=18',
        # 2 of the local 5 left, the third due in 1 / (25/60) = 2.4 s; the global bucket's in 0.6 s.
        "RateLimit": '"per_client";r=2;t=3',
    }
    # Beside a fail-closed limit no local bucket decided: the global quota is shown.
    closed = dataclasses.replace(local, remaining=None)
    assert headers_for(closed, tight, divisor=4)["RateLimit-Policy"] == '"per_client";q=20;w=12, "tight";q=3;w=18'


def test_a_routes_concurrency_limits_end_its_ratelimit_policy_in_concurrent_requests():
    limits = limits_by_name()
    conns = ConcurrencyLimit(name="conns", concurrency=4, lease_ttl=60.0, key=(), on_store_error=FailurePolicy.OPEN)
    tight = limits["tight"]
    fields = RateLimitFields.of([(tight, tight)], concurrency=[conns])
    statuses = [LimitStatus(limit=tight, cost=1, remaining=2.0, outcome="allow")]
    assert fields.headers(statuses)["RateLimit-Policy"] == '"tight";q=3;w=18, "conns";q=4;qu="concurrent-requests"'
    assert fields.concurrency_policy == '"conns";q=4;qu="concurrent-requests"'


def test_a_route_whose_only_ietf_limits_are_concurrency_limits_still_sends_their_policy():
    limits = limits_by_name()
    conns = ConcurrencyLimit(name="conns", concurrency=4, lease_ttl=60.0, key=(), on_store_error=FailurePolicy.OPEN)
    assert RateLimitFields.of([], concurrency=[conns]).fixed == {"RateLimit-Policy": '"conns";q=4;qu="concurrent-requests"'}
    # Beside an x-ratelimit limit, the concurrency limit's policy is sent with that limit's fields.
    tight = styled(limits["tight"], HeaderStyle.X_RATELIMIT)
    headers = RateLimitFields.of([(tight, tight)], concurrency=[conns]).headers(
        [LimitStatus(limit=tight, cost=1, remaining=2.0, outcome="allow")]
    )
    assert headers["RateLimit-Policy"] == '"conns";q=4;qu="concurrent-requests"'
    assert headers["X-RateLimit-Remaining"] == "2"
    assert RateLimitFields.of([(limits["tight"], limits["tight"])]).fixed == {}


def test_x_ratelimit_fields_describe_the_limit_closest_to_exhaustion_with_reset_in_seconds():
    limits = limits_by_name()
    per_client = styled(limits["per_client"], HeaderStyle.X_RATELIMIT)
    tight = styled(limits["tight"], HeaderStyle.X_RATELIMIT)
    headers = headers_for(
        LimitStatus(limit=per_client, cost=1, remaining=18.7, outcome="allow"),
        LimitStatus(limit=tight, cost=1, remaining=0.5, outcome="deny"),
    )
    # tight: 10/minute, 2.5 tokens short of its burst of 3: full in 15 s.
    assert headers == {"X-RateLimit-Limit": "3", "X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "15"}


def test_each_limit_is_advertised_in_its_own_style_and_none_not_at_all():
    limits = limits_by_name()
    statuses = (
        LimitStatus(limit=limits["per_client"], cost=1, remaining=19.0, outcome="allow"),
        LimitStatus(limit=styled(limits["tight"], HeaderStyle.X_RATELIMIT), cost=1, remaining=2.0, outcome="allow"),
        LimitStatus(limit=styled(limits["hourly"], HeaderStyle.NONE), cost=1, remaining=0.0, outcome="allow"),
    )
    assert headers_for(*statuses) == {
        "RateLimit-Policy": '"per_client";q=20;w=12',
        "RateLimit": '"per_client";r=19;t=1',
        "X-RateLimit-Limit": "3",
        "X-RateLimit-Remaining": "2",
        "X-RateLimit-Reset": "6",
    }
    assert headers_for(statuses[2]) == {}


def test_a_problem_template_fills_its_blank_as_a_body_made_whole_would_read():
    template = ProblemTemplate.of(429, "Too Many Requests", "Rate limit 'a' exceeded; retry in {} s.", limits=("a",))
    whole = problem_body(429, "Too Many Requests", "Rate limit 'a' exceeded; retry in 17 s.", limits=["a"])
    assert template.body("17") == whole
    assert json.loads(whole)["detail"] == "Rate limit 'a' exceeded; retry in 17 s."
