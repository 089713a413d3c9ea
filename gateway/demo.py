"""`gateway demo`: a tiny upstream API and the gateway in front of it, in one process,
so a newcomer sees 200s turn into 429s without any other server.

The demo upstream also speaks OpenAI's chat completions schema (POST /v1/chat/completions),
in JSON and as server-sent events, so that a token budget (a limit whose cost comes from
the response's `usage`) can be tried without an LLM. Its token counts are deterministic,
so the docs' transcripts are reproducible: the prompt's tokens are the words (runs of
non-space) of every message's text, and the answer is the last message's words echoed
round and round, `max_tokens` (or `max_completion_tokens`) words long, 16 without either.

Trust: none is needed; it is a demo. A body it cannot read gets a 400 in OpenAI's error
shape, never a traceback, and its size is capped by aiohttp's default (1 MiB, else 413).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.config.model import GatewayConfig
from gateway.config.units import Address, parse_address
from gateway.server import StartupError, bound_address, os_reason, run_event_loop, serve

# What the demo model writes when the request names no max_tokens: short enough to read.
DEFAULT_COMPLETION_TOKENS = 16
# A bound on the words of one answer (OpenAI's models stop near this too), so that a
# request cannot make the demo write without end.
MAX_COMPLETION_TOKENS = 100_000


def demo_upstream() -> web.Application:
    async def hello(request: web.Request) -> web.Response:
        return web.json_response({"hello": "world", "path": request.path})

    async def report(request: web.Request) -> web.Response:
        return web.json_response({"report": "queued", "bytes": len(await request.read())}, status=202)

    ids = itertools.count(1)  # chatcmpl-demo1, chatcmpl-demo2, ...

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        return await _chat_completions(request, f"chatcmpl-demo{next(ids)}")

    app = web.Application()
    app.router.add_post("/api/reports", report)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_route("*", "/{tail:.*}", hello)
    return app


class BadChatRequest(ValueError):
    """A chat request the demo cannot answer: its message, and the member at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


async def _chat_completions(request: web.Request, completion_id: str) -> web.StreamResponse:
    try:
        body = json.loads(await request.read())
    except (ValueError, RecursionError):
        return _error(BadChatRequest("the body is not JSON"))
    try:
        chat = Chat.parse(body)
    except BadChatRequest as exc:
        return _error(exc)
    head = {"id": completion_id, "created": int(time.time()), "model": chat.model}
    if not chat.stream:
        return web.json_response(chat.completion(head))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    for chunk in chat.chunks(head):
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _error(exc: BadChatRequest) -> web.Response:
    error = {"message": str(exc), "type": "invalid_request_error", "param": exc.param, "code": None}
    return web.json_response({"error": error}, status=400)


@dataclass(frozen=True)
class Chat:
    """One chat request, read: the model's name, the prompt's length in words, the words
    the answer echoes, its length (cut: by max_tokens), and how to send it."""

    model: str
    prompt_tokens: int
    echo: tuple[str, ...]
    completion_tokens: int
    cut: bool
    stream: bool
    include_usage: bool

    @classmethod
    def parse(cls, body: Any) -> Chat:
        if not isinstance(body, dict):
            raise BadChatRequest("the body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise BadChatRequest("model: expected the model's name, a string", "model")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadChatRequest("messages: expected a non-empty array of messages", "messages")
        texts = [_text(message, f"messages[{i}]") for i, message in enumerate(messages)]
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if limit is not None and (type(limit) is not int or not 1 <= limit <= MAX_COMPLETION_TOKENS):
            raise BadChatRequest(f"max_tokens: expected a whole number from 1 to {MAX_COMPLETION_TOKENS}", "max_tokens")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadChatRequest("stream: expected true or false", "stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
            raise BadChatRequest("stream_options: expected an object such as {\"include_usage\": true}", "stream_options")
        return cls(
            model=model,
            prompt_tokens=sum(len(text.split()) for text in texts),
            echo=tuple(texts[-1].split()) or ("demo",),
            completion_tokens=DEFAULT_COMPLETION_TOKENS if limit is None else limit,
            cut=limit is not None,
            stream=stream,
            include_usage=options.get("include_usage", False),
        )

    @property
    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    @property
    def finish_reason(self) -> str:
        return "length" if self.cut else "stop"

    def words(self) -> Iterator[str]:
        """The answer, a word at a time: the last message's words, round and round."""
        return itertools.islice(itertools.cycle(self.echo), self.completion_tokens)

    def completion(self, head: dict[str, Any]) -> dict[str, Any]:
        message = {"role": "assistant", "content": " ".join(self.words())}
        return {
            "id": head["id"], "object": "chat.completion", "created": head["created"], "model": self.model,
            "choices": [{"index": 0, "message": message, "finish_reason": self.finish_reason}],
            "usage": self.usage,
        }

    def chunks(self, head: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The stream's chunks, as OpenAI sends them: the role first, a word each, the finish
        reason with an empty delta; then, with stream_options.include_usage, a last chunk
        with no choices and the usage (every chunk before it has `"usage": null`)."""
        base = {"id": head["id"], "object": "chat.completion.chunk", "created": head["created"], "model": self.model}
        if self.include_usage:
            base["usage"] = None

        def chunk(delta: dict[str, str], finish_reason: str | None = None) -> dict[str, Any]:
            return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}

        yield chunk({"role": "assistant", "content": ""})
        for i, word in enumerate(self.words()):
            yield chunk({"content": word if i == 0 else " " + word})
        yield chunk({}, self.finish_reason)
        if self.include_usage:
            yield {**base, "choices": [], "usage": self.usage}


def _text(message: Any, where: str) -> str:
    """A message's text: its content as a string, or its text parts joined by spaces."""
    if not isinstance(message, dict):
        raise BadChatRequest(f"{where}: expected an object with a role and a content", "messages")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        texts = [part.get("text") for part in content if part.get("type") == "text"]
        if all(isinstance(text, str) for text in texts):
            return " ".join(texts)  # type: ignore[arg-type]
    raise BadChatRequest(f"{where}.content: expected a string or an array of text parts", "messages")


async def _demo(config: GatewayConfig, address: Address) -> None:
    runner = web.AppRunner(demo_upstream(), access_log=None)
    await runner.setup()
    try:
        try:
            await web.TCPSite(runner, address.host, address.port).start()
        except OSError as exc:
            raise StartupError(f"cannot start the demo upstream on {address}: {os_reason(exc)}") from None
        await serve(config, demo_upstream=bound_address(runner))
    finally:
        await runner.cleanup()


def run_demo(config: GatewayConfig, upstream_address: str) -> int:
    try:
        address = parse_address(upstream_address)
    except ValueError as exc:
        raise StartupError(f"--upstream: {exc}") from None
    with contextlib.suppress(KeyboardInterrupt):  # SIGINT while starting, before serve() handles it
        run_event_loop(_demo(config, address))
    return 0
