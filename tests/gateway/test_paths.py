"""The limiter and the upstream see the same path.

Each request path is read once by one rule (gateway.proxy.paths): the route is
matched on the path that rule resolves, and exactly that path is forwarded, or
the request is refused with a 400 before the limiter or the upstream hears of
it. Every example quoted in the original report is sent here over a raw socket (an HTTP
client would resolve `..` or re-encode the path itself), in each
`path_normalization` setting, to a real aiohttp upstream that records the raw
path it received. Each route applies its own limit, so RateLimit-Policy names
the route that was charged."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from yarl import URL

from gateway.config import ConfigError, parse_config
from gateway.config.model import DotSegments, EscapedSlashes, PathNormalization
from gateway.testing import config_from_yaml, running_gateway
from tests.processes import run_cli
from tests.raw_client import raw_exchange, values
from tests.upstream import serving

# One knob changed from the default at a time; "default" is no `path_normalization` at all.
SETTINGS = {
    "default": "",
    "dots_reject": "path_normalization: {dot_segments: reject}\n",
    "escaped_slashes_reject": "path_normalization: {escaped_slashes: reject}\n",
    "escaped_slashes_decode": "path_normalization: {escaped_slashes: decode}\n",
    "merge_slashes_off": "path_normalization: {merge_slashes: false}\n",
}


def paths_config(upstream: str, setting: str = "default", *, parameters: bool = False, case_insensitive: bool = False) -> str:
    """`parameters`: every route allows `;` parameters. `case_insensitive`: the /api routes match in any case."""
    allow = "\n    allow_path_parameters: true" if parameters else ""
    case = ", case_sensitive: false" if case_insensitive else ""
    return f"""{SETTINGS[setting]}
limits:
  reports: {{rate: 1/hour, burst: 1}}
  api: {{rate: 1000/minute}}
  public: {{rate: 1000/minute}}
  svc: {{rate: 1000/minute}}
  rest: {{rate: 1000/minute}}
routes:
  - match: {{path: /api/reports, methods: [POST]{case}}}
    upstream: {upstream}
    limits: [reports]{allow}
  - match: {{path: /api{case}}}
    upstream: {upstream}
    limits: [api]{allow}
  - match: {{path: /public}}
    upstream: {upstream}
    limits: [public]{allow}
  - match: {{path: /svc}}
    upstream: {upstream}
    strip_prefix: true
    limits: [svc]{allow}
  - match: {{path: /}}
    upstream: {upstream}
    limits: [rest]{allow}
"""


@pytest.fixture
async def recorder():
    """A real aiohttp upstream that answers with, and records, the raw path it received."""
    seen: list[str] = []

    async def record(request: web.BaseRequest) -> web.Response:
        seen.append(request.raw_path)
        return web.json_response({"path": request.raw_path})

    async with serving(record) as url:
        yield url, seen


async def send(gw_url: str, target: str, method: str = "GET") -> tuple[int, str | None, dict]:
    """The status, the limit charged (the route taken) and the JSON body, for `target` sent verbatim."""
    head = f"{method} {target} HTTP/1.1\r\nHost: gw\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    status, headers, body = await raw_exchange(gw_url, head.encode("latin-1"))
    policy = values(headers, "RateLimit-Policy")
    return status, policy[0].split(";")[0].strip('"') if policy else None, json.loads(body)


async def forwarded(gw_url: str, seen: list[str], target: str, method: str = "GET") -> tuple[str, str]:
    """The route taken and the path the upstream received, for a request the gateway forwards."""
    before = len(seen)
    status, route, body = await send(gw_url, target, method)
    assert status == 200, body
    assert len(seen) == before + 1
    assert body["path"] == seen[-1]
    return route, seen[-1]


async def refused(gw_url: str, seen: list[str], target: str, method: str = "GET") -> dict:
    """A 400 problem that neither the limiter nor the upstream heard of."""
    before = len(seen)
    head = f"{method} {target} HTTP/1.1\r\nHost: gw\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    status, headers, body = await raw_exchange(gw_url, head.encode("latin-1"))
    assert status == 400, body
    assert values(headers, "Content-Type") == ["application/problem+json; charset=utf-8"]
    assert values(headers, "RateLimit-Policy") == []
    assert len(seen) == before
    problem = json.loads(body)
    assert problem["status"] == 400
    assert target not in problem["detail"]  # echoes nothing the client sent
    return problem


# --- the reported examples, in each setting ----------------------------------------


@pytest.mark.parametrize("setting", SETTINGS)
async def test_percent_encoded_dot_segments_are_resolved_and_the_resolved_path_forwarded(recorder, setting):
    upstream, seen = recorder
    async with running_gateway(paths_config(upstream, setting)) as gw:
        for target in ("/api/%2e%2e/x", "/api/%2E%2e/x", "/api/.%2e/x", "/api/../x"):
            if setting == "dots_reject":
                await refused(gw.url, seen, target)
            else:
                assert await forwarded(gw.url, seen, target) == ("rest", "/x")
        if setting != "dots_reject":
            # Resolved into a limited route, the limit is charged and the resolved path is sent.
            assert await forwarded(gw.url, seen, "/public/%2e%2e/api/x") == ("api", "/api/x")
            assert await forwarded(gw.url, seen, "/api/x/%2e/y") == ("api", "/api/x/y")


@pytest.mark.parametrize("setting", SETTINGS)
async def test_a_segment_with_parameters_is_refused_unless_the_route_allows_them(recorder, setting):
    upstream, seen = recorder
    async with running_gateway(paths_config(upstream, setting)) as gw:
        await refused(gw.url, seen, "/api;x/y")
        await refused(gw.url, seen, "/public/..;/api/x")
        await refused(gw.url, seen, "/api/reports;x", method="POST")
        await refused(gw.url, seen, "/api;/y")
    async with running_gateway(paths_config(upstream, setting, parameters=True)) as gw:
        # Matched without its parameters, forwarded with them: a servlet container reads the same path.
        assert await forwarded(gw.url, seen, "/api;x/y") == ("api", "/api;x/y")
        if setting == "dots_reject":
            await refused(gw.url, seen, "/public/..;/api/x")
        else:
            assert await forwarded(gw.url, seen, "/public/..;/api/x") == ("api", "/api/x")
        assert await forwarded(gw.url, seen, "/api/reports;x", method="POST") == ("reports", "/api/reports;x")
        # The reports limit (burst 1) was charged: the plain path now finds it empty.
        status, route, _ = await send(gw.url, "/api/reports", method="POST")
        assert (status, route) == (429, "reports")


@pytest.mark.parametrize("setting", SETTINGS)
async def test_post_with_a_parameter_never_escapes_the_reports_limit(recorder, setting):
    upstream, seen = recorder
    async with running_gateway(paths_config(upstream, setting)) as gw:
        # Refused before the limiter: the reports bucket (burst 1) still holds its token.
        await refused(gw.url, seen, "/api/reports;x", method="POST")
        assert await forwarded(gw.url, seen, "/api/reports", method="POST") == ("reports", "/api/reports")
        await refused(gw.url, seen, "/api/reports;x", method="POST")
        status, route, _ = await send(gw.url, "/api/reports", method="POST")
        assert (status, route) == (429, "reports")


@pytest.mark.parametrize("setting", SETTINGS)
async def test_matching_is_case_sensitive_unless_the_route_says_otherwise(recorder, setting):
    upstream, seen = recorder
    async with running_gateway(paths_config(upstream, setting)) as gw:
        # /API/x is another resource to a case-sensitive upstream, and it is sent as it was matched.
        assert await forwarded(gw.url, seen, "/API/x") == ("rest", "/API/x")
    async with running_gateway(paths_config(upstream, setting, case_insensitive=True)) as gw:
        assert await forwarded(gw.url, seen, "/API/x") == ("api", "/API/x")
        assert await forwarded(gw.url, seen, "/Api/Reports", method="POST") == ("reports", "/Api/Reports")
        status, route, _ = await send(gw.url, "/api/reports", method="POST")
        assert (status, route) == (429, "reports")
        assert await forwarded(gw.url, seen, "/PUBLIC/x") == ("rest", "/PUBLIC/x")


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("target", ["/api%20/x", "/api%20", "/%20api/x", "/api%09/x", "/api%00/x", "/api/x%0a"])
async def test_a_segment_with_surrounding_whitespace_or_a_control_character_is_refused(recorder, setting, target):
    upstream, seen = recorder
    async with running_gateway(paths_config(upstream, setting)) as gw:
        await refused(gw.url, seen, target)
        # A space inside a segment is an ordinary character.
        assert await forwarded(gw.url, seen, "/api/my%20report") == ("api", "/api/my%20report")


# --- encoded slashes --------------------------------------------------------------------


@pytest.mark.parametrize("setting", SETTINGS)
async def test_an_encoded_slash_stays_in_its_segment_or_is_refused_or_decoded(recorder, setting):
    upstream, seen = recorder
    async with running_gateway(paths_config(upstream, setting)) as gw:
        if setting == "escaped_slashes_reject":
            for target in ("/api/projects/group%2Fproject", "/api%2Freports", "/api%2fx"):
                await refused(gw.url, seen, target)
            return
        if setting == "escaped_slashes_decode":
            assert await forwarded(gw.url, seen, "/api/projects/group%2Fproject") == ("api", "/api/projects/group/project")
            assert await forwarded(gw.url, seen, "/api%2Freports", method="POST") == ("reports", "/api/reports")
            assert await forwarded(gw.url, seen, "/public/..%2Fapi/x") == ("api", "/api/x")
            return
        # keep: one segment for matching and for forwarding, so group%2Fproject keeps working
        assert await forwarded(gw.url, seen, "/api/projects/group%2Fproject") == ("api", "/api/projects/group%2Fproject")
        assert await forwarded(gw.url, seen, "/api/projects/group%2fproject") == ("api", "/api/projects/group%2Fproject")
        assert await forwarded(gw.url, seen, "/api%2Freports", method="POST") == ("rest", "/api%2Freports")
        # A dot segment hidden behind an encoded slash would be resolved by an upstream that decodes it.
        await refused(gw.url, seen, "/public/..%2Fapi/x")
        await refused(gw.url, seen, "/public/x%2F%2e%2e%2F..%2Fapi")


# --- the rest of the rule -----------------------------------------------------------------


@pytest.mark.parametrize("setting", SETTINGS)
async def test_repeated_slashes_are_merged_unless_merge_slashes_is_off(recorder, setting):
    upstream, seen = recorder
    async with running_gateway(paths_config(upstream, setting)) as gw:
        if setting == "merge_slashes_off":
            # Kept, and matched as they are: //api is not /api, and is sent as //api.
            assert await forwarded(gw.url, seen, "//api//x") == ("rest", "//api//x")
            assert await forwarded(gw.url, seen, "/api//x") == ("api", "/api//x")
        else:
            assert await forwarded(gw.url, seen, "//api//x") == ("api", "/api/x")
            assert await forwarded(gw.url, seen, "/api/x/") == ("api", "/api/x/")


@pytest.mark.parametrize(
    "target", ["/api/%zz", "/api/%2", "/api/x%", "/api/%c0%ae%c0%ae/x", "/api/%ff", "/api\\..\\x", "/api/a#b", "/api/{x}"]
)
async def test_a_path_that_is_not_well_formed_is_refused(recorder, target):
    upstream, seen = recorder
    async with running_gateway(paths_config(upstream)) as gw:
        await refused(gw.url, seen, target)


@pytest.mark.parametrize("target", ["/api/\x7fx", "/api/caf\xc3\xa9", "/api/a b"])
async def test_bytes_the_http_parser_refuses_never_reach_the_upstream(recorder, target):
    # aiohttp's parser answers these itself, before the gateway sees the request.
    upstream, seen = recorder
    async with running_gateway(paths_config(upstream)) as gw:
        head = f"GET {target} HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n"
        status, _, _ = await raw_exchange(gw.url, head.encode("latin-1"))
        assert status == 400
        assert seen == []


async def test_percent_encoding_is_made_canonical_when_forwarded(recorder):
    upstream, seen = recorder
    async with running_gateway(paths_config(upstream)) as gw:
        # Unreserved characters are decoded (RFC 3986 §6.2.2.2), so an upstream that reads
        # paths without decoding them sees what was matched; other escapes get upper-case hex.
        assert await forwarded(gw.url, seen, "/%61pi/x") == ("api", "/api/x")
        assert await forwarded(gw.url, seen, "/api/caf%c3%a9?q=%2e") == ("api", "/api/caf%C3%A9?q=%2e")
        assert await forwarded(gw.url, seen, "/api/a%3Bb") == ("api", "/api/a%3Bb")  # %3B is data, not a parameter
        assert await forwarded(gw.url, seen, "/api/.well-known/x.json") == ("api", "/api/.well-known/x.json")


# --- strip_prefix ---------------------------------------------------------------------------


@pytest.mark.parametrize("setting", SETTINGS)
async def test_strip_prefix_removes_the_matched_segments_from_the_forwarded_path(recorder, setting):
    upstream, seen = recorder
    async with running_gateway(paths_config(upstream, setting)) as gw:
        assert await forwarded(gw.url, seen, "/svc/a/b?x=1") == ("svc", "/a/b?x=1")
        assert await forwarded(gw.url, seen, "/svc") == ("svc", "/")
        assert await forwarded(gw.url, seen, "/svc/") == ("svc", "/")
        assert await forwarded(gw.url, seen, "/svc/a/") == ("svc", "/a/")
        await refused(gw.url, seen, "/svc;x/a")
        if setting == "dots_reject":
            await refused(gw.url, seen, "/svc/%2e%2e/api/x")
        else:
            # Resolved first: this is the /api route, and nothing is stripped.
            assert await forwarded(gw.url, seen, "/svc/%2e%2e/api/x") == ("api", "/api/x")
            assert await forwarded(gw.url, seen, "/svc/a/%2e%2e/b") == ("svc", "/b")
            assert await forwarded(gw.url, seen, "/x/../svc/b") == ("svc", "/b")
        if setting == "escaped_slashes_reject":
            await refused(gw.url, seen, "/svc/group%2Fproject")
        elif setting == "escaped_slashes_decode":
            assert await forwarded(gw.url, seen, "/svc/group%2Fproject") == ("svc", "/group/project")
            assert await forwarded(gw.url, seen, "/svc%2Fb") == ("svc", "/b")
        else:
            assert await forwarded(gw.url, seen, "/svc/group%2Fproject") == ("svc", "/group%2Fproject")
            assert await forwarded(gw.url, seen, "/svc%2Fb") == ("rest", "/svc%2Fb")
        if setting == "merge_slashes_off":
            assert await forwarded(gw.url, seen, "/svc//b") == ("svc", "//b")
        else:
            assert await forwarded(gw.url, seen, "//svc//b") == ("svc", "/b")
    async with running_gateway(paths_config(upstream, setting, parameters=True)) as gw:
        # The stripped segment goes with its parameters; the rest keeps theirs.
        assert await forwarded(gw.url, seen, "/svc;v=1/a;b=2") == ("svc", "/a;b=2")


async def test_strip_prefix_on_a_case_insensitive_route_strips_the_segments_as_sent(recorder):
    upstream, _seen = recorder
    config = f"""
routes:
  - match: {{path: /svc/v1, case_sensitive: false}}
    upstream: {upstream}
    strip_prefix: true
"""
    async with running_gateway(config) as gw:
        for target, received in {"/SVC/V1/a/B": "/a/B", "/Svc/%76%31": "/", "/svc/V1/%2e%2e/v1/x": "/x"}.items():
            status, _, body = await send(gw.url, target)
            assert (status, body["path"]) == (200, received)
        status, _, _ = await send(gw.url, "/svc/v2/x")
        assert status == 404


# --- WebSocket handshakes take the same path ------------------------------------------------


def ws_handshake(target: str, connection: str = "Upgrade") -> bytes:
    return (
        f"GET {target} HTTP/1.1\r\nHost: gw\r\nConnection: {connection}\r\nUpgrade: websocket\r\n"
        "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        "Sec-WebSocket-Protocol: chat\r\n\r\n"
    ).encode()


async def test_a_websocket_handshake_is_forwarded_on_the_resolved_path(upstream):
    config = f"routes:\n  - match: {{path: /}}\n    upstream: {upstream}\n"
    async with running_gateway(config) as gw:
        # The upstream serves WebSockets on /ws only: it must get the resolved path, not the raw one.
        target = URL(gw.url)
        reader, writer = await asyncio.open_connection(target.host, target.port)
        try:
            writer.write(ws_handshake("/x/%2e%2e/ws"))
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        finally:
            writer.close()
            await writer.wait_closed()
        assert head.startswith(b"HTTP/1.1 101"), head
        status, _, body = await raw_exchange(gw.url, ws_handshake("/ws;x", connection="Upgrade, close"))
        assert status == 400, body


async def test_an_absolute_form_target_is_read_by_the_same_rule(recorder):
    upstream, seen = recorder
    async with running_gateway(paths_config(upstream)) as gw:
        assert await forwarded(gw.url, seen, "http://gw/api/%2e%2e/public/x?q=1") == ("public", "/public/x?q=1")
        await refused(gw.url, seen, "http://gw/api;x/y")
        assert await forwarded(gw.url, seen, "http://gw?q=1") == ("rest", "/?q=1")


# --- the setting in the config ---------------------------------------------------------------


def test_the_setting_and_route_options_are_read_and_default_to_the_safe_choices():
    config = config_from_yaml(paths_config("http://up.internal"))
    assert config.path_normalization == PathNormalization(
        dot_segments=DotSegments.RESOLVE, escaped_slashes=EscapedSlashes.KEEP, merge_slashes=True
    )
    assert all(route.match.case_sensitive and not route.allow_path_parameters for route in config.routes)
    # A route path is written decoded; any that a request path can match is accepted.
    for path in ("/files/my docs", "/café", "/api/reports/", "/a-b_c~d/!$&'()*+,=:@"):
        route = config_from_yaml(f"routes:\n  - match: {{path: \"{path}\"}}\n    upstream: http://up.internal\n").routes[0]
        assert route.match.path == path.rstrip("/")
    config = config_from_yaml(
        "path_normalization: {dot_segments: reject, escaped_slashes: decode, merge_slashes: false}\n"
        + paths_config("http://up.internal", parameters=True, case_insensitive=True)
    )
    assert config.path_normalization == PathNormalization(
        dot_segments=DotSegments.REJECT, escaped_slashes=EscapedSlashes.DECODE, merge_slashes=False
    )
    assert not config.routes[1].match.case_sensitive
    assert config.routes[1].allow_path_parameters


def test_gateway_check_shows_the_setting_and_the_route_options(tmp_path):
    path = tmp_path / "gw.yaml"
    path.write_text(
        "path_normalization: {escaped_slashes: reject}\n"
        + paths_config("http://127.0.0.1:9000", parameters=True, case_insensitive=True)
    )
    result = run_cli("check", "-c", str(path))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "paths: dot_segments resolve, escaped_slashes reject, merge_slashes true" in lines
    assert "  [1] /api -> http://127.0.0.1:9000: api (cost 1); allow_path_parameters, case-insensitive, " \
        "timeout connect 5s read 60s" in lines


ROUTE = "routes:\n  - match: {path: /api}\n    upstream: http://up.internal\n"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("path_normalization: {dot_segments: drop}\n" + ROUTE,
         "path_normalization.dot_segments: expected resolve or reject, got 'drop'"),
        ("path_normalization: {escaped_slashes: true}\n" + ROUTE,
         "path_normalization.escaped_slashes: expected keep, reject or decode, got True"),
        ("path_normalization: {merge_slashes: sometimes}\n" + ROUTE,
         "path_normalization.merge_slashes: expected true or false, got a string"),
        ("path_normalization: {normalize: true}\n" + ROUTE,
         "path_normalization.normalize: unknown key (expected one of: dot_segments, escaped_slashes, merge_slashes)"),
        ("path_normalization: resolve\n" + ROUTE, "path_normalization: expected a mapping, got a string"),
        (ROUTE.replace("/api}", "/api, case_sensitive: nope}"), "routes[0].match.case_sensitive: expected true or false"),
        (ROUTE + "    allow_path_parameters: 1\n", "routes[0].allow_path_parameters: expected true or false"),
        (ROUTE.replace("/api}", "/api%2Fv1}"), "routes[0].match.path: write the path decoded"),
        (ROUTE.replace("/api}", "/api;v=1}"), "routes[0].match.path: write the path decoded"),
        (ROUTE.replace("/api}", "/api/../admin}"), "routes[0].match.path: expected a path without empty, '.' or '..'"),
        (ROUTE.replace("/api}", "//api}"), "routes[0].match.path: expected a path without empty"),
        (ROUTE.replace("/api}", "'/api /x'}"), "routes[0].match.path: a segment may not begin or end with a space"),
        (ROUTE.replace("/api}", "api}"), "routes[0].match.path: expected a path starting with /, got 'api'"),
        (ROUTE.replace("/api}", "'/api?x'}"), "routes[0].match.path: write the path decoded"),
        (ROUTE.replace("/api}", "'/api\\\\x'}"), "routes[0].match.path: write the path decoded"),
    ],
)
def test_a_bad_setting_or_route_path_is_a_one_line_config_error(text, expected):
    with pytest.raises(ConfigError) as info:
        parse_config(text, source="gw.yaml", environ={})
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("gw.yaml: " + expected), message
