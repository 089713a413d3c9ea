"""What the gateway says about itself: errors are problem+json and echo
nothing the client sent, no internals or version banner leak, odd request lines
and Host values are refused, and secrets never reach an error message or a log.

Requests go over raw sockets to a real gateway in front of the real aiohttp
upstream; what is logged is read from a real `python -m gateway run` process."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from gateway.config import ConfigError, parse_config
from gateway.config.redaction import redacted_url as redacted
from gateway.testing import running_gateway
from tests.processes import GatewayProcess, free_port
from tests.raw_client import raw_exchange, values
from tests.scrape import scrape, value

KEY = "sekrit-key-77c1"


def catch_all(upstream: str) -> str:
    return f"""
limits:
  per_key: {{rate: 100/second, burst: 100, key: ['query:key', ip]}}
routes:
  - match: {{path: /}}
    upstream: {upstream}
    limits: [per_key]
"""


@pytest.fixture
async def gw(upstream):
    async with running_gateway(catch_all(upstream)) as gateway:
        yield gateway


# Requests aiohttp's parser (llhttp) refuses, each carrying bytes that must not come back.
MALFORMED = {
    "control character in a header value": f"GET /echo HTTP/1.1\r\nHost: gw\r\nX-Api-Key: <script>{KEY}\x01\r\n\r\n",
    "control character in a header name": f"GET /echo HTTP/1.1\r\nHost: gw\r\nX-<script>{KEY}\x01: 1\r\n\r\n",
    "unknown method FOO": f"FOO /<script>{KEY} HTTP/1.1\r\nHost: gw\r\n\r\n",
    "control character in the method": f"GE\x01T /<script>{KEY} HTTP/1.1\r\nHost: gw\r\n\r\n",
    "control character in the target": f"GET /<script>{KEY}\x01 HTTP/1.1\r\nHost: gw\r\n\r\n",
    "Content-Length with Transfer-Encoding": (
        f"POST /echo HTTP/1.1\r\nHost: gw\r\nX-Api-Key: {KEY}\r\nContent-Length: 5\r\n"
        "Transfer-Encoding: chunked<script>\r\n\r\n0\r\n\r\n"
    ),
    "bare LF": f"GET /<script>{KEY} HTTP/1.1\nHost: gw\n\n",
    "TLS on the plain port": "\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + KEY,
}


@pytest.mark.parametrize("request_text", MALFORMED.values(), ids=MALFORMED.keys())
async def test_a_request_the_parser_refuses_gets_a_problem_that_echoes_nothing(gw, request_text):
    status, headers, body = await raw_exchange(gw.url, request_text.encode("latin-1"))
    assert status == 400
    assert values(headers, "Content-Type") == ["application/problem+json; charset=utf-8"]
    problem = json.loads(body)
    assert problem["status"] == 400 and problem["title"] == "Bad Request"
    assert KEY.encode() not in body and b"script" not in body and b"FOO" not in body
    assert values(headers, "Server") == []


async def test_a_417_does_not_echo_the_expectation(gw):
    request = f"POST /echo HTTP/1.1\r\nHost: gw\r\nContent-Length: 0\r\nExpect: <script>{KEY}\r\nConnection: close\r\n\r\n"
    status, _headers, body = await raw_exchange(gw.url, request.encode())
    assert status == 417
    assert json.loads(body)["status"] == 417
    assert KEY.encode() not in body and b"script" not in body


async def test_requests_the_parser_refuses_are_counted(gw, client):
    for request_text in MALFORMED.values():
        await raw_exchange(gw.url, request_text.encode("latin-1"))
    _, samples = await scrape(client, gw.admin_url)
    assert value(samples, "gateway_requests_total", route="unmatched", method="OTHER", status_class="4xx") == len(MALFORMED)


async def test_malformed_requests_log_no_traceback_even_at_debug_level(upstream):
    with GatewayProcess(catch_all(upstream), args=("--log-level", "debug")) as gw:
        for request_text in MALFORMED.values():
            status, _, _ = await raw_exchange(gw.url, request_text.encode("latin-1"))
            assert status == 400
        assert await asyncio.to_thread(gw.stop) == 0
    log = "".join(gw.stderr_lines)
    assert "gateway: stopped" in log  # read to the end
    assert "Traceback" not in log, log
    assert KEY not in log
    assert log.count("refused a malformed request") == len(MALFORMED)


async def test_a_502_names_no_address_and_the_detail_is_logged():
    port = free_port()
    with GatewayProcess(catch_all(f"http://127.0.0.1:{port}")) as gw:
        async with aiohttp.ClientSession() as client, client.get(gw.url + "/anything") as response:
            assert response.status == 502
            body = await response.read()
        assert await asyncio.to_thread(gw.stop) == 0
    problem = json.loads(body)
    assert problem["detail"] == "Cannot connect to the upstream."
    assert str(port).encode() not in body and b"127.0.0.1" not in body
    assert any(f"127.0.0.1:{port}" in line and "cannot connect" in line for line in gw.stderr_lines)


@pytest.mark.parametrize(
    "request_text",
    [
        "GET /echo HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n",  # proxied: the upstream is aiohttp too
        "GET /echo HTTP/1.1\r\nHost: gw\r\nConnection: close\r\nX: \x01\r\n\r\n",  # refused by the parser
        "GET /echo HTTP/1.1\r\nHost: a/b\r\nConnection: close\r\n\r\n",  # refused by the gateway
    ],
    ids=["proxied", "parser 400", "gateway 400"],
)
async def test_no_response_carries_a_server_banner(gw, request_text):
    _, headers, _ = await raw_exchange(gw.url, request_text.encode("latin-1"))
    assert values(headers, "Server") == []


async def test_the_admin_listener_carries_no_server_banner(gw):
    async with aiohttp.ClientSession() as client, client.get(gw.admin_url + "/healthz") as response:
        assert response.status == 200
        assert "Server" not in response.headers


@pytest.mark.parametrize("version", ["2.0", "0.9"])
async def test_an_http_2_request_line_over_http_1_gets_505(gw, version):
    # llhttp reads these two versions; others (1.2, 3.0) it refuses itself with a 400.
    request = f"GET /echo HTTP/{version}\r\nHost: gw\r\nConnection: close\r\n\r\n".encode()
    target = gw.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(target[0], int(target[1]))
    try:
        writer.write(request)
        data = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
        await writer.wait_closed()
    assert data.startswith(b"HTTP/1.1 505 HTTP Version Not Supported\r\n"), data[:100]
    _head, _, body = data.partition(b"\r\n\r\n")
    assert json.loads(body)["status"] == 505
    assert b"/echo" not in body


@pytest.mark.parametrize(
    "host_lines",
    ["Host: evil.example/@x\r\n", "Host: \r\n", "Host: user@gw\r\n", "Host: gw:80:80\r\n", "Host: a\r\nHost: b\r\n", ""],
    ids=["slash and at", "empty", "userinfo", "two ports", "twice", "missing on HTTP/1.1"],
)
async def test_a_host_that_is_not_a_host_gets_400_and_is_not_forwarded(gw, host_lines):
    request = f"GET /echo/host HTTP/1.1\r\n{host_lines}Connection: close\r\n\r\n".encode()
    status, headers, body = await raw_exchange(gw.url, request)
    assert status == 400, body
    assert values(headers, "Content-Type") == ["application/problem+json; charset=utf-8"]
    assert b"evil" not in body and b"user" not in body


@pytest.mark.parametrize("host", ["gw", "gw:8080", "api.example.com.", "127.0.0.1:1", "[::1]:1", "under_score"])
async def test_a_valid_host_is_forwarded(gw, host):
    status, _, body = await raw_exchange(gw.url, f"GET /echo/h HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
    assert status == 200, body


async def test_http_1_0_may_omit_host(gw):
    status, _, body = await raw_exchange(gw.url, b"GET /echo/old HTTP/1.0\r\n\r\n")
    assert status == 200, body
    assert json.loads(body)["path"] == "/echo/old"


# --- secrets ------------------------------------------------------------------------


PASSWORD = "hunter2-s3cret"
ROUTE = "routes:\n  - match: {path: /}\n    upstream: http://127.0.0.1:9000\n"


@pytest.mark.parametrize(
    "url",
    [
        f"redis://gw:{PASSWORD}@redis:notaport/0",  # bad port
        f"memcached://gw:{PASSWORD}@redis:6379/0",  # unsupported scheme
        f"redis://gw:{PASSWORD}#x@redis:6379/0",  # unencoded # in the password
        f"redis://gw:{PASSWORD}/x@redis:6379/0",  # unencoded /
        f"redis://gw:{PASSWORD}?x@redis:6379/0",  # unencoded ?
        f"redis://:{PASSWORD}@redis:6379/zero",  # bad database
        f"redis://{PASSWORD}@redis:6379/0?timeout=1",  # a password in the user position, and a bad option
        f"redis+sentinel://:{PASSWORD}@s1:26379,s2:x/mymaster",  # bad sentinel port
        f"redis+cluster://:{PASSWORD}@n1:7000/3",  # a database on a cluster
        f"unix://:{PASSWORD}@",  # no socket path
    ],
)
def test_a_config_error_about_the_store_url_never_shows_the_password(url):
    with pytest.raises(ConfigError) as info:
        parse_config(f"store: {{url: '{url}'}}\n" + ROUTE, source="gw.yaml", environ={})
    message = str(info.value)
    assert message.startswith("gw.yaml: store.url: "), message
    assert PASSWORD not in message, message
    assert "hunter2" not in message, message


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (f"redis://gw:{PASSWORD}@redis:6379/0", "redis://gw:***@redis:6379/0"),
        (f"redis://:{PASSWORD}@redis:6379/0", "redis://:***@redis:6379/0"),
        (f"redis://{PASSWORD}@redis:6379/0", "redis://***@redis:6379/0"),  # the password in the user position
        (f"redis://gw:{PASSWORD}#x@redis:6379/0", "redis://gw:***@redis:6379/0"),
        (f"redis://gw:{PASSWORD}/x?y@redis:6379/0", "redis://gw:***@redis:6379/0"),
        (f"redis+sentinel://:{PASSWORD}@s1:26379,s2/mymaster?db=1", "redis+sentinel://:***@s1:26379,s2/mymaster?db=1"),
        ("redis://redis:6379/0", "redis://redis:6379/0"),
        ("unix:///run/redis.sock?db=2", "unix:///run/redis.sock?db=2"),
    ],
)
def test_redacted_store_urls_hide_the_password_wherever_it_is_written(url, shown):
    assert redacted(url) == shown


async def test_the_access_log_never_writes_query_values(upstream):
    with GatewayProcess(catch_all(upstream), args=("--access-log",)) as gw:
        async with aiohttp.ClientSession() as client:
            for target in (f"/echo/a?key={KEY}&page=2", f"/echo/b?{KEY}", f"/echo/c?x=1&key={KEY}&key=2"):
                async with client.get(gw.url + target) as response:
                    await response.read()
        assert await asyncio.to_thread(gw.stop) == 0
    lines = gw.stdout_lines
    assert len(lines) == 3, lines
    assert not any(KEY in line for line in lines + gw.stderr_lines), lines
    assert '"GET /echo/a?key=***&page=***" 200 ' in lines[0]
    assert '"GET /echo/b?***" 200 ' in lines[1]
    assert '"GET /echo/c?x=***&key=***&key=***" 400 ' in lines[2]  # key twice: refused, and still redacted


async def test_the_json_access_log_never_writes_query_values(upstream):
    with GatewayProcess(catch_all(upstream), args=("--access-log", "json")) as gw:
        async with aiohttp.ClientSession() as client, client.get(gw.url + f"/echo/a?key={KEY}") as response:
            await response.read()
        assert await asyncio.to_thread(gw.stop) == 0
    (record,) = [json.loads(line) for line in gw.stdout_lines]
    assert record["path"] == "/echo/a?key=***"


# Methods llhttp accepts beyond the known ones, which the metrics must count as OTHER.
ODD_METHODS = ("PROPFIND", "MKCOL", "PURGE", "SEARCH", "REPORT", "LOCK", "ACL")


async def test_no_client_chosen_value_becomes_a_metric_label(gw, client):
    """Methods, targets, Hosts, header names and values all differ per request (some are
    routed, some refused): /metrics names none of them, and counts every request."""
    tokens = []
    for i in range(120):
        token = f"tok{i}x{free_port()}"
        tokens.append(token)
        method = ((*ODD_METHODS, "GET", "POST"))[i % 9]
        host = (f"{token}.example", f"{token}:{i + 1}", "gw")[i % 3]
        path = (f"/{token}?key={token}", f"/echo/{token}/%zz", f"/echo/{token};p=1")[i % 3]
        request = (
            f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nX-{token}: {token}\r\nX-Request-ID: {token}\r\n"
            f"User-Agent: {token}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )
        await raw_exchange(gw.url, request.encode())
    text, samples = await scrape(client, gw.admin_url)
    assert not [token for token in tokens if token in text]
    seen: dict[str, set[str]] = {}
    for sample in samples:
        for name, label in sample.labels.items():
            seen.setdefault(name, set()).add(label)
    assert seen["route"] <= {"/", "unmatched"}
    assert seen["method"] <= {"GET", "POST", "OTHER"} and "OTHER" in seen["method"]
    requests = [s.value for s in samples if s.name == "gateway_requests_total"]
    assert sum(requests) == len(tokens)
