"""A route's request_headers and response_headers: remove, then set, then add; the gateway's
own fields always win, and the loader refuses rules that would touch them.

The pure tests call gateway.proxy.header_rewrite directly; the rest run a gateway in front
of the echo upstream, which shows the headers it received, and read what the client gets."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from gateway.config import ConfigError
from gateway.config.model import HeaderRules
from gateway.proxy.header_rewrite import rewrite_headers
from gateway.testing import config_from_yaml, running_gateway
from tests.raw_client import echoed, echoed_headers, raw_exchange, request_bytes, values

# --- pure -----------------------------------------------------------------------------------


def test_remove_then_set_then_add_every_line_of_a_name():
    headers = CIMultiDict([("X-Drop", "1"), ("x-drop", "2"), ("X-Set", "old"), ("X-Set", "older"), ("X-Add", "a")])
    rules = HeaderRules(set=(("X-Set", "new"),), add=(("X-Add", "b"), ("X-New", "c")), remove=("x-drop",))
    rewrite_headers(headers, rules)
    assert "X-Drop" not in headers
    assert headers.getall("X-Set") == ["new"]
    assert headers.getall("X-Add") == ["a", "b"]
    assert headers.getall("X-New") == ["c"]


def test_removing_a_header_that_is_not_there_is_no_error():
    headers = CIMultiDict([("X-Kept", "1")])
    rewrite_headers(headers, HeaderRules(remove=("x-absent",)))
    assert list(headers.items()) == [("X-Kept", "1")]


# --- config ----------------------------------------------------------------------------------


def route_with(rules: str, *, direction: str = "request_headers", limits: str = "") -> str:
    return f"""
limits:
  per_key: {{rate: 10/minute, key: [header:X-API-Key, ip]}}
  per_user: {{rate: 10/minute, key: [jwt:sub]}}
  per_cookie: {{rate: 10/minute, key: [cookie:session]}}
jwt: {{secret_env: JWT_SECRET}}
routes:
  - match: {{path: /}}
    upstream: http://up.internal
    {direction}: {rules}{limits}
"""


@pytest.mark.parametrize(
    ("direction", "rules", "limits", "where", "message"),
    [
        ("request_headers", "{set: {X-Forwarded-For: 1.2.3.4}}", "", "request_headers.set.X-Forwarded-For", "gateway's to write"),
        ("request_headers", "{remove: [forwarded]}", "", "request_headers.remove[0]", "gateway's to write"),
        ("request_headers", "{set: {Host: other}}", "", "request_headers.set.Host", "gateway's to write"),
        ("request_headers", "{add: {X-Request-ID: x}}", "", "request_headers.add.X-Request-ID", "gateway's to write"),
        ("request_headers", "{remove: [Transfer-Encoding]}", "", "request_headers.remove[0]", "gateway's to write"),
        ("request_headers", "{set: {Content-Length: '1'}}", "", "request_headers.set.Content-Length", "gateway's to write"),
        ("response_headers", "{set: {RateLimit: x}}", "", "response_headers.set.RateLimit", "gateway's to write"),
        ("response_headers", "{remove: [ratelimit-policy]}", "", "response_headers.remove[0]", "gateway's to write"),
        ("response_headers", "{remove: [Connection]}", "", "response_headers.remove[0]", "gateway's to write"),
        ("request_headers", "{set: {'X A': b}}", "", "request_headers.set.X A", "not a valid header name"),
        ("request_headers", "{set: {X-A: 2}}", "", "request_headers.set.X-A", "quote numbers"),
        ("request_headers", "{set: {X-A: \"a\\r\\nX-B: b\"}}", "", "request_headers.set.X-A", "visible ASCII"),
        ("request_headers", "{set: {X-A: a}, add: {x-a: b}}", "", "request_headers.add.x-a", "more than once"),
        ("request_headers", "{copy: {X-A: a}}", "", "request_headers.copy", "unknown key"),
        ("request_headers", "{remove: X-A}", "", "request_headers.remove", "expected a list"),
        ("request_headers", "{remove: [X-API-Key]}", "\n    limits: [per_key]", "request_headers", "reads as its identity"),
        ("request_headers", "{set: {Authorization: x}}", "\n    limits: [per_user]", "request_headers", "reads as its identity"),
        ("request_headers", "{add: {Cookie: a=b}}", "\n    limits: [per_cookie]", "request_headers", "reads as its identity"),
    ],
)
def test_a_bad_rule_is_one_line_naming_its_yaml_path(direction, rules, limits, where, message):
    with pytest.raises(ConfigError) as error:
        config_from_yaml(route_with(rules, direction=direction, limits=limits), environ={"JWT_SECRET": "s" * 32})
    text = str(error.value)
    assert "\n" not in text
    assert f"routes[0].{where}" in text
    assert message in text


def test_a_rule_on_a_header_no_limit_of_the_route_reads_is_taken():
    config = config_from_yaml(
        route_with("{remove: [X-API-Key], set: {Authorization: x}}", limits="\n    limits: [per_cookie]"),
        environ={"JWT_SECRET": "s" * 32},
    )
    assert config.routes[0].request_headers == HeaderRules(set=(("Authorization", "x"),), remove=("x-api-key",))


# --- through the gateway ----------------------------------------------------------------------


def rewriting_config(upstream: str) -> str:
    return f"""
limits:
  generous: {{rate: 1000/minute}}
routes:
  - match: {{path: /}}
    upstream: {upstream}
    limits: [generous]
    request_headers:
      set: {{X-Env: production, X-Overwritten: by-gateway}}
      add: {{X-Tag: added}}
      remove: [X-Internal-Token, Cookie]
    response_headers:
      set: {{Cache-Control: no-store}}
      add: {{X-Multi: three}}
      remove: [Set-Cookie]
"""


@pytest.fixture
async def gw(upstream):
    async with running_gateway(rewriting_config(upstream)) as gateway:
        yield gateway


async def test_the_upstream_sees_request_headers_set_added_and_removed(gw):
    request = request_bytes(
        "/echo/rewrite",
        [
            ("X-Overwritten", "by-client"),
            ("X-Overwritten", "twice"),
            ("X-Tag", "from-client"),
            ("X-Internal-Token", "secret"),
            ("Cookie", "a=1"),
            ("X-Untouched", "kept"),
        ],
    )
    status, _, body = await raw_exchange(gw.url, request)
    assert status == 200
    echo = echoed(body)
    assert echoed_headers(echo, "X-Env") == ["production"]
    assert echoed_headers(echo, "X-Overwritten") == ["by-gateway"]
    assert echoed_headers(echo, "X-Tag") == ["from-client", "added"]
    assert echoed_headers(echo, "X-Internal-Token") == []
    assert echoed_headers(echo, "Cookie") == []
    assert echoed_headers(echo, "X-Untouched") == ["kept"]
    # The gateway's own fields are still its own.
    assert echoed_headers(echo, "X-Forwarded-For") == ["127.0.0.1"]
    assert len(echoed_headers(echo, "X-Request-ID")) == 1


async def test_a_removed_set_or_gateway_written_header_spelt_with_underscores_is_dropped(gw):
    """Reproduction: `X_Internal_Token`, `X_Env` and `X_Forwarded_For` passed the route's
    `remove` and `set` and the gateway's own forwarding headers as sent; a CGI or WSGI
    upstream (gunicorn before 22, werkzeug) reads them as HTTP_X_INTERNAL_TOKEN and so on,
    the headers the gateway took out or wrote. nginx drops such names by default."""
    spelt = [
        ("X_Internal_Token", "secret"), ("x_internal-TOKEN", "secret"), ("X_Env", "staging"),
        ("X_Forwarded_For", "192.0.2.66"), ("X_Forwarded_Host", "evil.example"), ("X_Request_ID", "forged"),
    ]
    status, _, body = await raw_exchange(gw.url, request_bytes("/echo/rewrite", [*spelt, ("X_Untouched", "kept")]))
    assert status == 200
    echo = echoed(body)
    names = [name.lower() for name, _ in echo["headers"]]
    for name, _ in spelt:
        assert name.lower() not in names
    assert echoed_headers(echo, "X-Env") == ["production"]
    assert echoed_headers(echo, "X-Forwarded-For") == ["127.0.0.1"]
    assert echoed_headers(echo, "X_Untouched") == ["kept"]  # a name nothing removes or writes


async def test_the_client_sees_response_headers_set_added_and_removed(gw):
    status, headers, body = await raw_exchange(gw.url, request_bytes("/set-cookie", []))
    assert status == 200
    assert body == b"cookies"
    assert values(headers, "Set-Cookie") == []
    assert values(headers, "Cache-Control") == ["no-store"]
    assert values(headers, "X-Multi") == ["one", "two", "three"]
    # Written by the gateway after the route's rules.
    assert values(headers, "RateLimit-Policy") == ['"generous";q=1000;w=60']
    assert len(values(headers, "X-Request-ID")) == 1


async def test_the_gateways_own_answers_are_not_rewritten(upstream):
    """Rules apply to what the upstream sends and receives; a 404 of the gateway's is its own."""
    config = rewriting_config(upstream).replace("match: {path: /}", "match: {path: /echo}")
    async with running_gateway(config) as gw:
        status, headers, _ = await raw_exchange(gw.url, request_bytes("/elsewhere", []))
    assert status == 404
    assert values(headers, "Cache-Control") == []
