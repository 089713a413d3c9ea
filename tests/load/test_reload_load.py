"""Reloads under load: a SIGHUP that lands in the middle of a flood on one key keeps
the count exact (the burst passes, no more, nothing fails open, no 5xx), in Redis
and in the in-process store, with one process and with two workers; a reload that
changes the flooded limit carries its bucket over, clamped to the new burst; ten
reloads in a burst leak no descriptors and no Redis connections; and a reload that
changes `store` keeps the store the process started with (a restart setting).

The reload is synchronised on real events: the upstream holds the first requests
it is sent until the gateway has logged the reload, and the last part of the flood
is only sent once it has, so requests are decided on both sides of it."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
from collections.abc import Callable

import aiohttp
import pytest
from aiohttp import web

from tests.gateway.test_cli import metric
from tests.processes import GatewayProcess, RedisServer, eventually, free_port
from tests.scrape import settled_decisions
from tests.upstream import serving

pytestmark = pytest.mark.timing  # measures time, load or memory: one such module runs at a time

RELOADED = "config reloaded from"
FLOOD = 600
HELD = 10  # requests the upstream holds until the reload is logged
LATE = 100  # requests sent only once it is


def flood_yaml(
    upstream: str, *, store: str | None, burst: int = 25, other_burst: int = 5, rate: str = "1/hour", extra: str = "",
    listen: str = "127.0.0.1:0", admin: str = "127.0.0.1:0",
) -> str:
    """`flood` on every path but /other, which `other` limits: a reload that changes
    only `other_burst` leaves `flood` as it was."""
    return (
        f"listen: {listen}\nadmin_listen: {admin}\n"
        + (f"store: {{url: '{store}'}}\n" if store else "")
        + extra
        + "limits:\n"
        f"  flood: {{rate: {rate}, burst: {burst}, key: header:X-API-Key, on_store_error: open}}\n"
        f"  other: {{rate: 1/hour, burst: {other_burst}, key: header:X-API-Key, on_store_error: open}}\n"
        "routes:\n"
        f"  - match: {{path: /other}}\n    upstream: {upstream}\n    limits: [other]\n"
        f"  - match: {{path: /}}\n    upstream: {upstream}\n    limits: [flood]\n"
    )


def reloads(gw: GatewayProcess) -> int:
    return sum(RELOADED in line for line in gw.stderr_lines)


class HoldingUpstream:
    """Answers 200; the first HELD requests wait until `released` is set, and the
    HELD-th calls `on_held` (which sends the SIGHUP) when it arrives."""

    def __init__(self) -> None:
        self.seen = 0
        self.released = asyncio.Event()
        self.on_held: Callable[[], None] = lambda: None

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        self.seen += 1
        if self.seen == HELD:
            self.on_held()
        if self.seen <= HELD:
            await self.released.wait()
        return web.Response(text="ok")


async def flood_across_a_reload(gw: GatewayProcess, upstream: HoldingUpstream, new_config: str, workers: int = 1):
    """FLOOD requests on one key, the config replaced by `new_config` and SIGHUP sent when
    the upstream has the HELD-th; the held ones are released, and the last LATE sent,
    once every worker has logged the reload. The statuses, by count."""
    before = reloads(gw)

    def sighup() -> None:
        gw.config_path.write_text(new_config)
        gw.signal(signal.SIGHUP)

    upstream.on_held = sighup
    reloaded = asyncio.Event()

    async def one(client: aiohttp.ClientSession) -> int | str:
        try:
            async with client.get(gw.url + "/", headers={"X-API-Key": "flooder"}) as response:
                await response.read()
                return response.status
        except aiohttp.ClientError as exc:
            return type(exc).__name__

    async def late(client: aiohttp.ClientSession) -> int | str:
        await reloaded.wait()
        return await one(client)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=FLOOD)) as client:
        tasks = [asyncio.create_task(one(client)) for _ in range(FLOOD - LATE)]
        tasks += [asyncio.create_task(late(client)) for _ in range(LATE)]
        await eventually(lambda: reloads(gw) == before + workers, what="every worker to reload")
        reloaded.set()
        upstream.released.set()
        statuses = await asyncio.gather(*tasks)
    return collections.Counter(statuses)


@contextlib.asynccontextmanager
async def holding_upstream():
    upstream = HoldingUpstream()
    async with serving(upstream.handle) as url:
        yield upstream, url


async def assert_exact_across_a_reload(store: str | None, *, workers: int = 1) -> None:
    extra = f"workers: {workers}\n" if workers > 1 else ""
    async with holding_upstream() as (upstream, url):
        # Workers share fixed ports.
        ports = {"listen": f"127.0.0.1:{free_port()}", "admin": f"127.0.0.1:{free_port()}"} if workers > 1 else {}
        config = flood_yaml(url, store=store, extra=extra, **ports)
        with GatewayProcess(config) as gw:
            await eventually(lambda: sum("listening on" in line for line in gw.stderr_lines) == workers, what="workers")
            statuses = await flood_across_a_reload(gw, upstream, config.replace("burst: 5", "burst: 6"), workers)
            async with aiohttp.ClientSession() as http:
                counts = await settled_decisions(http, gw.admin_url)
                failures = await metric(http, gw.admin_url, "gateway_config_reload_failures_total")
            assert gw.process.poll() is None
    assert statuses == {200: 25, 429: FLOOD - 25}, statuses
    assert upstream.seen == 25
    assert counts["flood", "allow"] == 25 and counts["flood", "fail_open"] == 0
    assert failures == 0


async def test_a_reload_mid_flood_keeps_the_redis_count_exact():
    with RedisServer(dedicated=True) as redis:
        await assert_exact_across_a_reload(redis.url)


async def test_a_reload_mid_flood_keeps_the_redis_count_exact_with_two_workers():
    with RedisServer(dedicated=True) as redis:
        await assert_exact_across_a_reload(redis.url, workers=2)


async def test_a_reload_mid_flood_keeps_the_in_process_count_exact():
    await assert_exact_across_a_reload(None)




async def burst_of(gw: GatewayProcess, key: str, requests: int, path: str = "/") -> collections.Counter:
    """`requests` sent at once on `key`: the statuses, by count."""

    async def one(client: aiohttp.ClientSession) -> int:
        async with client.get(gw.url + path, headers={"X-API-Key": key}) as response:
            await response.read()
            return response.status

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=requests)) as client:
        return collections.Counter(await asyncio.gather(*(one(client) for _ in range(requests))))


async def reload_to(gw: GatewayProcess, text: str) -> None:
    before = reloads(gw)
    gw.config_path.write_text(text)
    gw.signal(signal.SIGHUP)
    await eventually(lambda: reloads(gw) > before, what="the reload")


async def test_a_reload_that_lowers_the_burst_carries_each_bucket_over_clamped_to_the_new_one(upstream):
    """burst 25 -> 10, in Redis and in the in-process store: a bucket keeps its tokens,
    only clamped to the new burst. A client that had taken 20 gets its 5 left, not a
    fresh 10; one that had taken 5 gets 10, not its 20 left. Raised back to 25, the
    burst does not refill an empty bucket: it is a ceiling, not a grant."""
    with RedisServer(dedicated=True) as redis:
        for store in (redis.url, None):
            config = flood_yaml(upstream, store=store)
            with GatewayProcess(config) as gw:
                assert await burst_of(gw, "heavy", 20) == {200: 20}
                assert await burst_of(gw, "light", 5) == {200: 5}
                await reload_to(gw, config.replace("burst: 25", "burst: 10"))
                heavy, light = await asyncio.gather(burst_of(gw, "heavy", 200), burst_of(gw, "light", 200))
                assert (heavy, light) == ({200: 5, 429: 195}, {200: 10, 429: 190}), store
                await reload_to(gw, config)
                assert await burst_of(gw, "heavy", 50) == {429: 50}, store


def open_fds(gw: GatewayProcess, upstream: str) -> int:
    """The gateway's open descriptors, less its clients' connections (which close as the
    gateway gets round to it) and its keep-alive pool to `upstream` (which grows with the
    most requests passed at once): the listeners, the store's connections, files and
    the event loop's own."""
    assert gw.process is not None
    public, pooled = (f":{int(url.rsplit(':', 1)[1]):04X}" for url in (gw.url, upstream))
    with open(f"/proc/{gw.process.pid}/net/tcp") as table:
        rows = [line.split() for line in table.readlines()[1:]]
    # Columns: sl, local address, remote address, state (0A: LISTEN), ..., inode.
    passing = {
        f"socket:[{row[9]}]" for row in rows if (row[1].endswith(public) and row[3] != "0A") or row[2].endswith(pooled)
    }
    links = []
    for fd in os.listdir(f"/proc/{gw.process.pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            links.append(os.readlink(f"/proc/{gw.process.pid}/fd/{fd}"))
    return sum(link not in passing for link in links)


def redis_clients(redis: RedisServer) -> int:
    """Connections to `redis`, this helper's own one not counted."""
    return len(redis.client().client_list()) - 1


async def test_ten_reloads_in_a_burst_under_load_leak_nothing_and_the_last_config_serves(upstream):
    with RedisServer(dedicated=True) as redis:
        configs = [flood_yaml(upstream, store=redis.url, other_burst=b) for b in (5, 6)]
        with GatewayProcess(configs[0]) as gw:
            assert await burst_of(gw, "warm", 50) == {200: 25, 429: 25}  # every connection the load needs, opened
            fds, clients = open_fds(gw, upstream), redis_clients(redis)
            async with aiohttp.ClientSession() as http:
                first = await metric(http, gw.admin_url, "gateway_config_last_reload_success_timestamp")
                load = asyncio.create_task(burst_of(gw, "loaded", FLOOD))
                for i in range(10):
                    # Replaced whole, never rewritten in place: a reload still reading the file
                    # from the previous signal would otherwise find it truncated ("the file is
                    # empty") and count a failure, about one run in two.
                    staged = gw.config_path.with_suffix(".staged")
                    staged.write_text(configs[i % 2])
                    os.replace(staged, gw.config_path)
                    gw.signal(signal.SIGHUP)
                    await asyncio.sleep(0)  # let the load's requests go out between signals
                assert await load == {200: 25, 429: FLOOD - 25}
                # Signals sent closer than the gateway takes them may count as one: wait for the last.

                async def last_config_serves() -> bool:
                    async with http.get(gw.admin_url + "/config") as response:
                        other = (await response.json())["config"]["limits"]["other"]
                    return other["burst"] == 6

                await eventually(last_config_serves, what="the last config to serve")
                assert await burst_of(gw, "other-client", 10, "/other") == {200: 6, 429: 4}
                assert await metric(http, gw.admin_url, "gateway_config_last_reload_success_timestamp") > first
                assert await metric(http, gw.admin_url, "gateway_config_reload_failures_total") == 0
            assert gw.process.poll() is None
            assert sum("Traceback" in line or "ERROR" in line for line in gw.stderr_lines) == 0, gw.stderr_lines
            assert open_fds(gw, upstream) == fds and redis_clients(redis) == clients


async def test_a_reload_that_changes_the_store_keeps_the_old_one_until_a_restart(upstream):
    """`store` is a restart setting: a reload that names another Redis, or none, says so
    in a warning and counts on in the store the process started with, its connections
    kept; the other Redis is never connected to."""
    with RedisServer(dedicated=True) as old, RedisServer() as new:
        config = flood_yaml(upstream, store=old.url)
        with GatewayProcess(config) as gw:
            assert await burst_of(gw, "client", 20) == {200: 20}
            clients = redis_clients(old)
            for changed in (flood_yaml(upstream, store=new.url), flood_yaml(upstream, store=None)):
                await reload_to(gw, changed.replace("burst: 5", "burst: 7"))
                assert await burst_of(gw, "client", 2) == {200: 2}
            await eventually(
                lambda: sum("take effect only at restart: store" in line for line in gw.stderr_lines) == 2,
                what="a warning for each reload",
            )
            assert await burst_of(gw, "client", 100) == {200: 1, 429: 99}
            assert redis_clients(old) == clients and redis_clients(new) == 0
            assert new.client().dbsize() == 0
