"""The access log as a user gets it from `gateway run --access-log`: one
line per request carrying the client address resolved through trusted proxies, the
route, the limit decision, the upstream status and latency and the request id; the
client identity only hashed; no query value in the path. And X-Request-ID: passed
to the upstream, generated when absent, and returned to the client.

The tests of what a line says share one gateway process per format and each reads the
lines of its own requests; those of a stalled stdout and of a stop start their own."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import re
import signal
import uuid

import aiohttp
import pytest

from gateway.proxy.access_log import FLUSH_SECONDS, QUEUE_LINES
from gateway.testing import running_gateway
from tests.processes import GatewayProcess, eventually, run_cli
from tests.raw_client import pipelined, raw_exchange
from tests.scrape import scrape, value

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


@pytest.fixture(scope="module")
def logged(module_upstream):
    """`logged(fmt)`: the module's gateway started with `--access-log fmt`, in front of the
    module's upstream, started at its first use and stopped (exit status 0) after the last.
    A test reads the lines of its own requests only (`own_lines`), so the tests share it
    in any order."""
    started: dict[str, GatewayProcess] = {}
    with contextlib.ExitStack() as stack:

        def gateway(fmt: str) -> GatewayProcess:
            if fmt not in started:
                started[fmt] = stack.enter_context(GatewayProcess(logged_yaml(module_upstream), args=("--access-log", fmt)))
            return started[fmt]

        yield gateway
        exits = {fmt: gw.stop() for fmt, gw in started.items()}
    assert exits == dict.fromkeys(started, 0)


async def own_lines(gw: GatewayProcess, since: int, expected: int) -> list[str]:
    """The lines written from line `since` on by a test's own requests: once `expected` are
    in, a marker request follows, and the lines before the marker's are the test's (with
    any line too many that its requests wrote)."""
    await eventually(lambda: len(gw.stdout_lines) >= since + expected, what=f"{expected} access log lines")
    marker = f"marker-{uuid.uuid4().hex}"
    assert (await send(gw, "/marker", **{"X-Request-ID": marker}))[0] == 200
    await eventually(lambda: any(marker in line for line in gw.stdout_lines[since:]), what="the marker's line")
    lines = gw.stdout_lines[since:]
    return lines[: next(i for i, line in enumerate(lines) if marker in line)]


async def send(gw: GatewayProcess, path: str, **headers: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as http, http.get(gw.url + path, headers=headers) as response:
        await response.read()
        return response.status, response.headers["X-Request-ID"]


async def run_logged(gw: GatewayProcess) -> tuple[list[str], list[tuple[int, str]]]:
    forwarded = {"X-Forwarded-For": "203.0.113.7"}
    since = len(gw.stdout_lines)
    answers = [
        await send(gw, "/keyed/a", **forwarded, **{"X-API-Key": API_KEY}),
        await send(gw, "/keyed/b", **forwarded, **{"X-API-Key": API_KEY}),
        await send(gw, f"/query/c?api_key={QUERY_KEY}&page=2"),
        await send(gw, "/status/503", **{"X-Request-ID": "client-chosen-42"}),
    ]
    lines = await own_lines(gw, since, len(answers))
    async with aiohttp.ClientSession() as http:
        assert value((await scrape(http, gw.admin_url))[1], "gateway_access_log_dropped_total") == 0
    return lines, answers


def assert_no_secret_in(lines: list[str]) -> None:
    for line in lines:
        assert API_KEY not in line and QUERY_KEY not in line, line


async def test_json_access_log_carries_client_route_decision_upstream_and_request_id(logged):
    gw = logged("json")
    lines, answers = await run_logged(gw)
    assert [status for status, _ in answers] == [200, 429, 200, 503]
    records = [json.loads(line) for line in lines]
    assert len(records) == 4, lines
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


async def test_text_access_log_carries_the_same_on_one_line_each(logged):
    gw = logged("text")
    lines, answers = await run_logged(gw)
    assert len(lines) == 4, lines
    first, second, query, plain = lines
    assert '"GET /keyed/a" 200 ' in first
    assert f"client=203.0.113.7 request_id={answers[0][1]} " in first
    assert 'route="/keyed" decision=allow limits=per_key:allow:' in first
    assert "upstream_status=200 upstream_ms=" in first
    assert 'decision=deny limits=per_key:deny:' in second and "upstream_status=- upstream_ms=-" in second
    assert '"GET /query/c?api_key=***&page=***" 200 ' in query
    assert 'request_id=client-chosen-42 route="/" decision=- limits=- upstream_status=503 ' in plain
    assert_no_secret_in(gw.stdout_lines + gw.stderr_lines)


async def test_duration_is_timed_finer_than_the_event_loop_clock(logged):
    """uvloop's loop.time(), which aiohttp times requests with, moves in whole milliseconds
    and only once per loop iteration: a fast answer was logged as 0.0 ms, and shorter than
    its own upstream exchange."""
    gw = logged("json")
    since = len(gw.stdout_lines)
    async with aiohttp.ClientSession() as http:
        for path in ["/plain"] * 10 + ["/slow?seconds=0.02"] * 3:
            async with http.get(gw.url + path) as response:
                await response.read()
    records = [json.loads(line) for line in await own_lines(gw, since, 13)]
    assert len(records) == 13
    assert all(r["duration_ms"] > 0 for r in records), [r["duration_ms"] for r in records]
    assert any(r["duration_ms"] != int(r["duration_ms"]) for r in records), [r["duration_ms"] for r in records]
    for r in records:
        assert r["duration_ms"] >= r["upstream_ms"], r  # the whole request outlasts its upstream part
    assert all(r["duration_ms"] >= 20 for r in records[10:])


async def test_a_websocket_handshake_logs_and_times_the_upstream_answer(logged):
    """The upstream's answer to a handshake (101, or the status it refused with) is its
    upstream_status, as an HTTP response's is, and is timed in gateway_upstream_latency_seconds."""
    gw = logged("json")
    since = len(gw.stdout_lines)
    async with aiohttp.ClientSession() as http:
        before = value((await scrape(http, gw.admin_url))[1], "gateway_upstream_latency_seconds_count", route="/")
        async with http.ws_connect(gw.url + "/ws") as ws:
            await ws.send_str("hi")
            assert (await ws.receive()).data == "echo:hi"
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await http.ws_connect(gw.url + "/status/403")
        assert refused.value.status == 502
        samples = (await scrape(http, gw.admin_url))[1]
    lines = await own_lines(gw, since, 2)  # its marker's exchange is timed too, after the scrape
    accepted, turned_away = (json.loads(line) for line in lines)
    assert (accepted["status"], accepted["upstream_status"]) == (101, 101)
    assert (turned_away["status"], turned_away["upstream_status"]) == (502, 403)
    assert accepted["upstream_ms"] > 0 and turned_away["upstream_ms"] > 0
    assert value(samples, "gateway_upstream_latency_seconds_count", route="/") - before == 2


@pytest.mark.parametrize("fmt", ["json", "text"])
async def test_the_credentials_of_an_absolute_form_target_are_not_logged(logged, fmt):
    """`GET http://user:password@host/path` is routed by its path; the user information,
    a credential like a query's API key, is written as `***`."""
    request = b"GET http://ops:hunter2-pw@gw.test/echo?q=1 HTTP/1.1\r\nHost: gw.test\r\nConnection: close\r\n\r\n"
    gw = logged(fmt)
    since = len(gw.stdout_lines)
    assert (await raw_exchange(gw.url, request))[0] == 200
    (line,) = await own_lines(gw, since, 1)
    assert "hunter2" not in line and "ops" not in line, line
    assert "GET http://***@gw.test/echo?q=***" in (f"GET {json.loads(line)['path']}" if fmt == "json" else line)


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


async def test_the_config_file_can_turn_the_access_log_on(upstream):
    """`access_log: json` in the YAML does what `--access-log json` does; the flag, when given, wins."""
    async with aiohttp.ClientSession() as http:
        for setting, args, expect_json in (("json", (), True), ("json", ("--access-log", "text"), False)):
            with GatewayProcess(f"access_log: {setting}\n" + logged_yaml(upstream), args=args) as gw:
                async with http.get(gw.url + "/plain") as response:
                    assert response.status == 200
                assert await asyncio.to_thread(gw.stop) == 0
            (line,) = gw.stdout_lines
            assert line.startswith("{") is expect_json, line
        with GatewayProcess("access_log: off\n" + logged_yaml(upstream)) as gw:
            async with http.get(gw.url + "/plain") as response:
                assert response.status == 200
            assert await asyncio.to_thread(gw.stop) == 0
        assert gw.stdout_lines == []


def test_an_unknown_access_log_format_is_a_one_line_error(tmp_path):
    config = tmp_path / "gateway.yaml"
    config.write_text("access_log: xml\n" + logged_yaml("http://127.0.0.1:9"))
    result = run_cli("check", "-c", str(config))
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0 and "access_log: expected off, text or json, got 'xml'" in result.stderr


# Values a client controls that reach a line: a User-Agent that forges the fields after it,
# a quote and a backslash in the target (refused, and still logged), and bytes that are
# line breaks or terminal escapes to some reader (ESC, U+2028, U+0085, invalid UTF-8).
FORGED = b'x" 200 0 0.1ms "y" client=6.6.6.6 request_id=forged route="/" decision=allow'
HOSTILE_REQUESTS = (
    (b"GET /echo", FORGED),
    (b'GET /echo/a"b\\c', b"curl"),
    (b"GET /echo/%0d%0a%1b[31m?q=%0d%0a", b"\\\" \xe2\x80\xa8 \xc2\x85 \xff\xfe \xc3\xa9"),
)
TEXT_LINE = re.compile(
    r'\S+ 127\.0\.0\.1 "(GET [^"]*)" (\d{3}) \d+ [\d.]+ms "([^"]*)" client=127\.0\.0\.1 request_id=[0-9a-f]{32} '
    r'route=(?:-|"/") decision=- limits=- upstream_status=(?:-|200) upstream_ms=\S+ upstream_target=-'
)


def unescaped(text: str) -> bytes:
    return re.sub(rb"\\x([0-9A-F]{2})", lambda m: bytes([int(m.group(1), 16)]), text.encode("ascii"))


@pytest.mark.parametrize("fmt", ["text", "json"])
async def test_hostile_request_targets_and_user_agents_stay_one_unforgeable_line_each(logged, fmt):
    gw = logged(fmt)
    since = len(gw.stdout_lines)
    statuses = []
    for line, agent in HOSTILE_REQUESTS:
        request = line + b" HTTP/1.1\r\nHost: gw\r\nUser-Agent: " + agent + b"\r\nConnection: close\r\n\r\n"
        statuses.append((await raw_exchange(gw.url, request))[0])
    assert statuses == [200, 400, 400]
    lines = "".join(await own_lines(gw, since, len(HOSTILE_REQUESTS))).splitlines()  # splits at U+2028 and U+0085 too
    assert len(lines) == len(HOSTILE_REQUESTS), lines
    for line, (sent_line, agent) in zip(lines, HOSTILE_REQUESTS):
        if fmt == "json":
            record = json.loads(line)
            assert (record["client"], record["route"] is None) == ("127.0.0.1", sent_line != b"GET /echo")
            logged_line, logged_agent = f"{record['method']} {record['path']}", record["user_agent"]
        else:
            match = TEXT_LINE.fullmatch(line)
            assert match is not None, line
            logged_line, logged_agent = match.group(1), match.group(3)
            logged_line, logged_agent = unescaped(logged_line).decode(), unescaped(logged_agent).decode("utf-8", "surrogateescape")
        assert logged_line == sent_line.decode().partition("?")[0] + ("?q=***" if b"?" in sent_line else "")
        if fmt == "json":
            agent = agent.replace(b"\xff\xfe", b"\\xFF\\xFE")  # undecodable bytes as the text line writes them
        assert logged_agent == agent.decode("utf-8", "surrogateescape")


def strictly_json(line: str) -> dict:
    """`line` parsed as a strict reader parses it: UTF-8, and no lone surrogate in any string."""
    line.encode("utf-8", "strict")
    record = json.loads(line)
    strings = [v for v in record.values() if isinstance(v, str)]
    assert not any("\ud800" <= char <= "\udfff" for text in strings for char in text), record
    json.dumps(record, ensure_ascii=False).encode("utf-8", "strict")
    return record


async def test_undecodable_bytes_in_a_json_line_are_escaped_as_in_a_text_line(logged):
    agent = b"probe/1 \xff \xc0\xaf ok \xc3\xa9"  # \xff and \xc0\xaf are not UTF-8; \xc3\xa9 is
    request = b"GET /echo/x HTTP/1.1\r\nHost: gw\r\nUser-Agent: " + agent + b"\r\nConnection: close\r\n\r\n"
    lines = {}
    for fmt in ("json", "text"):
        gw = logged(fmt)
        since = len(gw.stdout_lines)
        assert (await raw_exchange(gw.url, request))[0] == 200
        (lines[fmt],) = await own_lines(gw, since, 1)
    record = strictly_json(lines["json"])
    assert record["user_agent"] == "probe/1 \\xFF \\xC0\\xAF ok é"
    match = TEXT_LINE.fullmatch(lines["text"].rstrip("\n"))
    assert match is not None, lines["text"]
    assert match.group(3) == "probe/1 \\xFF \\xC0\\xAF ok \\xC3\\xA9"  # the same escape; the text line escapes é too


# The gateway answers /nowhere itself (404), so requests come quickly and need no upstream.
STALL_YAML = """
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
shutdown_grace: 1s
routes:
  - match: {path: /proxied}
    upstream: http://127.0.0.1:9
"""
SENDERS = 8
# A pipe holds 64 KiB, about 160 of these lines: 2,000 leave most of them queued.
QUEUED = 2_000
# Requests a sender pipelines on one connection: fewer than keepalive_requests (1,000).
PIPELINED = 500
CLOSE = "Connection: close\r\n"


async def send_numbered(gw: GatewayProcess, count: int) -> None:
    """`count` requests from SENDERS clients at once, each numbering its own in X-Request-ID
    (`s3-41`) and pipelining them, PIPELINED to a connection; each must be answered, with no
    wait for the next answer longer than the raw client's timeout."""

    async def sender(k: int) -> None:
        numbers = range(count // SENDERS)
        for first in range(0, len(numbers), PIPELINED):
            batch = numbers[first : first + PIPELINED]
            requests = [
                f"GET /nowhere HTTP/1.1\r\nHost: gw\r\nX-Request-ID: s{k}-{i}\r\n{CLOSE if i == batch[-1] else ''}\r\n".encode()
                for i in batch
            ]
            assert await pipelined(gw.url, requests) == [404] * len(batch)

    await asyncio.gather(*(sender(k) for k in range(SENDERS)))


def numbers_by_sender(lines: list[str]) -> dict[str, list[int]]:
    """Each sender's request numbers, in the order of the lines; every line must be whole JSON."""
    numbers = collections.defaultdict(list)
    for line in lines:
        sender, _, number = json.loads(line)["request_id"].partition("-")
        numbers[sender].append(int(number))
    return numbers


async def test_a_stalled_stdout_costs_access_lines_never_requests():
    """Nothing reads stdout: requests are answered all the same, /metrics too, and each line
    that found the queue full is counted dropped. Read at last, the kept lines come out whole."""
    sent = 2 * QUEUE_LINES
    with GatewayProcess(STALL_YAML, args=("--access-log", "json"), read_stdout=False) as gw:
        await send_numbered(gw, sent)
        async with aiohttp.ClientSession() as http:

            async def dropped() -> float:
                return value((await scrape(http, gw.admin_url))[1], "gateway_access_log_dropped_total")

            assert await dropped() > 0
            gw.read_stdout()

            async def every_line_accounted() -> bool:
                return len(gw.stdout_lines) + await dropped() == sent

            await eventually(every_line_accounted, what="each request's line written or counted dropped")
            dropped_count = await dropped()
        assert await asyncio.to_thread(gw.stop) == 0
    assert len(gw.stdout_lines) + dropped_count == sent  # and nothing more came at the stop
    assert len(gw.stdout_lines) >= QUEUE_LINES
    # Lines are dropped only while the queue is full, and it never drains while stdout is
    # not read: each sender's kept lines are its first requests, in order.
    numbers = numbers_by_sender(gw.stdout_lines)
    assert all(kept == list(range(len(kept))) for kept in numbers.values()), numbers
    assert "Traceback" not in "".join(gw.stderr_lines)


async def test_the_lines_queued_at_a_stop_are_written_before_the_exit():
    with GatewayProcess(STALL_YAML, args=("--access-log", "json"), read_stdout=False) as gw:
        await send_numbered(gw, QUEUED)
        gw.signal(signal.SIGTERM)
        await eventually(lambda: any("access log lines still queued" in line for line in gw.stderr_lines), what="the final write")
        gw.read_stdout()  # the consumer comes back as the gateway writes its last lines
        assert await asyncio.to_thread(gw.wait) == 0
    numbers = numbers_by_sender(gw.stdout_lines)
    assert numbers == {f"s{k}": list(range(QUEUED // SENDERS)) for k in range(SENDERS)}


async def test_a_stop_exits_within_the_grace_when_stdout_is_blocked():
    """shutdown_grace is 1s; the queued lines get FLUSH_SECONDS more, then are given up."""
    with GatewayProcess(STALL_YAML, args=("--access-log", "json"), read_stdout=False) as gw:
        await send_numbered(gw, QUEUED)
        gw.signal(signal.SIGTERM)
        assert await asyncio.to_thread(gw.wait, 1 + FLUSH_SECONDS + 3) == 0
