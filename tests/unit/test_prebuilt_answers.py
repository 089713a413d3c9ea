"""The gateway's own answers, built once and written per request with only their varying
fields (gateway.proxy.problem and the rejections of gateway.decision.plan), and the
other per-request parts made cheap: the Host memo (gateway.proxy.protocol) and request ids
cut from one draw of random bytes (gateway.proxy.access_log). Pure: no server runs."""

from __future__ import annotations

import json
import os
import re

from gateway.config.body_template import parse_body_template
from gateway.config.model import FailurePolicy, Limit, ResponseStyle
from gateway.config.units import Rate
from gateway.decision.plan import Rejection
from gateway.proxy import protocol
from gateway.proxy.access_log import IDS_PER_DRAW, request_id
from gateway.proxy.problem import Answer, Problem, problem_response
from gateway.proxy.protocol import HOST_MEMO_SIZE, routed_host


def _limit(**response: object) -> Limit:
    return Limit(
        name="per_key", rate=Rate(tokens=1, period_seconds=1, text="1/second"), burst=1, key=(),
        on_store_error=FailurePolicy.OPEN, response=ResponseStyle(**response),
    )


def test_a_problem_is_serialised_once_and_each_response_gets_its_own_headers():
    shed = Problem.of(503, "Service Unavailable", "Retry shortly.")
    first, second = shed.response({"Retry-After": "1"}), shed.response()
    assert isinstance(first, Answer) and first.status == 503 and first.body is shed.body
    assert list(first.headers.items()) == [
        ("Retry-After", "1"),
        ("Content-Type", "application/problem+json; charset=utf-8"),
        ("Content-Length", str(len(shed.body))),
    ]
    first.headers["X-Request-ID"] = "a"
    assert "X-Request-ID" not in second.headers and "X-Request-ID" not in shed.fixed
    assert json.loads(shed.body) == {"type": "about:blank", "title": "Service Unavailable", "status": 503, "detail": "Retry shortly."}


def test_problem_response_sets_the_type_and_length_after_the_fields_given():
    response = problem_response(504, b'{"a": 1}', headers={"RateLimit": "x"})
    assert list(response.headers.items()) == [
        ("RateLimit", "x"), ("Content-Type", "application/problem+json; charset=utf-8"), ("Content-Length", "8"),
    ]
    assert response.status == 504 and response.reason == "Gateway Timeout" and response.body == b'{"a": 1}'


def test_a_limits_rejection_is_its_problem_split_where_the_seconds_go():
    rejection = Rejection.of(_limit())
    body = b"7".join(rejection.chunks)
    assert rejection.status == 429 and rejection.content_type == "application/problem+json; charset=utf-8"
    assert json.loads(body)["detail"] == "Rate limit 'per_key' exceeded; retry in 7 s."
    assert json.loads(body)["violated-policies"] == ["per_key"]


def test_a_limits_own_body_keeps_its_status_and_content_type():
    rejection = Rejection.of(
        _limit(status=503, body=parse_body_template("{limit}: wait {retry_after}s, {retry_after}s"), content_type="text/plain")
    )
    assert rejection.status == 503 and rejection.content_type == "text/plain"
    assert b"12".join(rejection.chunks) == b"per_key: wait 12s, 12s"


def test_the_host_memo_answers_as_the_parse_does_and_stays_bounded():
    protocol._hosts.clear()
    for value, routed in [
        ("API.Example.com:8080", "api.example.com"), ("api.example.com.", "api.example.com"),
        ("[::1]:443", "[::1]"), ("evil.example/@x", None), ("", None), ("a b", None),
    ]:
        assert routed_host(value) == routed and routed_host(value) == routed  # parsed, then remembered
    for n in range(HOST_MEMO_SIZE + 10):
        assert routed_host(f"h{n}.example") == f"h{n}.example"
    assert len(protocol._hosts) <= HOST_MEMO_SIZE
    assert routed_host("x" * 300) == "x" * 300 and "x" * 300 not in protocol._hosts


def test_request_ids_are_128_random_bits_in_hex_each_once():
    ids = [request_id(None) for _ in range(3 * IDS_PER_DRAW)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    assert len(set(ids)) == len(ids)
    assert request_id("abc-123") == "abc-123" and request_id("bad id") != "bad id"


def test_a_forked_worker_draws_ids_of_its_own():
    request_id(None)  # the parent holds drawn ids not yet handed out
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        os.write(write, request_id(None).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    childs = os.read(read, 64).decode()
    os.close(read)
    assert childs != request_id(None)
