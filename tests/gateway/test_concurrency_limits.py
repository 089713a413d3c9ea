"""Concurrency limits end to end: a gateway process (`python -m gateway run`) on a private
Redis in front of a real upstream. A lease is given back however its response ends (the
client hangs up, the upstream fails, a WebSocket closes), each failure policy answers
when Redis is down, and bad config is one line naming the YAML path.

A WebSocket holds its lease exactly while it lives: across TTLs with the socket open,
and not a moment past its end, whichever side ends it and however (a close frame, a
dropped connection, a refused handshake).

The tests share one redis-server, gateway and upstream (`shared`, on the module's event
loop): each is a client of its own, an API key its upstream and its leases are told
apart by. The test that stops Redis starts its own."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from gateway.config import ConfigError
from gateway.limiter.keys import identity_digest, lease_key
from gateway.redis.secret import SECRET_KEY_SUFFIX
from gateway.testing import config_from_yaml
from tests.processes import GatewayProcess, RedisServer, eventually, free_port, run_cli
from tests.scrape import decisions
from tests.upstream import UPSTREAM_BYE, CountingUpstream, serving

# The shared upstream and gateway serve on the module's event loop: every async test runs on it.
on_module_loop = pytest.mark.asyncio(loop_scope="module")

# The shortest lease_ttl the config takes: the limit `brief` renews its leases every third of it.
BRIEF_TTL = 1.0

CONFIG = """
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
store: {{url: "{url}", local_divisor: 2}}
limits:
  conns:  {{concurrency: 1, key: header:X-API-Key}}
  open:   {{concurrency: 1, key: header:X-API-Key, on_store_error: open}}
  closed: {{concurrency: 1, key: header:X-API-Key, on_store_error: closed}}
  local:  {{concurrency: 2, key: header:X-API-Key, on_store_error: local}}
  brief:  {{concurrency: 1, key: header:X-API-Key, lease_ttl: 1s}}
routes:
  - {{match: {{path: /down}}, upstream: "http://127.0.0.1:{closed_port}", limits: [conns]}}
  - {{match: {{path: /open}}, upstream: "{upstream}", strip_prefix: true, limits: [open]}}
  - {{match: {{path: /closed}}, upstream: "{upstream}", strip_prefix: true, limits: [closed]}}
  - {{match: {{path: /local}}, upstream: "{upstream}", strip_prefix: true, limits: [local]}}
  - {{match: {{path: /brief}}, upstream: "{upstream}", strip_prefix: true, limits: [brief]}}
  - {{match: {{path: /}}, upstream: "{upstream}", limits: [conns]}}
"""


@dataclass
class Client:
    """One test's view of a gateway: its API key, the upstream that sees its requests,
    an HTTP session, and the redis-server under the gateway."""

    gateway: GatewayProcess
    upstream: CountingUpstream
    http: aiohttp.ClientSession
    redis_server: RedisServer
    key: str

    @property
    def headers(self) -> dict[str, str]:
        return {"X-API-Key": self.key}

    async def status(self, path: str, **headers: str) -> int:
        async with self.http.get(self.gateway.url + path, headers={**self.headers, **headers}) as response:
            await response.read()
            return response.status

    def leases(self, limit: str = "conns") -> int:
        """How many leases this client holds in Redis under `limit`: the size of the ZSET
        of lease ids under its identity, hashed as the gateway hashes it, with the
        secret the gateway keeps in Redis."""
        with self.redis_server.client() as client:
            secret = client.get("rl:" + SECRET_KEY_SUFFIX)
            if secret is None:
                return 0  # no lease was ever taken
            return client.zcard(lease_key("rl:", limit, identity_digest(secret.encode(), f"header:x-api-key={self.key}")))

    def lease_expiry(self, limit: str) -> float:
        """The expiry of this client's one lease under `limit`, in Redis's milliseconds."""
        with self.redis_server.client() as client:
            secret = client.get("rl:" + SECRET_KEY_SUFFIX).encode()
            ((_, score),) = client.zrange(
                lease_key("rl:", limit, identity_digest(secret, f"header:x-api-key={self.key}")), 0, -1, withscores=True
            )
            return score


@contextlib.asynccontextmanager
async def gateway_on(redis_server: RedisServer, *args: str, key: str = "k") -> AsyncIterator[Client]:
    """A gateway of its own on `redis_server`, in front of an upstream of its own."""
    upstream = CountingUpstream()
    async with serving(upstream.handle) as upstream_url:
        config = CONFIG.format(url=redis_server.url, upstream=upstream_url, closed_port=free_port())
        with GatewayProcess(config, args=args) as gateway:
            async with aiohttp.ClientSession() as http:
                try:
                    yield Client(gateway, upstream, http, redis_server, key)
                finally:
                    upstream.gate.set()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared_gateway() -> AsyncIterator[tuple[GatewayProcess, RedisServer, dict[str, CountingUpstream]]]:
    """The module's redis-server and gateway (with a JSON access log), in front of an
    upstream that hands each request to the CountingUpstream registered for its API key."""
    upstreams: dict[str, CountingUpstream] = {}

    async def by_key(request: web.BaseRequest) -> web.StreamResponse:
        return await upstreams[request.headers["X-API-Key"]].handle(request)

    with RedisServer() as redis_server:
        async with serving(by_key) as upstream_url:
            config = CONFIG.format(url=redis_server.url, upstream=upstream_url, closed_port=free_port())
            with GatewayProcess(config, args=("--access-log", "json")) as gateway:
                yield gateway, redis_server, upstreams


_keys = itertools.count()


@pytest_asyncio.fixture(loop_scope="module")
async def shared(shared_gateway) -> AsyncIterator[Client]:
    """The shared gateway, as a client with an API key and an upstream of its own."""
    gateway, redis_server, upstreams = shared_gateway
    key = f"k{next(_keys)}"
    upstreams[key] = upstream = CountingUpstream()
    async with aiohttp.ClientSession() as http:
        try:
            yield Client(gateway, upstream, http, redis_server, key)
        finally:
            upstream.gate.set()


async def admitted_again(client: Client, path: str = "/fast") -> None:
    """The client's one lease is free: a new request gets in. Leases live 60 s, so one
    that was not given back fails this."""

    async def admitted() -> bool:
        return await client.status(path) == 200

    await eventually(admitted, what="a new request to be admitted", deadline=10)


async def no_lease_left(client: Client, limit: str = "conns") -> None:
    await eventually(lambda: client.leases(limit) == 0, what=f"no lease of {limit} left in Redis")


def ws_url(gateway: GatewayProcess, path: str) -> str:
    return gateway.url.replace("http", "ws", 1) + path


async def raw_websocket(client: Client, path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A WebSocket opened by hand on a bare TCP connection, and one text message echoed
    through it: its connection can then be dropped with no close frame, as a client's can."""
    host, port = client.gateway.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write(
        f"GET {path} HTTP/1.1\r\nHost: x\r\nX-API-Key: {client.key}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        f"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: {key}\r\n\r\n".encode()
    )
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 101 "), head
    mask = os.urandom(4)
    payload = bytes(b ^ mask[i % 4] for i, b in enumerate(b"hi"))
    writer.write(bytes([0x81, 0x80 | 2]) + mask + payload)  # FIN + text; masked, as from a client
    echoed = await asyncio.wait_for(reader.readexactly(2 + len(b"echo:hi")), 10)
    assert echoed == bytes([0x81, len(b"echo:hi")]) + b"echo:hi"
    return reader, writer


async def held_request(client: Client) -> asyncio.StreamWriter:
    """A request for /held on a bare TCP connection, once the upstream holds it: the
    connection can then be dropped mid-request, as a client's can."""
    host, port = client.gateway.url.removeprefix("http://").split(":")
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"GET /held HTTP/1.1\r\nHost: x\r\nX-API-Key: {client.key}\r\n\r\n".encode())
    await eventually(lambda: client.upstream.in_flight[client.key] == 1, what="the request held upstream")
    return writer


@on_module_loop
async def test_a_concurrency_429_advertises_its_limit_in_concurrent_requests(shared):
    writer = await held_request(shared)
    async with shared.http.get(shared.gateway.url + "/fast", headers=shared.headers) as response:
        problem = await response.json(content_type=None)
        assert response.status == 429
        assert response.headers.getall("RateLimit-Policy") == ['"conns";q=1;qu="concurrent-requests"']
        assert response.headers.getall("RateLimit") == ['"conns";r=0']  # no window: room comes when one ends
        assert response.headers["Retry-After"] == "1"
    assert problem["type"] == "https://iana.org/assignments/http-problem-types#quota-exceeded"
    assert problem["violated-policies"] == ["conns"]
    writer.close()
    await writer.wait_closed()


@on_module_loop
async def test_a_route_with_only_a_concurrency_limit_advertises_its_policy(shared):
    async with shared.http.get(shared.gateway.url + "/fast", headers=shared.headers) as response:
        assert response.status == 200
        assert response.headers.getall("RateLimit-Policy") == ['"conns";q=1;qu="concurrent-requests"']
        assert "RateLimit" not in response.headers  # no window, and room is not counted before the answer


@on_module_loop
async def test_a_client_that_hangs_up_gives_its_lease_back(shared):
    writer = await held_request(shared)
    assert await shared.status("/fast") == 429
    writer.close()
    await writer.wait_closed()
    await admitted_again(shared)
    await no_lease_left(shared)


@on_module_loop
async def test_an_upstream_that_fails_or_is_down_gives_the_lease_back(shared):
    assert await shared.status("/reset") == 502
    await admitted_again(shared)
    assert await shared.status("/down") == 502  # nothing listens there
    await admitted_again(shared)
    assert shared.upstream.most[shared.key] == 1


@on_module_loop
async def test_a_websocket_holds_its_lease_until_it_closes(shared):
    async with shared.http.ws_connect(ws_url(shared.gateway, "/ws"), headers=shared.headers) as ws:
        await ws.send_str("hi")
        assert (await ws.receive()).data == "echo:hi"
        assert await shared.status("/fast") == 429
        assert shared.leases() == 1
    await admitted_again(shared)
    await no_lease_left(shared)
    assert shared.upstream.in_flight[shared.key] == 0
    assert shared.upstream.ws_closed_with == [aiohttp.WSCloseCode.OK]  # the client's own close, passed on


# The upstream closes with its own frame (passed on), or drops the connection without one:
# then the client gets BAD_GATEWAY (1014), not 1006, which reports a lost connection
# and may not be sent (RFC 6455 §7.4.1).
@pytest.mark.parametrize(
    "path, close_code", [("/ws-bye", UPSTREAM_BYE), ("/ws-drop", aiohttp.WSCloseCode.BAD_GATEWAY)], ids=["closes", "drops"]
)
@on_module_loop
async def test_a_websocket_whose_upstream_ends_it_gives_its_lease_back(shared, path, close_code):
    async with shared.http.ws_connect(ws_url(shared.gateway, path), headers=shared.headers) as ws:
        assert await shared.status("/fast") == 429  # held while the socket is open
        await ws.send_str("hi")
        assert await ws.receive_str(timeout=10) == "echo:hi"
        closed = await ws.receive(timeout=10)
        assert (closed.type, closed.data) == (aiohttp.WSMsgType.CLOSE, close_code)
    await admitted_again(shared)
    await no_lease_left(shared)
    assert shared.upstream.in_flight[shared.key] == 0


@pytest.mark.parametrize("drop", ["reset", "fin"])
@on_module_loop
async def test_a_websocket_whose_client_drops_without_a_close_frame_gives_its_lease_back(shared, drop):
    _, writer = await raw_websocket(shared, "/ws")
    assert shared.upstream.in_flight[shared.key] == 1
    assert await shared.status("/fast") == 429
    if drop == "reset":
        writer.transport.abort()
    else:
        writer.close()  # a FIN, with no close frame before it
    await eventually(lambda: shared.upstream.in_flight[shared.key] == 0, what="the upstream's side of the WebSocket to end")
    # Told the client went away, in a close frame a peer accepts (not 1006, see RFC 6455 §7.4.1).
    assert shared.upstream.ws_closed_with == [aiohttp.WSCloseCode.GOING_AWAY]
    await admitted_again(shared)
    await no_lease_left(shared)


@on_module_loop
async def test_a_websocket_that_outlives_its_lease_ttl_keeps_its_lease(shared):
    """Elapsed time is what is tested here: the socket stays open across 3.5 TTLs, and each
    round waits for the gateway to renew the lease in Redis (a later expiry), then checks
    that the one lease is all there is and still refuses a second request."""
    http, gateway = shared.http, shared.gateway
    with shared.redis_server.client() as client:
        async with http.ws_connect(ws_url(gateway, "/brief/ws"), headers=shared.headers) as ws:
            opened = time.monotonic()
            renewals = 0
            last = shared.lease_expiry("brief")
            while time.monotonic() - opened < 3.5 * BRIEF_TTL:
                await eventually(
                    lambda last=last: shared.lease_expiry("brief") > last, what="the lease renewed", deadline=BRIEF_TTL
                )
                last = shared.lease_expiry("brief")
                renewals += 1
                seconds, micros = client.time()
                assert last > seconds * 1000 + micros / 1000  # live, by Redis's own clock
                await ws.send_str(str(renewals))
                assert await ws.receive_str(timeout=10) == f"echo:{renewals}"
                assert await shared.status("/brief/fast") == 429
                with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                    await http.ws_connect(ws_url(gateway, "/brief/ws"), headers=shared.headers)
                assert refused.value.status == 429
                assert shared.leases("brief") == 1
            assert renewals >= 3  # one a third of the TTL, about 10 over 3.5 TTLs; fewer seen if rounds are slow
    await admitted_again(shared, "/brief/fast")
    await no_lease_left(shared, "brief")


@pytest.mark.parametrize("path", ["/fast", "/down"], ids=["refused", "down"])
@on_module_loop
async def test_a_websocket_handshake_the_upstream_refuses_or_cannot_take_gives_the_lease_back(shared, path):
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await shared.http.ws_connect(ws_url(shared.gateway, path), headers=shared.headers)
    assert refused.value.status == 502
    await admitted_again(shared)
    await no_lease_left(shared)


@on_module_loop
async def test_each_failure_policy_answers_while_redis_is_down(redis_server):
    async with gateway_on(redis_server) as own:
        redis_server.stop()
        assert await own.status("/open/fast") == 200
        async with own.http.get(own.gateway.url + "/closed/fast", headers=own.headers) as response:
            assert response.status == 503
            assert response.headers["Retry-After"] == "1"
            assert (await response.json())["violated-policies"] == ["closed"]
        # local: 2 across the fleet, divided by local_divisor 2, so 1 here.
        held = asyncio.ensure_future(own.status("/local/held"))
        await eventually(lambda: own.upstream.in_flight[own.key] == 1, what="the request held upstream")
        assert await own.status("/local/fast") == 429
        own.upstream.gate.set()
        assert await held == 200
        await admitted_again(own, "/local/fast")
        counts = await decisions(own.http, own.gateway.admin_url)
    assert counts["open", "fail_open"] == 1
    assert counts["closed", "fail_closed"] == 1
    assert counts["local", "fail_local"] >= 3


@on_module_loop
async def test_the_access_log_names_the_concurrency_limit_that_refused(shared):
    """The shared gateway writes a line for every test's requests: this test's carry
    request ids of their own."""
    held = asyncio.ensure_future(shared.status("/held", **{"X-Request-ID": f"{shared.key}-held"}))
    await eventually(lambda: shared.upstream.in_flight[shared.key] == 1, what="the request held upstream")
    assert await shared.status("/fast", **{"X-Request-ID": f"{shared.key}-fast"}) == 429
    shared.upstream.gate.set()
    assert await held == 200

    def lines() -> list[dict]:
        records = [json.loads(line) for line in shared.gateway.stdout_lines]
        return [r for r in records if r["request_id"] in (f"{shared.key}-held", f"{shared.key}-fast")]

    await eventually(lambda: len(lines()) == 2, what="two access log lines")
    refused, admitted = sorted(lines(), key=lambda line: line["status"], reverse=True)
    assert (refused["status"], refused["decision"]) == (429, "deny")
    assert [(x["name"], x["decision"]) for x in refused["limits"]] == [("conns", "concurrency_limited")]
    assert (admitted["status"], admitted["decision"]) == (200, "allow")
    assert [(x["name"], x["decision"]) for x in admitted["limits"]] == [("conns", "allow")]
    assert refused["limits"][0]["identity"] == admitted["limits"][0]["identity"]


@pytest.mark.parametrize(
    ("limit", "error"),
    [
        (
            "{concurrency: 2, rate: 1/second}",
            "limits.c.rate: a concurrency limit takes no rate; define a rate limit of its own and list both on the route",
        ),
        ("{concurrency: 0}", "limits.c.concurrency: expected an integer >= 1, got 0"),
        ("{concurrency: 2, lease_ttl: 500ms}", "limits.c.lease_ttl: expected at least 1s, got '500ms'"),
        ("{concurrency: 2, shadow: true}", "limits.c.shadow: a concurrency limit takes no shadow"),
    ],
)
def test_a_bad_concurrency_limit_is_one_line_naming_its_path(limit: str, error: str):
    text = f"limits:\n  c: {limit}\nroutes:\n  - {{match: {{path: /}}, upstream: 'http://127.0.0.1:1', limits: [c]}}\n"
    with pytest.raises(ConfigError) as raised:
        config_from_yaml(text)
    assert str(raised.value).startswith(f"<test>: {error}")


def test_a_cost_on_a_concurrency_limit_is_refused_by_gateway_check(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "limits:\n  c: {concurrency: 2}\n"
        "routes:\n  - {match: {path: /}, upstream: 'http://127.0.0.1:1', limits: [{name: c, cost: 2}]}\n"
    )
    result = run_cli("check", "-c", str(path))
    assert result.returncode == 2
    assert result.stderr == (
        f"gateway: {path}: routes[0].limits[0].cost: limit 'c' counts requests in flight, one each; "
        "a cost does not apply\n"
    )


def test_a_route_may_have_rate_and_concurrency_limits_together():
    config = config_from_yaml(
        "limits:\n  r: {rate: 1/second}\n  c: {concurrency: 3, lease_ttl: 90s}\n"
        "routes:\n  - {match: {path: /}, upstream: 'http://127.0.0.1:1', limits: [r, c]}\n"
    )
    (route,) = config.routes
    assert [rl.limit.name for rl in route.limits] == ["r"]
    assert [(c.name, c.concurrency, c.lease_ttl) for c in route.concurrency] == [("c", 3, 90.0)]
