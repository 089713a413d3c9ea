"""Fuzzing the path rule through the gateway : an arbitrary raw path is
either forwarded exactly as it was matched, or refused.

The gateway runs as users start it (`python -m gateway run`), in front of a real
aiohttp upstream (in a thread of its own, since Hypothesis drives the test
synchronously) that answers with the raw path it received and its own decoded
reading of it. Each route applies its own limit, so RateLimit-Policy names the
route charged. For every path Hypothesis builds, sent verbatim over a socket:

- a refusal (400) reached neither the limiter nor the upstream;
- otherwise the upstream received the path the rule forwards, that path read
  again by the rule is itself and selects the route that was charged, and
  aiohttp's own decoding of it, where it reads paths the same way (no `;`, no
  encoded slash), selects that route too.
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator

import pytest
from aiohttp import web
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from gateway.proxy.paths import PathRejected, normalize_path
from gateway.proxy.routing import Router
from gateway.testing import config_from_yaml
from tests.processes import GatewayProcess
from tests.upstream import serving_in_a_thread

FUZZ_CONFIG = """
limits:
  reports: {{rate: 1000000/hour}}
  api: {{rate: 1000000/hour}}
  public: {{rate: 1000000/hour}}
  svc: {{rate: 1000000/hour}}
  rest: {{rate: 1000000/hour}}
routes:
  - match: {{path: /api/reports, case_sensitive: false}}
    upstream: {upstream}
    limits: [reports]
  - match: {{path: /api}}
    upstream: {upstream}
    limits: [api]
    allow_path_parameters: true
  - match: {{path: /public}}
    upstream: {upstream}
    limits: [public]
  - match: {{path: /svc}}
    upstream: {upstream}
    limits: [svc]
    strip_prefix: true
  - match: {{path: /}}
    upstream: {upstream}
    limits: [rest]
"""
# Segments: the routes' names (so that limited routes are reached), dot segments, and
# pieces that change how a segment is read, or that the HTTP parser refuses (a space
# would end the target, so it is left to test_paths).
NAMES = ["api", "API", "reports", "Reports", "public", "svc", "x", "", ".", "..", "%2e%2e", "%2E", ".%2e", "..;"]
PIECES = [
    ".", "..", "%2e", "%2f", "%2F", "%5c", ";", ";v=1", "%3b", "%25", "%20", "%00", "%c3%a9", "%ff", "%",
    "%41", "%61", "a", "=", "~", "\\", "#", "\u00e9", "\x7f", "api", "reports",
]
segments = st.one_of(st.sampled_from(NAMES), st.lists(st.sampled_from(PIECES), min_size=1, max_size=3).map("".join))
# Most paths start on a limited route, so that it is its limit that must be charged.
heads = st.one_of(st.sampled_from(["api", "api/reports", "API/Reports", "public", "svc", "svc;v=1"]), segments)
targets = st.builds(
    lambda head, tail, query: "/" + "/".join([head, *tail]) + query,
    heads,
    st.lists(segments, max_size=5),
    st.sampled_from(["", "", "?q=%2e%2e/x", "?"]),
)


@contextlib.contextmanager
def recorder_in_a_thread() -> Iterator[tuple[str, list[str]]]:
    """A real aiohttp upstream on its own event loop; answers {raw, decoded} and records raw."""
    seen: list[str] = []

    async def record(request: web.BaseRequest) -> web.Response:
        seen.append(request.raw_path)
        return web.json_response({"raw": request.raw_path, "decoded": request.path})

    with serving_in_a_thread(record) as url:
        yield url, seen


@pytest.fixture(
    scope="module",
    params=[
        "",
        "path_normalization: {escaped_slashes: reject}\n",
        "path_normalization: {dot_segments: reject, escaped_slashes: decode, merge_slashes: false}\n",
    ],
    ids=["default", "escaped_slashes_reject", "dots_reject_decode_keep_empty"],
)
def fuzzed(request):
    with recorder_in_a_thread() as (upstream, seen):
        config = request.param + FUZZ_CONFIG.format(upstream=upstream)
        with GatewayProcess(config) as gw:
            yield gw, seen, config_from_yaml(config)


def exchange(url: str, target: str) -> tuple[int, dict[str, str], bytes]:
    host, port = url.removeprefix("http://").split(":")
    request = f"GET {target} HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n".encode("utf-8", "surrogateescape")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def route_of(router: Router, path: str) -> str:
    return router.find("GET", "gw", path).limits[0].limit.name


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(target=targets)
@example(target="/api/%2e%2e/x")
@example(target="/api;x/y")
@example(target="/public/..;/api/x")
@example(target="/API/x")
@example(target="/api%20/x")
@example(target="/svc/%2e%2e/api;v=1/x?q=%2e")
@example(target="/svc;x/a")
def test_an_arbitrary_path_is_forwarded_exactly_as_matched_or_refused(fuzzed, target):
    gw, seen, config = fuzzed
    router = Router(config.routes)
    before = len(seen)
    status, headers, body = exchange(gw.url, target)
    event(f"status {status}")
    if status == 400:
        assert len(seen) == before, "a refused request reached the upstream"
        assert "ratelimit-policy" not in headers, "a refused request was charged"
        return
    assert status == 200, body
    assert len(seen) == before + 1
    charged = headers["ratelimit-policy"].split(";")[0].strip('"')
    event(f"charged {charged}")
    upstream = json.loads(body)
    received, _, query = upstream["raw"].partition("?")
    assert query == target.partition("?")[2].partition("#")[0]

    # The gateway's own reading of the target, and what it forwarded.
    rule = config.path_normalization
    path = normalize_path(target.partition("?")[0], rule)
    assert route_of(router, path.match) == charged
    if charged == "svc":
        assert received == "/" + path.forward.split("/", 2)[2] if path.forward.count("/") > 1 else received == "/"
        return  # the upstream saw the path less its prefix; the rest is checked above
    assert received == path.forward

    # Read again by the rule, what the upstream received is itself, and selects the route charged.
    again = normalize_path(received, rule)
    assert again.forward == received
    assert route_of(router, again.match) == charged

    # An upstream that decodes the path (aiohttp does, %2F to "/" included) and knows
    # nothing of ";" parameters reaches the same route, wherever it reads paths the same way.
    if ";" not in received and "%2F" not in received:
        assert route_of(router, upstream["decoded"]) == charged


def test_a_path_the_rule_refuses_is_refused_by_the_gateway(fuzzed):
    gw, seen, config = fuzzed
    for target in ("/api%20/x", "/public/..%5Capi", "/api/%ff", "/a\\b"):
        with pytest.raises(PathRejected):
            normalize_path(target, config.path_normalization)
        before = len(seen)
        status, headers, _ = exchange(gw.url, target)
        assert status == 400
        assert headers["content-type"] == "application/problem+json; charset=utf-8"
        assert len(seen) == before
