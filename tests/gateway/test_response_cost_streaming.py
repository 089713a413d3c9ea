"""Costs the response says, read from huge bodies as they stream through a gateway process:
the reader holds a bounded amount whatever the body, and the relay changes no byte.

- A 5 GiB server-sent stream of OpenAI-style chunk events (each `"usage": null`, as with
  `stream_options.include_usage`), its last event carrying the usage, and a 1 GiB JSON
  completion (one long content string, `usage` after it): the client receives every byte
  as sent (compared byte for byte with the pieces the upstream wrote, which it keeps by
  reference to its one block; neither side holds the body), the
  gateway's RSS grows by at most 64 MB, and Redis is charged exactly the usage said.
- A malformed usage (`"total_tokens": "abc"`) at the end of a long stream or body, and a
  stream the upstream cuts in its last event (the event is never ended by a blank line):
  each charged `missing`, as docs/limit-policies.md ("Costs the response says") says of a
  response that does not say.

The upstream builds one 64 KiB block and writes it again and again, so it holds no more
than the gateway may. The limit refills one unit a year, so what the admin API shows
missing from the bucket is what was charged.

Sizes: 5 GiB for the stream; for the JSON body, the 1 GiB every response streams within
today (tests/gateway/test_proxy_streaming.py). What limits the relay is CPU on both cores:
for the stream the gateway spent about 9 s (half of it in the usage reader, which spares
json every chunk without the usage's key) and this test's process about 12 s, 7 of them
in the running SHA-1s of both sides it took before it compared bytes instead; for the
body, 1 s and 2.5 s (the reader finds the end of the long string with memchr). On the 2-core VM, shared with other work, that was 180 to 330 MB/s
for the stream (16 to 30 s) and 190 to 520 MB/s for the body (2 to 6 s). A 5 GiB body
would run the same code (the scan of a long string) for about 12 s more of CPU, so the
suite's time is kept for the rest.

Not in the serial `timing` group: nothing here is timed, and what is measured, one gateway
process's own RSS, no other test moves."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from tests.processes import GatewayProcess, PeakRss, RedisServer, eventually
from tests.upstream import serving

GIB = 1 << 30
RSS_GROWTH_LIMIT = 64 * 1000 * 1000
SAMPLE_INTERVAL = 0.02
BURST = 1 << 40  # no reservation or usage here comes near it
RESERVE = 1000
MISSING = 4000
USAGE = {"prompt_tokens": 1234, "completion_tokens": 987654, "total_tokens": 988888}
# Past the reader's HELD_TEXT (16 KiB), so the malformed and cut cases read through the scan.
SMALL = 64 << 20
# How long the upstream waits for the client to read all but the cut event.
CATCH_UP = 30.0

CONFIG = """
store: {{url: "{url}"}}
limits:
  tokens:
    rate: 1/year
    burst: {burst}
    key: header:X-API-Key
    cost: {{from: "json:usage.total_tokens", reserve: {reserve}, missing: {missing}}}
routes:
  - match: {{path: /}}
    upstream: {upstream}
    limits: [tokens]
"""


def _chunk_event(content: str) -> bytes:
    chunk = {
        "id": "chatcmpl-huge",
        "object": "chat.completion.chunk",
        "created": 1796458849,
        "model": "demo",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}],
        "usage": None,
    }
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


# Four chunk events of about 16 KiB each (each held whole, as a chunk is, and left unparsed:
# no key in it is total_tokens); the content has quotes, escapes and a `"usage"` of its own,
# which is text and not the member.
_CONTENT = 'say "usage": {"total_tokens": 1}\n' + "lorem ipsum dolor sit amet " * 580
SSE_BLOCK = _chunk_event(_CONTENT) * 4
# A 64 KiB piece of one JSON string: escapes are whole within it, so repeats stay a string.
_PIECE = json.dumps(_CONTENT)[1:-1].encode()
JSON_BLOCK = (_PIECE * (65536 // len(_PIECE) + 1))[:65536]
while JSON_BLOCK.endswith(b"\\") and not JSON_BLOCK.endswith(b"\\\\"):
    JSON_BLOCK = JSON_BLOCK[:-1]
JSON_HEAD = b'{"id": "chatcmpl-huge", "object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": "'


def _json_tail(usage: object) -> bytes:
    return b'"}, "finish_reason": "length"}], "usage": ' + json.dumps(usage).encode() + b"}"


def _usage_event(usage: object) -> bytes:
    return b"data: " + json.dumps({"id": "chatcmpl-huge", "object": "chat.completion.chunk", "choices": [], "usage": usage}).encode() + b"\n\n"


class Upstream:
    """GET /sse?size=N&usage=...&cut=1 and GET /json?size=N&usage=...: at least N bytes of
    repeated blocks, then the usage (`usage` is the JSON of the usage object, default USAGE).
    `cut=1`: the usage event goes without its blank line and the connection is dropped, once
    the client has read all the rest (`client_read`): aiohttp's client drops what it holds
    unread when the connection breaks, so a cut while it lags would lose bytes the gateway
    relayed. Keeps the pieces it wrote, by reference (`written`), and their length (`sent`)."""

    def __init__(self) -> None:
        self.sent = 0
        self.written: list[bytes] = []
        self._read = 0
        self._caught_up = asyncio.Event()

    def client_read(self, count: int) -> None:
        """The test's client has read `count` bytes of the body."""
        self._read = count
        if self.sent and count >= self.sent:
            self._caught_up.set()

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        size = int(request.query["size"])
        usage = json.loads(request.query.get("usage", json.dumps(USAGE)))
        sse = request.path == "/sse"
        block = SSE_BLOCK if sse else JSON_BLOCK
        response = web.StreamResponse()
        response.content_type = "text/event-stream" if sse else "application/json"
        await response.prepare(request)
        self.written = []
        sent = 0

        async def write(data: bytes) -> None:
            nonlocal sent
            self.written.append(data)
            sent += len(data)
            await response.write(data)

        if not sse:
            await write(JSON_HEAD)
        for _ in range(-(-size // len(block))):  # at least size bytes
            await write(block)
        if sse and request.query.get("cut") == "1":
            await write(_usage_event(usage)[:-1])  # the event's data line, not the blank line ending it
            self.sent = sent
            self.client_read(self._read)
            # Bounded, so that bytes lost on the way fail the test's check rather than hang it.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._caught_up.wait(), CATCH_UP)
            request.transport.abort()  # type: ignore[union-attr]
            return response
        await write(_usage_event(usage) + b"data: [DONE]\n\n" if sse else _json_tail(usage))
        self.sent = sent
        await response.write_eof()
        return response


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[Upstream, str]]:
    answering = Upstream()
    async with serving(answering.handle) as url:
        yield answering, url


@pytest.fixture
def gateway(upstream):
    _, url = upstream
    with RedisServer() as redis_server:
        config = CONFIG.format(url=redis_server.url, burst=BURST, reserve=RESERVE, missing=MISSING, upstream=url)
        with GatewayProcess(config) as process:
            yield process


async def charged(http: aiohttp.ClientSession, gateway: GatewayProcess, key: str) -> float:
    async with http.get(f"{gateway.admin_url}/buckets/tokens?source=header:X-API-Key&value={key}") as response:
        assert response.status == 200
        return BURST - (await response.json())["tokens"]


class Received:
    """What the client received, compared as it arrives with the pieces the upstream wrote:
    `received` counts it, `differs` is where it first differed (None while it is the same)."""

    def __init__(self, answering: Upstream) -> None:
        self._answering = answering
        self._piece = self._at = 0  # the piece the next byte is in, and where in it
        self.received = 0
        self.differs: int | None = None

    def add(self, chunk: bytes) -> None:
        position = 0
        while position < len(chunk) and self.differs is None:
            written = self._answering.written
            if self._piece == len(written):  # more than was written
                self.differs = self.received + position
                break
            piece = written[self._piece]
            take = min(len(chunk) - position, len(piece) - self._at)
            span, expected = chunk[position : position + take], piece[self._at : self._at + take]
            if span != expected:
                self.differs = self.received + position + next(i for i, (a, b) in enumerate(zip(span, expected)) if a != b)
            position += take
            self._at += take
            if self._at == len(piece):
                self._piece, self._at = self._piece + 1, 0
        self.received += len(chunk)


async def relay(http: aiohttp.ClientSession, url: str, key: str, answering: Upstream) -> Received:
    """Reads the answer to GET `url` to its end, comparing it with what `answering` wrote; nothing held."""
    async with http.get(url, headers={"X-API-Key": key}) as response:
        assert response.status == 200
        received = Received(answering)
        async for chunk in response.content.iter_any():
            received.add(chunk)
    return received


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("form", "size"), [("sse", 5 * GIB), ("json", GIB)], ids=["5-gib-stream", "1-gib-json"])
async def test_a_huge_answer_relays_unchanged_within_64_mb_and_charges_its_usage(gateway, upstream, form, size):
    answering, _ = upstream
    baseline = gateway.rss_bytes()
    started = time.monotonic()
    async with aiohttp.ClientSession() as http:
        with PeakRss(gateway.rss_bytes, interval=SAMPLE_INTERVAL) as rss:
            got = await relay(http, f"{gateway.url}/{form}?size={size}", "huge", answering)
        received = got.received
        elapsed = time.monotonic() - started
        growth = rss.peak - baseline
        print(f"{size / GIB:.0f} GiB {form}: {received / elapsed / 1e6:.0f} MB/s, gateway RSS +{growth / 1e6:.1f} MB over {rss.samples} samples")
        assert received == answering.sent >= size
        assert got.differs is None, f"byte {got.differs} is not the byte the upstream sent"
        assert rss.samples > 1
        assert growth <= RSS_GROWTH_LIMIT
        assert await charged(http, gateway, "huge") == pytest.approx(USAGE["total_tokens"], abs=1e-3)


@pytest.mark.parametrize("form", ["sse", "json"])
async def test_a_malformed_usage_at_the_end_of_a_long_answer_charges_missing(gateway, upstream, form):
    answering, _ = upstream
    usage = json.dumps({"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": "abc"})
    async with aiohttp.ClientSession() as http:
        got = await relay(http, f"{gateway.url}/{form}?size={SMALL}&usage={usage}", "malformed", answering)
        assert (got.received, got.differs) == (answering.sent, None)
        assert await charged(http, gateway, "malformed") == pytest.approx(MISSING, abs=1e-3)


async def test_a_stream_cut_in_its_usage_event_charges_missing(gateway, upstream):
    answering, _ = upstream
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{gateway.url}/sse?size={SMALL}&cut=1", headers={"X-API-Key": "cut"}) as response:
            assert response.status == 200
            got = Received(answering)
            with pytest.raises(aiohttp.ClientPayloadError):
                async for chunk in response.content.iter_any():
                    got.add(chunk)
                    answering.client_read(got.received)
        # What came before the cut came unchanged, the unended usage event included.
        assert (got.received, got.differs) == (answering.sent, None)

        # The gateway settles when the request ends, which the client may see first.
        async def settled() -> bool:
            return await charged(http, gateway, "cut") == pytest.approx(MISSING, abs=1e-3)

        await eventually(settled, what=f"the cut stream charged missing ({MISSING})")
