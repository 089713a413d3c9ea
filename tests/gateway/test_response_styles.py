"""`response:` at the top level and per limit (the limit's keys override the global
ones): the rejection status (429 or 503), a body template with {limit} and
{retry_after}, and the header style (ietf, x-ratelimit, none). Each style is
shown through one `python -m gateway run` that the tests share (each its own route and
limits), as is the honest local fallback (a store
that refuses connections, `on_store_error: local`, `local_divisor: 4`). The
template syntax and the config's validation are checked without a gateway."""

from __future__ import annotations

import json

import aiohttp
import pytest
from multidict import CIMultiDict

from gateway.config import ConfigError
from gateway.config.body_template import parse_body_template, parse_content_type
from gateway.config.model import DEFAULT_BODY_CONTENT_TYPE, HeaderStyle
from gateway.testing import config_from_yaml
from tests.processes import GatewayProcess, free_port

STYLES = """
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
response: {{headers: x-ratelimit}}
limits:
  plain: {{rate: 1/hour, burst: 2}}
  ietf: {{rate: 1/hour, burst: 2, response: {{headers: ietf}}}}
  alone: {{rate: 1/hour, burst: 2, response: {{headers: ietf}}}}
  hidden:
    rate: 1/hour
    burst: 1
    response:
      headers: none
      status: 503
      body: '{{{{"error": "slow down", "limit": "{{limit}}", "retry_in": {{retry_after}}}}}}'
      content_type: application/json
  wide: {{rate: 60/minute, burst: 10, response: {{headers: ietf}}}}
  busy: {{rate: 1/hour, burst: 1, response: {{status: 503}}}}
routes:
  - {{match: {{path: /x}}, upstream: {upstream}, strip_prefix: true, limits: [plain]}}
  - {{match: {{path: /ietf}}, upstream: {upstream}, strip_prefix: true, limits: [alone]}}
  - {{match: {{path: /none}}, upstream: {upstream}, strip_prefix: true, limits: [hidden]}}
  - {{match: {{path: /two}}, upstream: {upstream}, strip_prefix: true, limits: [wide, ietf]}}
  - {{match: {{path: /busy}}, upstream: {upstream}, strip_prefix: true, limits: [busy]}}
"""

RATELIMIT_FIELDS = ("RateLimit-Policy", "RateLimit", "X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset")


async def get(client: aiohttp.ClientSession, url: str) -> tuple[int, CIMultiDict[str], bytes]:
    async with client.get(url) as response:
        return response.status, CIMultiDict(response.headers), await response.read()


def fields(headers: CIMultiDict[str]) -> dict[str, str]:
    return {name: headers[name] for name in RATELIMIT_FIELDS if name in headers}


@pytest.fixture(scope="module")
def styles_gateway(module_upstream):
    """The tests of the styles share one gateway: each sends to a route of its own, whose
    limits no other route has (a limit's bucket is one across the routes that name it)."""
    with GatewayProcess(STYLES.format(upstream=module_upstream)) as gateway:
        yield gateway


async def test_x_ratelimit_style_from_the_top_level(styles_gateway, client):
    url = styles_gateway.url + "/x/echo"
    seen = [await get(client, url) for _ in range(3)]
    assert [status for status, _, _ in seen] == [200, 200, 429]
    # 1/hour, burst 2: after the first request one token is 3600 s short of full.
    assert fields(seen[0][1]) == {"X-RateLimit-Limit": "2", "X-RateLimit-Remaining": "1", "X-RateLimit-Reset": "3600"}
    assert fields(seen[1][1]) == {"X-RateLimit-Limit": "2", "X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "7200"}
    _status, headers, body = seen[2]
    assert fields(headers) == {"X-RateLimit-Limit": "2", "X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "7200"}
    assert headers["Retry-After"] == "3600"
    assert headers["Content-Type"].split(";")[0] == "application/problem+json"
    assert json.loads(body)["violated-policies"] == ["plain"]


async def test_ietf_style_overrides_the_top_level_for_its_limit(styles_gateway, client):
    status, headers, _ = await get(client, styles_gateway.url + "/ietf/echo")
    assert status == 200
    assert fields(headers) == {"RateLimit-Policy": '"alone";q=2;w=7200', "RateLimit": '"alone";r=1;t=3600'}


async def test_none_style_sends_no_fields_but_its_rejection_keeps_retry_after_status_and_body(styles_gateway, client):
    url = styles_gateway.url + "/none/echo"
    status, headers, _ = await get(client, url)
    assert status == 200 and fields(headers) == {}
    status, headers, body = await get(client, url)
    assert status == 503
    assert fields(headers) == {}
    assert headers["Retry-After"] == "3600"
    assert headers["Content-Type"] == "application/json"
    assert json.loads(body) == {"error": "slow down", "limit": "hidden", "retry_in": 3600}


async def test_a_status_of_503_keeps_the_problem_body_and_the_inherited_header_style(styles_gateway, client):
    url = styles_gateway.url + "/busy/echo"
    assert (await get(client, url))[0] == 200
    status, headers, body = await get(client, url)
    assert status == 503
    assert headers["Retry-After"] == "3600"
    assert fields(headers) == {"X-RateLimit-Limit": "1", "X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "3600"}
    assert headers["Content-Type"].split(";")[0] == "application/problem+json"
    problem = json.loads(body)
    assert (problem["status"], problem["title"], problem["violated-policies"]) == (503, "Service Unavailable", ["busy"])
    assert problem["detail"] == "Rate limit 'busy' exceeded; retry in 3600 s."


async def test_two_limits_are_both_advertised_and_ratelimit_follows_the_closer(styles_gateway, client):
    url = styles_gateway.url + "/two/echo"
    policy = '"wide";q=10;w=10, "ietf";q=2;w=7200'
    seen = [await get(client, url) for _ in range(3)]
    assert [status for status, _, _ in seen] == [200, 200, 429]
    assert [h.getall("RateLimit-Policy") for _, h, _ in seen] == [[policy]] * 3
    assert seen[0][1]["RateLimit"] == '"ietf";r=1;t=3600'  # 1 of 2 left beats wide's 9 of 10
    assert seen[2][1]["RateLimit"] == '"ietf";r=0;t=3600'  # its next token, not a full bucket
    assert json.loads(seen[2][2])["violated-policies"] == ["ietf"]
    assert seen[2][1]["Retry-After"] == "3600"


LOCAL = """
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
store: {{url: "redis://127.0.0.1:{port}", local_divisor: 4}}
limits:
  fleet: {{rate: 40/minute, burst: 8, on_store_error: local}}
  fallback_x: {{rate: 40/minute, burst: 8, on_store_error: local, response: {{headers: x-ratelimit}}}}
routes:
  - {{match: {{path: /f}}, upstream: {upstream}, strip_prefix: true, limits: [fleet, fallback_x]}}
"""


async def test_a_local_fallback_advertises_the_local_quota_it_applies(upstream, client):
    # Nothing listens on the store's port: every check fails, and the local quarter decides.
    with GatewayProcess(LOCAL.format(port=free_port(), upstream=upstream)) as gateway:
        seen = [await get(client, gateway.url + "/f/echo") for _ in range(3)]
    assert [status for status, _, _ in seen] == [200, 200, 429]
    for remaining, (_, headers, _) in zip((1, 0, 0), seen):
        assert headers["RateLimit-Policy"] == '"fleet";q=2;w=12'  # burst 8 / 4, refilled at 10/minute
        assert headers["RateLimit"].startswith(f'"fleet";r={remaining};t=')
        assert headers["X-RateLimit-Limit"] == "2"
        assert headers["X-RateLimit-Remaining"] == str(remaining)
    assert seen[2][1]["Retry-After"] == "6"


# --- the template syntax and the config ----------------------------------------------------


def test_a_template_fills_limit_at_load_and_splits_where_the_seconds_go():
    template = parse_body_template('{{"limit": "{limit}", "wait": {retry_after}, "again": {retry_after}}}')
    chunks = template.chunks("per_key")
    assert b"7".join(chunks) == b'{"limit": "per_key", "wait": 7, "again": 7}'
    assert parse_body_template("no placeholders").chunks("x") == (b"no placeholders",)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("{limit.__class__}", "unknown placeholder"),
        ("{retry_after:>10}", "unknown placeholder"),
        ("{0}", "unknown placeholder"),
        ("{}", "unknown placeholder"),
        ('{"a": 1}', "unknown placeholder"),
        ("a } b", "a lone '}'"),
        ("a { b", "a lone '{'"),
        (5, "expected a string"),
    ],
)
def test_a_template_reads_nothing_but_its_two_placeholders(text, error):
    with pytest.raises(ValueError, match=error):
        parse_body_template(text)


@pytest.mark.parametrize("text", ["application/json", "text/plain; charset=utf-8", 'text/html;charset="utf-8"'])
def test_content_types_that_are_media_types_pass(text):
    assert parse_content_type(text) == text


@pytest.mark.parametrize("text", ["json", "text/plain\r\nX-Evil: 1", "text/plain; charset", "", "a/b c"])
def test_content_types_that_are_not_media_types_fail(text):
    with pytest.raises(ValueError):
        parse_content_type(text)


def limits_config(top: str, limit: str) -> str:
    return f"""
{top}
limits:
  l: {{rate: 1/second{limit}}}
routes:
  - {{match: {{path: /}}, upstream: http://up.internal, limits: [l]}}
"""


def test_a_limit_overrides_the_top_level_response_key_by_key():
    config = config_from_yaml(
        limits_config("response: {status: 503, headers: none, body: 'wait {retry_after}'}", ", response: {headers: ietf}")
    )
    response = config.limits[0].response
    assert (response.status, response.headers) == (503, HeaderStyle.IETF)
    assert response.body is not None and response.body.text == "wait {retry_after}"
    assert response.content_type == DEFAULT_BODY_CONTENT_TYPE


@pytest.mark.parametrize(
    ("top", "limit", "message"),
    [
        ("response: {status: 404}", "", "<test>: response.status: expected 429 or 503, got 404"),
        ("", ", response: {status: 200}", "<test>: limits.l.response.status: expected 429 or 503, got 200"),
        ("", ", response: {headers: github}", "<test>: limits.l.response.headers: expected ietf, x-ratelimit or none, got 'github'"),
        ("", ", response: {body: 'x {who}'}", "<test>: limits.l.response.body: unknown placeholder '{who}'"),
        ("", ", response: {content_type: text/plain}", "<test>: limits.l.response.content_type: sets the type of `body`"),
        ("", ", response: {body: x, content_type: 'a\\r\\nb: c'}", "<test>: limits.l.response.content_type: expected a media type"),
        ("response: {code: 429}", "", "<test>: response.code: unknown key"),
    ],
)
def test_a_bad_response_block_is_one_line_naming_its_yaml_path(top, limit, message):
    with pytest.raises(ConfigError) as raised:
        config_from_yaml(limits_config(top, limit))
    assert str(raised.value).startswith(message)
    assert "\n" not in str(raised.value)
