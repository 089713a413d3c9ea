"""The demo upstream's OpenAI chat completions (POST /v1/chat/completions), as an LLM API's
token budget sees them: the JSON answer's usage adds up, the server-sent stream's events
parse as OpenAI's do and the last before [DONE] carries the usage when
stream_options.include_usage asks for it (and no chunk has one when it does not), and the
usage reader (gateway/config/usage.py) run over the bytes really sent finds the usage's
total_tokens. The demo app runs on a port of its own; the last test goes through
`gateway demo` as users start it, on the config shipped in the package."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDictProxy

from gateway.config.usage import parse_usage_source
from gateway.demo import DEFAULT_COMPLETION_TOKENS, demo_upstream
from tests.processes import GatewayProcess, free_port

JSON_USAGE = parse_usage_source("json:usage.total_tokens")
SSE_USAGE = parse_usage_source("sse-json:usage.total_tokens")

# 3 words of system prompt and 5 of the user's: 8 prompt tokens.
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": [{"type": "text", "text": "Say hello to"}, {"type": "text", "text": "the gateway"}]},
]


@contextlib.asynccontextmanager
async def demo_app() -> AsyncIterator[str]:
    """The demo upstream in this event loop, on a free port; yields its URL."""
    runner = web.AppRunner(demo_upstream(), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@dataclass
class Answer:
    status: int
    headers: CIMultiDictProxy[str]
    chunks: list[bytes]  # the body, each piece as it arrived

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)


async def chat(client: aiohttp.ClientSession, url: str, body: Any) -> Answer:
    """POST `body` (JSON, unless bytes) to the chat completions path."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with client.post(url + "/v1/chat/completions", data=data, headers={"X-API-Key": "demo"}) as response:
        return Answer(response.status, response.headers, [piece async for piece in response.content.iter_any()])


def read_usage(source: Any, chunks: list[bytes], headers: Any) -> int | None:
    reader = source.reader(headers)
    for chunk in chunks:
        reader.feed(chunk)
    return reader.result()


def events(body: bytes) -> list[str]:
    """The data of each event of a stream the demo sent: `data: ...` ended by a blank line."""
    assert body.endswith(b"\n\n")
    found = []
    for event in body.decode().split("\n\n")[:-1]:
        assert event.startswith("data: ") and "\n" not in event, event
        found.append(event.removeprefix("data: "))
    return found


async def test_a_json_answer_has_usage_that_adds_up_and_the_reader_finds_its_total():
    async with demo_app() as url, aiohttp.ClientSession() as client:
        response = await chat(client, url, {"model": "demo-1", "messages": MESSAGES, "max_tokens": 50})
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("application/json")
        answer = json.loads(response.body)
        assert answer["object"] == "chat.completion" and answer["model"] == "demo-1"
        assert answer["id"].startswith("chatcmpl-") and isinstance(answer["created"], int)
        (choice,) = answer["choices"]
        assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
        assert choice["finish_reason"] == "length"  # cut at max_tokens
        assert answer["usage"] == {"prompt_tokens": 8, "completion_tokens": 50, "total_tokens": 58}
        words = choice["message"]["content"].split()
        assert len(words) == 50 and words[:6] == ["Say", "hello", "to", "the", "gateway", "Say"]
        assert read_usage(JSON_USAGE, response.chunks, response.headers) == 58

        # Without max_tokens, a short answer that ends of itself; the same request, the same counts.
        for _ in range(2):
            response = await chat(client, url, {"model": "demo-1", "messages": MESSAGES})
            answer = json.loads(response.body)
            assert answer["choices"][0]["finish_reason"] == "stop"
            assert answer["usage"] == {"prompt_tokens": 8, "completion_tokens": DEFAULT_COMPLETION_TOKENS,
                                       "total_tokens": 8 + DEFAULT_COMPLETION_TOKENS}
        # max_completion_tokens, OpenAI's newer name, counts as max_tokens does.
        response = await chat(client, url, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3})
        assert json.loads(response.body)["usage"] == {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}


async def test_a_stream_with_include_usage_ends_with_the_usage_before_done_and_the_reader_finds_it():
    body = {"model": "demo-1", "messages": MESSAGES, "max_tokens": 300, "stream": True, "stream_options": {"include_usage": True}}
    async with demo_app() as url, aiohttp.ClientSession() as client:
        plain = json.loads((await chat(client, url, {**body, "stream": False})).body)
        response = await chat(client, url, body)
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        data = events(response.body)
        assert data[-1] == "[DONE]"
        parsed = [json.loads(text) for text in data[:-1]]
        assert {p["object"] for p in parsed} == {"chat.completion.chunk"}
        assert len({p["id"] for p in parsed}) == 1 and parsed[0]["model"] == "demo-1"
        *answer, last = parsed
        # The last data before [DONE]: no choices, the usage; every chunk before it says "usage": null.
        assert last["choices"] == [] and last["usage"] == {"prompt_tokens": 8, "completion_tokens": 300, "total_tokens": 308}
        assert all("usage" in p and p["usage"] is None for p in answer)
        assert answer[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert answer[-1]["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "length"}
        text = "".join(p["choices"][0]["delta"].get("content", "") for p in answer)
        assert text == plain["choices"][0]["message"]["content"]  # the stream says what the JSON says
        assert last["usage"] == plain["usage"]
        assert read_usage(SSE_USAGE, response.chunks, response.headers) == 308
        # Fed a byte at a time, the reader finds the same.
        assert read_usage(SSE_USAGE, [response.body[i : i + 1] for i in range(len(response.body))], response.headers) == 308


async def test_a_stream_without_include_usage_carries_no_usage_and_the_reader_says_nothing():
    async with demo_app() as url, aiohttp.ClientSession() as client:
        for options in ({}, {"stream_options": {"include_usage": False}}):
            response = await chat(client, url, {"model": "m", "messages": MESSAGES, "stream": True, **options})
            data = events(response.body)
            assert data[-1] == "[DONE]"
            parsed = [json.loads(text) for text in data[:-1]]
            assert len(parsed) == DEFAULT_COMPLETION_TOKENS + 2  # the role, a word each, the finish
            assert all("usage" not in p and len(p["choices"]) == 1 for p in parsed)
            assert parsed[-1]["choices"][0]["finish_reason"] == "stop"
            assert read_usage(SSE_USAGE, response.chunks, response.headers) is None


async def test_a_request_the_demo_cannot_read_gets_400_in_openais_error_shape():
    ok: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    cases: list[tuple[Any, str | None]] = [
        (b"{not json", None),
        ([1, 2], None),
        ({"messages": ok["messages"]}, "model"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": ["hi"]}, "messages"),
        ({"model": "m", "messages": [{"role": "user", "content": 7}]}, "messages"),
        ({**ok, "max_tokens": 0}, "max_tokens"),
        ({**ok, "max_tokens": True}, "max_tokens"),
        ({**ok, "max_tokens": 10**9}, "max_tokens"),
        ({**ok, "stream": "yes"}, "stream"),
        ({**ok, "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options"),
    ]
    async with demo_app() as url, aiohttp.ClientSession() as client:
        for body, param in cases:
            response = await chat(client, url, body)
            assert response.status == 400, body
            error = json.loads(response.body)["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == param, (body, error)
            assert error["message"] and "\n" not in error["message"]
        # The demo's other routes answer as before.
        async with client.get(url + "/v1/chat/completions") as response:
            assert await response.json() == {"hello": "world", "path": "/v1/chat/completions"}
        async with client.post(url + "/api/reports", data=b"abcd") as response:
            assert response.status == 202 and await response.json() == {"report": "queued", "bytes": 4}


async def test_gateway_demo_relays_both_answers_and_the_reader_finds_the_total_in_what_it_relayed():
    ports = {"GATEWAY_LISTEN": "127.0.0.1:0", "GATEWAY_ADMIN_LISTEN": "127.0.0.1:0"}
    upstream = f"127.0.0.1:{free_port()}"
    body = {"model": "demo-1", "messages": MESSAGES, "max_tokens": 40}
    with GatewayProcess(None, command="demo", args=("--upstream", upstream), env=ports) as gw:
        async with aiohttp.ClientSession() as client:
            response = await chat(client, gw.url, body)
            assert response.status == 200, response.body
            assert response.headers["RateLimit-Policy"] == '"per_client";q=5;w=30'
            assert read_usage(JSON_USAGE, response.chunks, response.headers) == 48
            response = await chat(client, gw.url, {**body, "stream": True, "stream_options": {"include_usage": True}})
            assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
            assert events(response.body)[-1] == "[DONE]"
            assert read_usage(SSE_USAGE, response.chunks, response.headers) == 48
        assert await asyncio.to_thread(gw.stop) == 0
