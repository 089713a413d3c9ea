"""Costs the response says, through gateway processes started as users start them, on a
real redis-server, in front of a real aiohttp upstream that reports each request's units
in a header (`X-Usage-Units`, from the request's `?units=`, or at random).

- A reservation the bucket cannot hold: 429 with the RateLimit fields.
- Less than reserved: the difference goes back, exactly; more: the bucket goes into debt,
  the admin API shows it, the key's TTL covers it, and the next request is refused.
- Redis paused while a response is settled: the settlement is sent, not answered, and
  not sent again (`unconfirmed`), and applied once when Redis wakes.
- Two gateways on one Redis, 50 concurrent clients of one key until each is refused: the
  units Redis was charged equal the sum the upstream reported for the requests it answered,
  and that sum exceeds the budget by no more than the bound docs/limit-policies.md states.

Limits refill one unit a year, so what Redis holds is what was charged, to within a
millionth of a unit. The refill past zero, exact on an injected clock, is in test_settlement.

The tests share one redis-server and two gateways on the module's event loop, in front of an
upstream that hands each request to the handler registered for its API key: each test has its
keys and handler, and reads the counters its requests moved. The test that pauses Redis has
a gateway and a Redis of its own.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from tests.processes import GatewayProcess, RedisServer, eventually, free_port, gateway_fleet
from tests.scrape import scrape, value
from tests.upstream import serving

BURST = 1000
RESERVE = 20
CLIENTS = 50
MAX_UNITS = 2 * RESERVE  # the fleet test's upstream reports 0 to this many
STREAM_BURST = 10_000_000

pytestmark = pytest.mark.asyncio(loop_scope="module")

CONFIG = """
store: {{url: "{url}"}}
limits:
  tokens:
    rate: 1/year
    burst: {burst}
    key: header:X-API-Key
    cost: {{from: "header:X-Usage-Units", reserve: {reserve}, missing: {reserve}}}
routes:
  - match: {{path: /}}
    upstream: {upstream}
    limits: [tokens]
"""


class Upstream:
    """Answers each request with `?units=` units, or a random number up to MAX_UNITS, in
    X-Usage-Units, and keeps the sum of what it reported."""

    def __init__(self) -> None:
        self.reported = 0
        self.answered = 0
        self.before_answer: asyncio.Event | None = None  # set: the next answer waits for it
        self.waiting = asyncio.Event()

    async def handle(self, request: web.BaseRequest) -> web.Response:
        given = request.query.get("units")
        units = random.randint(0, MAX_UNITS) if given is None else int(given) if given.isdigit() else 0
        if self.before_answer is not None:
            self.waiting.set()
            await self.before_answer.wait()
        self.reported += units
        self.answered += 1
        return web.Response(text="ok", headers={"X-Usage-Units": given if given and not given.isdigit() else str(units)})


@pytest_asyncio.fixture(loop_scope="module")
async def upstream() -> AsyncIterator[tuple[Upstream, str]]:
    answering = Upstream()
    async with serving(answering.handle) as url:
        yield answering, url


@pytest.fixture
def redis_server():
    with RedisServer() as server:
        yield server


def config(redis_server: RedisServer, upstream_url: str) -> str:
    return CONFIG.format(url=redis_server.url, burst=BURST, reserve=RESERVE, upstream=upstream_url)


async def bucket(http: aiohttp.ClientSession, gateway: GatewayProcess, key: str, limit: str = "tokens") -> dict:
    async with http.get(f"{gateway.admin_url}/buckets/{limit}?source=header:X-API-Key&value={key}") as response:
        assert response.status == 200
        return await response.json()


SHARED = """
store: {{url: "{url}"}}
limits:
  tokens:
    rate: 1/year
    burst: {burst}
    key: header:X-API-Key
    cost: {{from: "header:X-Usage-Units", reserve: {reserve}, missing: {reserve}}}
  llm:
    rate: 1/year
    burst: {burst}
    key: header:X-API-Key
    cost: {{from: "json:usage.total_tokens", reserve: {reserve}, missing: {reserve}}}
  by_bytes:
    rate: 1/year
    burst: {burst}
    key: header:X-API-Key
    cost: {{from: response-bytes, reserve: {reserve}}}
  streamed_bytes: {{rate: 1/year, burst: {stream_burst}, key: header:X-API-Key, cost: {{from: response-bytes, reserve: {reserve}}}}}
routes:
  - match: {{path: /down}}
    upstream: http://127.0.0.1:{dead_port}
    limits: [tokens]
  - match: {{path: /bytes}}
    upstream: {upstream}
    limits: [by_bytes]
  - match: {{path: /stream}}
    upstream: {upstream}
    limits: [streamed_bytes]
  - match: {{path: /v1}}
    upstream: {upstream}
    limits: [llm]
  - match: {{path: /}}
    upstream: {upstream}
    limits: [tokens]
"""

Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared() -> AsyncIterator[tuple[list[GatewayProcess], RedisServer, dict[str, Handler]]]:
    """The module's redis-server and two gateways on it, in front of an upstream that hands
    each request to the handler registered (by a test) for its X-API-Key."""
    handlers: dict[str, Handler] = {}

    async def by_key(request: web.BaseRequest) -> web.StreamResponse:
        return await handlers[request.headers["X-API-Key"]](request)

    with RedisServer() as redis_server:
        async with serving(by_key) as upstream_url:
            text = SHARED.format(
                url=redis_server.url, burst=BURST, reserve=RESERVE, stream_burst=STREAM_BURST,
                upstream=upstream_url, dead_port=free_port(),
            )
            with gateway_fleet(text, 2) as gateways:
                yield gateways, redis_server, handlers


async def counters(http: aiohttp.ClientSession, gateway: GatewayProcess) -> collections.Counter[tuple[str, str]]:
    """The gateway's charged units by limit (`cost`, limit) and settlements by outcome
    (`settlements`, outcome): a test of the shared gateways counts what its requests moved."""
    _, samples = await scrape(http, gateway.admin_url)
    found: collections.Counter[tuple[str, str]] = collections.Counter()
    for sample in samples:
        if sample.name == "gateway_limiter_cost_total":
            found["cost", sample.labels["limit"]] += sample.value
        elif sample.name == "gateway_limiter_settlements_total":
            found["settlements", sample.labels["outcome"]] += sample.value
    return found


async def test_refund_debt_ttl_and_refusal(shared):
    (gateway, _), redis_server, handlers = shared
    handlers["debtor"] = Upstream().handle
    async with aiohttp.ClientSession() as http:
        before = await counters(http, gateway)
        async with http.get(gateway.url + "/?units=3", headers={"X-API-Key": "debtor"}) as response:
            assert response.status == 200
            assert response.headers["X-Usage-Units"] == "3"
        assert (await bucket(http, gateway, "debtor"))["tokens"] == pytest.approx(BURST - 3, abs=1e-6)

        async with http.get(gateway.url + f"/?units={BURST + 50}", headers={"X-API-Key": "debtor"}) as response:
            assert response.status == 200
        found = await bucket(http, gateway, "debtor")
        assert found["tokens"] == pytest.approx(-53, abs=1e-6)
        assert found["debt"] == pytest.approx(53, abs=1e-6)
        year = 365 * 86400
        assert found["debt_clears_in_seconds"] == pytest.approx(53 * year, rel=1e-6)
        # The key outlives the refill from its debt.
        assert redis_server.client().pttl(found["key"]) >= (BURST + 53) * year * 1000 - 1000

        async with http.get(gateway.url + "/?units=0", headers={"X-API-Key": "debtor"}) as response:
            assert response.status == 429
            assert int(response.headers["Retry-After"]) >= (53 + RESERVE) * year - 1
            assert response.headers["RateLimit"].startswith('"tokens";r=0')
            assert "RateLimit-Policy" in response.headers
            problem = await response.json(content_type=None)
            assert problem["violated-policies"] == ["tokens"]

        moved = await counters(http, gateway)
        moved.subtract(before)
        assert moved["cost", "tokens"] == 3 + BURST + 50
        assert moved["settlements", "settled"] == 2
        assert (await counters(http, gateway))["settlements", "lost"] == 0


async def test_redis_paused_at_settlement_is_unconfirmed_and_applied_once(redis_server, upstream):
    answering, upstream_url = upstream
    with GatewayProcess(config(redis_server, upstream_url)) as gateway:
        async with aiohttp.ClientSession() as http:
            answering.before_answer = asyncio.Event()
            request = asyncio.ensure_future(http.get(gateway.url + "/?units=70", headers={"X-API-Key": "k"}))
            await answering.waiting.wait()  # reserved; the answer comes once Redis is paused
            redis_server.pause()
            try:
                answering.before_answer.set()
                response = await request
                assert response.status == 200
                response.release()
            finally:
                redis_server.resume()
            _, samples = await scrape(http, gateway.admin_url)
            assert value(samples, "gateway_limiter_settlements_total", outcome="unconfirmed") == 1
            assert value(samples, "gateway_limiter_cost_total", limit="tokens") == RESERVE  # all it knows charged
            assert (await bucket(http, gateway, "k"))["tokens"] == pytest.approx(BURST - 70, abs=1e-6)


async def test_two_gateways_fifty_clients_settle_exactly_within_the_overshoot(shared):
    gateways, _, handlers = shared
    answering = Upstream()
    handlers["shared"] = answering.handle
    admitted_units: list[int] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=CLIENTS * 2)) as http:
        before = [await counters(http, gateway) for gateway in gateways]

        async def client(i: int) -> None:
            gateway = gateways[i % 2]
            while True:
                async with http.get(gateway.url + "/", headers={"X-API-Key": "shared"}) as response:
                    await response.read()
                    if response.status == 429:
                        return
                    assert response.status == 200
                    admitted_units.append(int(response.headers["X-Usage-Units"]))

        await asyncio.gather(*(client(i) for i in range(CLIENTS)))
        reported = sum(admitted_units)
        assert reported == answering.reported and len(admitted_units) == answering.answered
        charged = BURST - (await bucket(http, gateways[0], "shared"))["tokens"]
        # Every unit the upstream reported was settled in Redis, once.
        assert charged == pytest.approx(reported, abs=1e-3)
        # Within the budget, plus what the requests in flight could cost beyond their reservations.
        overshoot = reported - BURST
        assert overshoot <= CLIENTS * (MAX_UNITS - RESERVE), (reported, len(admitted_units))
        totals = 0.0
        for gateway, earlier in zip(gateways, before, strict=True):
            moved = await counters(http, gateway)
            assert moved["settlements", "unconfirmed"] == 0
            moved.subtract(earlier)
            totals += moved["cost", "tokens"]
        assert totals == reported
    print(f"admitted {len(admitted_units)} requests costing {reported} units against a burst of {BURST}: overshoot {overshoot}")


async def test_no_answer_gives_the_reservation_back_and_silence_costs_missing(shared):
    (gateway, _), _, handlers = shared
    handlers["silent"] = handlers["bytes"] = Upstream().handle
    async with aiohttp.ClientSession() as http:
        async with http.get(gateway.url + "/down", headers={"X-API-Key": "silent"}) as response:
            assert response.status == 502  # nothing listens: no answer, nothing charged
        found = await bucket(http, gateway, "silent")
        assert found["tokens"] == pytest.approx(BURST, abs=1e-6)
        async with http.get(gateway.url + "/?units=not-a-number", headers={"X-API-Key": "silent"}) as response:
            assert response.status == 200  # the upstream says nothing the gateway can read
        assert (await bucket(http, gateway, "silent"))["tokens"] == pytest.approx(BURST - RESERVE, abs=1e-6)  # `missing`
        async with http.get(gateway.url + "/bytes?units=7", headers={"X-API-Key": "bytes"}) as response:
            assert await response.read() == b"ok"
        found = await bucket(http, gateway, "bytes", limit="by_bytes")
        assert found["tokens"] == pytest.approx(BURST - 2, abs=1e-6)  # the 2 bytes relayed


async def test_a_client_gone_mid_stream_is_charged_the_bytes_relayed(shared):
    (gateway, _), _, handlers = shared
    piece = 65536
    release = asyncio.Event()

    async def streaming(request: web.BaseRequest) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"x" * piece)
        await release.wait()  # the rest would come after the client has gone
        await response.write(b"x" * piece)
        return response

    handlers["streamer"] = streaming
    async with aiohttp.ClientSession() as http:
        before = await counters(http, gateway)
        async with http.get(gateway.url + "/stream", headers={"X-API-Key": "streamer"}) as response:
            assert len(await response.content.readexactly(piece)) == piece
            response.close()  # gone mid-stream
        moved: collections.Counter[tuple[str, str]] = collections.Counter()

        async def settled() -> bool:
            moved.clear()
            moved.update(await counters(http, gateway))
            moved.subtract(before)
            return moved["settlements", "settled"] == 1

        try:
            await eventually(settled, what="the settlement of the request cut off")
        finally:
            release.set()
        assert moved["cost", "streamed_bytes"] == piece
        found = await bucket(http, gateway, "streamer", limit="streamed_bytes")
        assert found["tokens"] == pytest.approx(STREAM_BURST - piece, abs=1e-3)


class LlmUpstream:
    """An OpenAI-style upstream: each answer costs a random number of tokens, up to
    MAX_UNITS, said in `usage.total_tokens`: of a JSON completion, or of the last event of a
    server-sent stream (when the request asks `stream`), as OpenAI sends it with
    `stream_options.include_usage`. Keeps the sum of what it reported."""

    def __init__(self) -> None:
        self.reported = 0

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        asked = await request.json()
        tokens = random.randint(0, MAX_UNITS)
        self.reported += tokens
        usage = {"prompt_tokens": tokens // 2, "completion_tokens": tokens - tokens // 2, "total_tokens": tokens}
        if not asked.get("stream"):
            return web.json_response({"object": "chat.completion", "choices": [{"index": 0}], "usage": usage})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for word in ("a", "b", "c"):
            chunk = {"object": "chat.completion.chunk", "choices": [{"delta": {"content": word}}], "usage": None}
            await response.write(b"data: %s\n\n" % json.dumps(chunk).encode())
        last = {"object": "chat.completion.chunk", "choices": [], "usage": usage}
        await response.write(b"data: %s\n\ndata: [DONE]\n\n" % json.dumps(last).encode())
        await response.write_eof()
        return response


def said_tokens(body: bytes, streamed: bool) -> int:
    """What the client read of its usage: the JSON's, or the last event's that has one."""
    if not streamed:
        return json.loads(body)["usage"]["total_tokens"]
    events = [line[6:] for line in body.decode().split("\n") if line.startswith("data: ") and line != "data: [DONE]"]
    return next(json.loads(e)["usage"]["total_tokens"] for e in reversed(events) if json.loads(e)["usage"])


async def test_two_gateways_settle_an_llm_apis_tokens_from_json_and_streams_exactly(shared):
    """The same limit reads `json:usage.total_tokens` from a JSON completion and from the
    events of a stream on one path (an answer in text/event-stream is read as events)."""
    gateways, _, handlers = shared
    llm = LlmUpstream()
    handlers["llm"] = llm.handle
    tokens: list[int] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=CLIENTS * 2)) as http:

        async def client(i: int) -> None:
            gateway, streamed = gateways[i % 2], i % 3 == 0
            while True:
                body = {"messages": [{"role": "user", "content": "hi"}], "stream": streamed}
                async with http.post(gateway.url + "/v1/chat/completions", json=body, headers={"X-API-Key": "llm"}) as response:
                    answer = await response.read()
                    if response.status == 429:
                        return
                    assert response.status == 200
                    tokens.append(said_tokens(answer, streamed))

        await asyncio.gather(*(client(i) for i in range(CLIENTS)))
        charged = BURST - (await bucket(http, gateways[0], "llm", limit="llm"))["tokens"]
    reported = sum(tokens)
    assert reported == llm.reported  # every answer reached its client whole
    assert charged == pytest.approx(reported, abs=1e-3)  # and was settled in Redis, once
    assert reported - BURST <= CLIENTS * (MAX_UNITS - RESERVE), (reported, len(tokens))
