"""Fuzzing what the gateway says about itself: for an arbitrary request
head (methods, targets, versions, header names and values, any bytes), every answer
the gateway makes itself is problem+json that repeats none of it, no answer
carries a Server banner, and nothing is logged with a traceback.

The gateway runs as users start it (`python -m gateway run --log-level debug`), in
front of a real aiohttp upstream in a thread of its own (Hypothesis drives the test
synchronously) that answers `ok` and repeats nothing either."""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator

import pytest
from aiohttp import web
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.processes import GatewayProcess
from tests.upstream import serving_in_a_thread

# A marker in every piece the client controls; it must never come back from the gateway.
MARK = b"Zq7"
CONFIG = """
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
limits:
  per_key: {{rate: 1000000/hour, key: [header:X-Api-Key, 'query:key', ip]}}
routes:
  - match: {{path: /api}}
    upstream: {upstream}
    limits: [per_key]
"""

# Mostly visible ASCII, so that many requests pass the parser and reach the gateway's own
# checks (Host, version, path, identity, Expect); now and then any byte at all.
visible = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=6).map(str.encode)
odd_bytes = st.binary(max_size=6)
special = st.sampled_from([b"<script>", b"%00", b"%2e%2e", b";", b"@", b"/"])
pieces = st.lists(
    st.integers(0, 5).flatmap(lambda i: odd_bytes if i == 0 else special if i == 1 else visible), max_size=4
).map(lambda parts: MARK + b"".join(parts))
known_methods = st.sampled_from([b"GET", b"GET", b"GET", b"POST", b"PUT", b"CONNECT", b"OPTIONS"])


def mostly(usual: st.SearchStrategy[bytes], rare: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """`usual` three times in four (one_of would weigh the two alike)."""
    return st.integers(0, 3).flatmap(lambda i: rare if i == 0 else usual)


methods = mostly(known_methods, st.one_of(pieces, st.sampled_from([b"FOO", b"get"])))
targets = mostly(
    st.one_of(
        st.builds(lambda p: b"/api/" + p, pieces),
        st.builds(lambda p: b"/api?key=" + p, pieces),
        st.builds(lambda p: b"/elsewhere/" + p, pieces),
    ),
    pieces,
)
versions = st.sampled_from([b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.2", b"HTTP/0.9", b"HTTP/1.1 x", b"http/1.1"])
header_lines = st.lists(
    st.one_of(
        st.builds(lambda v: b"X-Api-Key: " + v, pieces),
        st.builds(lambda v: b"Host: " + v, pieces),
        st.builds(lambda v: b"Expect: " + v, pieces),
        st.builds(lambda n, v: n + b": " + v, pieces, pieces),
        pieces,
    ),
    max_size=3,
)


@contextlib.contextmanager
def upstream_in_a_thread() -> Iterator[str]:
    """aiohttp's low-level server, which answers whatever it is handed (no router, so no 417
    or 405 of its own), on an event loop in a thread."""

    async def ok(request: web.BaseRequest) -> web.Response:
        await request.read()
        return web.Response(text="ok", headers={"X-Upstream": "1"})

    with serving_in_a_thread(ok) as url:
        yield url


@pytest.fixture(scope="module")
def gateway():
    with upstream_in_a_thread() as upstream:
        with GatewayProcess(CONFIG.format(upstream=upstream), args=("--log-level", "debug")) as gw:
            yield gw
        assert not any("Traceback" in line for line in gw.stderr_lines), "".join(gw.stderr_lines)


def exchange(url: str, request: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=methods, target=targets, version=versions, lines=header_lines)
def test_no_answer_of_the_gateways_own_repeats_what_the_client_sent(gateway, method, target, version, lines):
    head = method + b" " + target + b" " + version + b"\r\nHost: gw\r\n" + b"".join(line + b"\r\n" for line in lines)
    data = exchange(gateway.url, head + b"Connection: close\r\n\r\n")
    head_bytes, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_fields = head_bytes.split(b"\r\n")
    status = int(status_line.split()[1])
    headers = {n.strip().lower(): v.strip() for n, _, v in (f.partition(b":") for f in header_fields)}
    event(f"status {status}")
    assert b"server" not in headers
    if headers.get(b"x-upstream") == b"1":
        assert (status, body) == (200, b"ok")  # the upstream's own answer, passed on
        return
    assert headers[b"content-type"] == b"application/problem+json; charset=utf-8", data
    problem = json.loads(body)
    assert problem["status"] == status
    event(f"{status}: {problem['detail']}")
    assert MARK not in data and b"script" not in data, data
