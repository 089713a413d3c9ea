"""The access log (issue 9 §8) as a user gets it from `gateway run --access-log`: one
line per request carrying the client address resolved through trusted proxies, the
route, the limit decision, the upstream status and latency and the request id; the
client identity only hashed; no query value in the path. And X-Request-ID: passed
to the upstream, generated when absent, and returned to the client."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from gateway.testing import running_gateway
from tests.processes import GatewayProcess

API_KEY = "sk-live-7f3a9c1e5b"
QUERY_KEY = "qk-9d2e4f6a8b"


def logged_yaml(upstream: str) -> str:
    return f"""
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
trusted_proxies: [127.0.0.1/32]
limits:
  per_key: {{rate: 1/hour, burst: 1, key: header:X-API-Key}}
  per_query: {{rate: 1/hour, burst: 5, key: query:api_key}}
routes:
  - match: {{path: /keyed}}
    upstream: {upstream}
    limits: [per_key]
  - match: {{path: /query}}
    upstream: {upstream}
    limits: [per_query]
  - match: {{path: /}}
    upstream: {upstream}
"""


async def send(gw: GatewayProcess, path: str, **headers: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as http, http.get(gw.url + path, headers=headers) as response:
        await response.read()
        return response.status, response.headers["X-Request-ID"]


async def run_logged(upstream: str, fmt: str) -> tuple[GatewayProcess, list[tuple[int, str]]]:
    forwarded = {"X-Forwarded-For": "203.0.113.7"}
    with GatewayProcess(logged_yaml(upstream), args=("--access-log", fmt)) as gw:
        answers = [
            await send(gw, "/keyed/a", **forwarded, **{"X-API-Key": API_KEY}),
            await send(gw, "/keyed/b", **forwarded, **{"X-API-Key": API_KEY}),
            await send(gw, f"/query/c?api_key={QUERY_KEY}&page=2"),
            await send(gw, "/status/503", **{"X-Request-ID": "client-chosen-42"}),
        ]
        assert await asyncio.to_thread(gw.stop) == 0
    return gw, answers


def assert_no_secret_in(lines: list[str]) -> None:
    for line in lines:
        assert API_KEY not in line and QUERY_KEY not in line, line


async def test_json_access_log_carries_client_route_decision_upstream_and_request_id(upstream):
    gw, answers = await run_logged(upstream, "json")
    assert [status for status, _ in answers] == [200, 429, 200, 503]
    records = [json.loads(line) for line in gw.stdout_lines]
    assert len(records) == 4, gw.stdout_lines
    first, second, query, plain = records
    assert [r["request_id"] for r in records] == [rid for _, rid in answers]
    assert plain["request_id"] == "client-chosen-42"
    assert first["client"] == second["client"] == "203.0.113.7"  # resolved, not the peer
    assert first["remote"] == "127.0.0.1" and plain["client"] == "127.0.0.1"
    assert [r["route"] for r in records] == ["/keyed", "/keyed", "/query", "/"]
    assert [r["decision"] for r in records] == ["allow", "deny", "allow", None]
    assert first["limits"][0]["name"] == "per_key" and first["limits"][0]["decision"] == "allow"
    assert second["limits"][0]["decision"] == "deny"
    # The identity only hashed, and the same client's hash the same on both lines.
    identity = first["limits"][0]["identity"]
    assert len(identity) == 16 and int(identity, 16) >= 0
    assert second["limits"][0]["identity"] == identity
    assert [r["upstream_status"] for r in records] == [200, None, 200, 503]
    assert first["upstream_ms"] >= 0 and second["upstream_ms"] is None
    assert query["path"] == "/query/c?api_key=***&page=***"
    assert_no_secret_in(gw.stdout_lines + gw.stderr_lines)


async def test_text_access_log_carries_the_same_on_one_line_each(upstream):
    gw, answers = await run_logged(upstream, "text")
    assert len(gw.stdout_lines) == 4, gw.stdout_lines
    first, second, query, plain = gw.stdout_lines
    assert '"GET /keyed/a" 200 ' in first
    assert f"client=203.0.113.7 request_id={answers[0][1]} " in first
    assert 'route="/keyed" decision=allow limits=per_key:allow:' in first
    assert "upstream_status=200 upstream_ms=" in first
    assert 'decision=deny limits=per_key:deny:' in second and "upstream_status=- upstream_ms=-" in second
    assert '"GET /query/c?api_key=***&page=***" 200 ' in query
    assert 'request_id=client-chosen-42 route="/" decision=- limits=- upstream_status=503 ' in plain
    assert_no_secret_in(gw.stdout_lines + gw.stderr_lines)


async def echoed_request_id(http: aiohttp.ClientSession, url: str, **headers: str) -> tuple[list[str], str | None]:
    async with http.get(url, headers=headers) as response:
        seen = [v for k, v in (await response.json())["headers"] if k.lower() == "x-request-id"]
        return seen, response.headers.get("X-Request-ID")


async def test_a_request_id_is_passed_to_the_upstream_and_returned(upstream):
    async with running_gateway(logged_yaml(upstream)) as gw, aiohttp.ClientSession() as http:
        assert await echoed_request_id(http, gw.url + "/echo", **{"X-Request-ID": "abc-123"}) == (["abc-123"], "abc-123")


async def test_a_request_id_is_generated_when_absent(upstream):
    async with running_gateway(logged_yaml(upstream)) as gw, aiohttp.ClientSession() as http:
        seen, returned = await echoed_request_id(http, gw.url + "/echo")
        again, other = await echoed_request_id(http, gw.url + "/echo")
    assert seen == [returned] and again == [other] and returned != other
    assert len(returned) == 32 and int(returned, 16) >= 0


@pytest.mark.parametrize("sent", ['has "quotes"', "x" * 129, "new\tline"])
async def test_a_request_id_that_could_break_a_log_line_is_replaced(upstream, sent):
    async with running_gateway(logged_yaml(upstream)) as gw, aiohttp.ClientSession() as http:
        seen, returned = await echoed_request_id(http, gw.url + "/echo", **{"X-Request-ID": sent})
    assert seen == [returned] and returned != sent and len(returned) == 32


async def test_a_rejected_request_returns_its_request_id_too(upstream):
    async with running_gateway(logged_yaml(upstream)) as gw, aiohttp.ClientSession() as http:
        for expected in (200, 429):
            async with http.get(gw.url + "/keyed/x", headers={"X-API-Key": "k", "X-Request-ID": "r1"}) as response:
                assert (response.status, response.headers.get("X-Request-ID")) == (expected, "r1")
