"""The admin API on a concurrency limit, end to end: a gateway process (`python -m gateway
run`) on the in-process store, a private Redis and a Redis Cluster, in front of an upstream
that holds requests until told. GET /buckets/{limit} shows the client's requests in flight
as the store counts them; DELETE frees the client while those requests go on."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp

from tests.processes import GatewayProcess, RedisCluster, eventually
from tests.upstream import CountingUpstream, serving

API_KEY = "client-key-5e2b"
PROBLEM = "application/problem+json"

CONFIG = """
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
{store}
{extra}
limits:
  conns: {{concurrency: 3, key: header:X-API-Key}}
  per_key: {{rate: 100/second, key: header:X-API-Key}}
routes:
  - {{match: {{path: /}}, upstream: "{upstream}", limits: [conns, per_key]}}
"""


class Client:
    """One gateway process, its upstream, and the calls a test makes of both."""

    def __init__(self, gateway: GatewayProcess, upstream: CountingUpstream, http: aiohttp.ClientSession) -> None:
        self.gateway, self.upstream, self.http = gateway, upstream, http
        self.held: list[asyncio.Future[int]] = []

    async def status(self, path: str, key: str = API_KEY) -> int:
        async with self.http.get(self.gateway.url + path, headers={"X-API-Key": key}) as response:
            await response.read()
            return response.status

    async def hold(self, count: int, key: str = API_KEY) -> None:
        """`count` more requests of `key`, held upstream until the gate opens."""
        before = self.upstream.in_flight[key]
        self.held += [asyncio.ensure_future(self.status("/held", key)) for _ in range(count)]
        await eventually(lambda: self.upstream.in_flight[key] == before + count, what=f"{count} more requests held")

    async def finish(self) -> list[int]:
        self.upstream.gate.set()
        return list(await asyncio.gather(*self.held))

    async def admin(self, method: str, query: str, *, expect: int = 200, limit: str = "conns") -> dict:
        async with self.http.request(method, f"{self.gateway.admin_url}/buckets/{limit}?{query}") as response:
            body = await response.read()
            assert response.status == expect, body
            if expect >= 400:
                assert response.headers["Content-Type"].split(";")[0] == PROBLEM
            return json.loads(body)

    async def leases(self, key: str = API_KEY) -> dict:
        return await self.admin("GET", f"value={key}")


@contextlib.asynccontextmanager
async def gateway_with(store: str = "", extra: str = ""):
    upstream = CountingUpstream()
    async with serving(upstream.handle) as upstream_url:
        with GatewayProcess(CONFIG.format(store=store, extra=extra, upstream=upstream_url)) as gateway:
            async with aiohttp.ClientSession() as http:
                client = Client(gateway, upstream, http)
                try:
                    yield client
                finally:
                    upstream.gate.set()
                    await asyncio.gather(*client.held, return_exceptions=True)


async def inspect_hold_reset_and_finish(client: Client) -> tuple[dict, dict]:
    """Two requests held of 3 shown, the third fills the limit, a reset lets a new one in
    while the old ones are held, and when all end none is left. Returns the reading with two
    held and the reset's answer."""
    idle = await client.leases()
    assert (idle["in_flight"], idle["concurrency"], idle["next_lease_expires_in_seconds"]) == (0, 3, None)
    await client.hold(2)
    two = await client.leases()
    assert two["in_flight"] == 2 and two["limit"] == "conns" and two["source"] == "header:x-api-key"
    assert 59 < two["next_lease_expires_in_seconds"] <= two["last_lease_expires_in_seconds"] <= 60
    assert two["key"] == idle["key"]
    assert (await client.leases("someone-else"))["in_flight"] == 0

    await client.hold(1)
    assert (await client.leases())["in_flight"] == 3
    assert await client.status("/fast") == 429

    reset = await client.admin("DELETE", f"value={API_KEY}")
    assert reset["reset"] is True and reset["held"] is True
    assert (await client.leases())["in_flight"] == 0
    assert await client.status("/fast") == 200  # admitted while the three are still held upstream
    await client.hold(1)
    assert client.upstream.in_flight[API_KEY] == 4  # above the limit once, by the reset

    async def counted(expected: int) -> bool:
        return (await client.leases())["in_flight"] == expected

    # Only the request taken since the reset is counted, once /fast's release (in the background) lands.
    await eventually(lambda: counted(1), what="the held request taken since the reset alone counted")

    # The old requests end normally; their releases find nothing and count nothing.
    assert await client.finish() == [200] * 4
    await eventually(lambda: counted(0), what="every lease given back")
    assert (await client.admin("DELETE", f"value={API_KEY}"))["held"] is False
    assert "Traceback" not in "".join(client.gateway.stderr_lines)
    return two, reset


async def test_inspect_and_reset_a_concurrency_limit_on_the_in_process_store():
    async with gateway_with() as client:
        two, reset = await inspect_hold_reset_and_finish(client)
    assert two["store"] == "in-process" and two["key"].startswith("conns:leases:{")
    assert two["identity"].startswith("header:x-api-key#") and reset["identity"] == two["identity"]
    assert API_KEY not in json.dumps(two) + json.dumps(reset)


async def test_inspect_and_reset_a_concurrency_limit_on_one_redis(redis_server):
    store = f"store: {{url: '{redis_server.url}', prefix: 'adm:'}}"
    async with gateway_with(store) as client:
        await client.hold(2)
        held = await client.leases()
        with redis_server.client() as redis:
            assert held["key"].startswith("adm:conns:leases:{") and API_KEY not in held["key"]
            assert redis.zcard(held["key"]) == 2
            # A lease a killed gateway left, expired by Redis's clock but not yet dropped, counts for nothing.
            redis.zadd(held["key"], {"dead-gateway:0": 1})
            assert redis.zcard(held["key"]) == 3
            assert (await client.leases())["in_flight"] == 2
            assert held["store"].startswith("redis ")
            assert await client.finish() == [200, 200]

            async def none_in_flight() -> bool:
                return (await client.leases())["in_flight"] == 0

            await eventually(none_in_flight, what="both leases given back")
            client.held.clear()
            client.upstream.gate.clear()
            await inspect_hold_reset_and_finish(client)
            assert redis.exists(held["key"]) == 0


async def test_raw_identities_are_shown_when_the_config_opts_in():
    async with gateway_with(extra="admin_raw_identities: true") as client:
        await client.hold(1)
        held = await client.leases()
        reset = await client.admin("DELETE", f"value={API_KEY}")
    assert held["identity"] == reset["identity"] == f"header:x-api-key={API_KEY}"
    assert held["in_flight"] == 1 and reset["held"] is True


async def test_unknown_limits_and_sources_are_refused_and_a_store_that_is_down_is_503(redis_server):
    store = f"store: {{url: '{redis_server.url}'}}"
    async with gateway_with(store) as client:
        unknown = await client.admin("GET", "value=x", expect=404, limit="nope")
        assert unknown["limits"] == ["conns", "per_key"]
        await client.admin("DELETE", "value=x", expect=404, limit="nope")
        wrong = await client.admin("GET", "source=cookie:k&value=x", expect=400)
        assert wrong["sources"] == ["header:x-api-key", "ip"]
        await client.admin("GET", "source=header:x-api-key", expect=400)  # no value
        await client.admin("GET", "value=x&tier=gold", expect=400)  # a concurrency limit has no tiers
        assert (await client.admin("GET", "source=ip&value=127.0.0.1"))["source"] == "ip"
        redis_server.stop()
        for method in ("GET", "DELETE"):
            down = await client.admin(method, f"value={API_KEY}", expect=503)
            assert down["title"] == "Service Unavailable" and "store" in down["detail"]


async def test_inspect_and_reset_a_concurrency_limit_on_a_redis_cluster():
    with RedisCluster() as cluster:
        async with gateway_with(f"store: {{url: '{cluster.url}', prefix: 'adm:'}}") as client:
            keys = [f"spread-{n}" for n in range(8)]
            for key in keys:
                await client.hold(1, key)
            readings = [await client.leases(key) for key in keys]
            assert [reading["in_flight"] for reading in readings] == [1] * len(keys)
            assert (await client.admin("DELETE", "value=spread-0"))["held"] is True
            assert (await client.leases("spread-0"))["in_flight"] == 0
            assert [(await client.leases(key))["in_flight"] for key in keys[1:]] == [1] * (len(keys) - 1)
            assert await client.finish() == [200] * len(keys)
        # Each identity was read and reset on the master of its own slot, across the cluster.
        redis = cluster.client()
        owners = {
            port
            for reading in readings
            for port, ranges in cluster.masters().items()
            if any(first <= redis.keyslot(reading["key"]) <= last for first, last in ranges)
        }
        assert len(owners) >= 2
