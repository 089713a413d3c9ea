"""Upstream pools end to end: real aiohttp targets that the tests stop and start, behind
the gateway as users run it (`python -m gateway run`), or in-process for the quick ones.
Distribution by weight, ejection and recovery, retries only where safe, 503 with no
target in rotation or no free connection to one, each counted exactly by route and
reason in gateway_upstream_unavailable_total, and the per-target metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
from aiohttp import web

from gateway.config import load_config
from gateway.testing import running_gateway
from tests.helpers import refused_handshake
from tests.processes import GatewayProcess, eventually, free_port
from tests.scrape import decisions, scrape, value
from tests.upstream import running_upstream

CHI_SQUARE_2DF_P001 = 13.816  # see tests/unit/test_upstream_pools.py


class Target:
    """A real aiohttp target on a port of its own, which a test stops and starts again on
    that port. It answers its name, counts every request by path, and has routes that fail:
    /healthz answers 503 while `healthy` is False, /drop reads the body and closes the
    connection without an answer, /cut sends its status line and 10 of 1000 bytes and closes
    the connection, and /held waits for `release`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.hits: Counter[str] = Counter()
        self.bodies: list[int] = []  # sizes of the request bodies received on /work
        self.healthy = True
        self.release = asyncio.Event()
        self._runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.hits[request.path] += 1
        if request.path == "/healthz":
            return web.Response(status=200 if self.healthy else 503)
        if request.path == "/held":
            await self.release.wait()
        body = await request.read()
        if request.path == "/drop":
            assert request.transport is not None
            request.transport.close()  # the body was read: the target may have acted on it
            return web.Response()
        if request.path == "/cut":
            response = web.StreamResponse()
            response.content_length = 1000
            await response.prepare(request)
            await response.write(b"x" * 10)
            assert request.transport is not None
            request.transport.close()  # 10 of its 1000 bytes sent: the response is cut off
            return response
        self.bodies.append(len(body))
        return web.Response(text=self.name)

    async def start(self) -> Target:
        app = web.Application(client_max_size=1 << 24)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


@contextlib.asynccontextmanager
async def targets(*names: str) -> AsyncIterator[list[Target]]:
    started = [await Target(name).start() for name in names]
    try:
        yield started
    finally:
        for target in started:
            await target.stop()


@contextlib.contextmanager
def unanswered_port() -> Iterator[int]:
    """A port that never completes a connection: its listen queue is full, so the kernel
    drops further SYNs and a connect waits until it times out, like a host that is gone."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    fillers = []
    try:
        while True:  # fill the queue until a connect no longer completes
            filler = socket.socket()
            fillers.append(filler)
            filler.settimeout(0.2)
            try:
                filler.connect(("127.0.0.1", port))
            except TimeoutError:
                break
        yield port
    finally:
        for filler in fillers:
            filler.close()
        server.close()


@contextlib.asynccontextmanager
async def gateway_process(config: str) -> AsyncIterator[GatewayProcess]:
    """The gateway CLI, started and stopped off the event loop, which serves the targets."""
    gateway = GatewayProcess(config)
    await asyncio.to_thread(gateway.start)
    try:
        yield gateway
    finally:
        await asyncio.to_thread(gateway.__exit__)


def pool_config(pool: str, *, limits: str = "", route_extra: str = "") -> str:
    indented = "".join(f"      {line}\n" for line in pool.strip().splitlines())
    return (
        "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\n" + limits
        + f"routes:\n  - match: {{path: /}}\n    upstream:\n{indented}{route_extra}"
    )


async def metric(client: aiohttp.ClientSession, admin_url: str, name: str, **labels: str) -> float:
    return value((await scrape(client, admin_url))[1], name, **labels)


def healthy_is(client: aiohttp.ClientSession, admin_url: str, target: str, expected: int):
    """A predicate for `eventually`: the target's health gauge reads `expected`."""

    async def check() -> bool:
        return await metric(client, admin_url, "gateway_upstream_target_healthy", target=target) == expected

    return check


async def test_smooth_round_robin_spreads_requests_exactly_by_weight(client):
    async with targets("a", "b", "c") as (a, b, c):
        config = pool_config(
            f"targets: [{{url: {a.url}, name: a}}, {{url: {b.url}, weight: 2, name: b}}, {{url: {c.url}, weight: 3, name: c}}]"
        )
        async with gateway_process(config) as gateway:
            answered = Counter()
            for _ in range(600):
                async with client.get(gateway.url + "/work") as response:
                    assert response.status == 200
                    answered[await response.text()] += 1
            # Sequential requests in one worker: every cycle of 6 is exact.
            assert answered == {"a": 100, "b": 200, "c": 300}
            assert (a.hits["/work"], b.hits["/work"], c.hits["/work"]) == (100, 200, 300)
            samples = (await scrape(client, gateway.admin_url))[1]
            for target, count in (("a", 100), ("b", 200), ("c", 300)):
                assert value(samples, "gateway_upstream_target_requests_total", target=target) == count
                assert value(samples, "gateway_upstream_target_latency_seconds_count", target=target) == count


async def test_random_two_choices_spreads_requests_by_weight_within_chi_square_bounds(client):
    async with targets("a", "b", "c") as (a, b, c):
        config = pool_config(
            f"targets: [{a.url}, {{url: {b.url}, weight: 2}}, {{url: {c.url}, weight: 3}}]\nbalance: random_two_choices"
        )
        async with running_gateway(config) as gateway:
            total = 1200
            answered = Counter()
            for _ in range(total):
                async with client.get(gateway.url + "/work") as response:
                    answered[await response.text()] += 1
    expected = {"a": total / 6, "b": total * 2 / 6, "c": total * 3 / 6}
    statistic = sum((answered[name] - e) ** 2 / e for name, e in expected.items())
    assert statistic < CHI_SQUARE_2DF_P001, answered


async def test_least_requests_sends_to_the_idle_target_while_one_is_busy(client):
    async with targets("a", "b") as (a, b):
        config = pool_config(f"targets: [{a.url}, {b.url}]\nbalance: least_requests")
        async with running_gateway(config) as gateway:
            held = asyncio.ensure_future(client.get(gateway.url + "/held"))  # the first pick: a
            await eventually(lambda: a.hits["/held"] == 1, what="a request held on a")
            for _ in range(20):
                async with client.get(gateway.url + "/work") as response:
                    assert await response.text() == "b"
            a.release.set()
            async with await held as response:
                assert await response.text() == "a"
            answered = Counter()
            for _ in range(20):  # both idle again: turns by weight
                async with client.get(gateway.url + "/work") as response:
                    answered[await response.text()] += 1
            assert answered == {"a": 10, "b": 10}


async def test_a_killed_target_is_ejected_and_rejoins_once_its_health_checks_pass(client):
    async with targets("a", "b", "c") as (a, b, c):
        config = pool_config(
            f"targets: [{{url: {a.url}, name: a}}, {{url: {b.url}, name: b}}, {{url: {c.url}, name: c}}]\n"
            "health: {path: /healthz, interval: 100ms, timeout: 100ms, unhealthy_after: 2, healthy_after: 2}\n"
            "passive: {eject_after: 2, eject_for: 60s}\nretries: 2"
        )
        async with gateway_process(config) as gateway:
            statuses: Counter[int] = Counter()
            answered: Counter[str] = Counter()
            stop = asyncio.Event()
            workers = 4

            async def load() -> None:
                while not stop.is_set():
                    async with client.get(gateway.url + "/work") as response:
                        statuses[response.status] += 1
                        answered[await response.text()] += 1

            tasks = [asyncio.ensure_future(load()) for _ in range(workers)]
            try:
                await eventually(lambda: min(answered[n] for n in "abc") >= 20, what="traffic on every target")
                await b.stop()
                await eventually(healthy_is(client, gateway.admin_url, "b", 0), what="the health checks to take b out")
                after_kill = answered["b"]
                served = sum(statuses.values())
                await eventually(lambda: sum(statuses.values()) >= served + 200, what="traffic without b")
                assert answered["b"] == after_kill  # no answer from b while it is down
                await b.start()
                await eventually(lambda: answered["b"] >= after_kill + 20, what="b to rejoin the rotation")
                assert await metric(client, gateway.admin_url, "gateway_upstream_target_healthy", target="b") == 1
            finally:
                stop.set()
                await asyncio.gather(*tasks)
            # Requests in flight on b when it stopped could fail; here it answers at once, and
            # connection failures are retried on a, c: so no client saw an error.
            assert set(statuses) == {200}, statuses
            assert await metric(client, gateway.admin_url, "gateway_upstream_target_healthy", target="a") == 1


async def test_a_connect_failure_is_retried_on_another_target_and_charged_once(client):
    dead_port = free_port()  # nothing listens: every connection is refused
    async with targets("live") as (live,):
        config = pool_config(
            f"targets: [{{url: 'http://127.0.0.1:{dead_port}', name: dead}}, {{url: {live.url}, name: live}}]\n"
            "passive: off\nretries: 1",
            limits="access_log: json\nlimits:\n  per_client: {rate: 1/hour, burst: 100}\n",
            route_extra="    limits: [per_client]\n",
        )
        async with gateway_process(config) as gateway:
            for i in range(10):
                async with client.get(gateway.url + f"/work?get={i}") as response:
                    assert response.status == 200 and await response.text() == "live"
                # Bigger than the 64 KiB read ahead, and chunked: it streams from the client.
                async def body() -> AsyncIterator[bytes]:
                    for _ in range(4):
                        yield b"x" * 50_000

                async with client.post(gateway.url + f"/work?post={i}", data=body()) as response:
                    assert response.status == 200 and await response.text() == "live"
                async with client.put(gateway.url + f"/work?put={i}", data=b"small") as response:
                    assert response.status == 200 and await response.text() == "live"
            assert live.hits["/work"] == 30 and Counter(live.bodies) == {0: 10, 200_000: 10, 5: 10}
            samples = (await scrape(client, gateway.admin_url))[1]
            # Round robin sends every other request to the dead target first: 15 connect failures,
            # each retried on the live one.
            assert value(samples, "gateway_upstream_target_errors_total", target="dead", kind="connect") == 15
            assert value(samples, "gateway_upstream_retries_total", route="/") == 15
            assert value(samples, "gateway_upstream_target_requests_total", target="live") == 30
            counts = await decisions(client, gateway.admin_url)
            assert counts["per_client", "allow"] == 30  # once per client request, never per attempt
        # One access line per client request, naming the target that answered, not the one retried from.
        lines = [json.loads(line) for line in gateway.stdout_lines]
        assert len(lines) == 30 and {line["upstream_target"] for line in lines} == {"live"}


async def test_a_connect_timeout_is_retried_on_another_target(client):
    async with targets("live") as (live,):
        with unanswered_port() as port:
            config = pool_config(
                f"targets: [{{url: 'http://127.0.0.1:{port}', name: gone}}, {{url: {live.url}, name: live}}]",
                route_extra="    timeout: {connect: 200ms}\n",
            )
            async with running_gateway(config) as gateway:
                async with client.get(gateway.url + "/work") as response:
                    assert response.status == 200 and await response.text() == "live"
                samples = (await scrape(client, gateway.admin_url))[1]
                assert value(samples, "gateway_upstream_target_errors_total", target="gone", kind="connect") == 1


async def test_timeout_total_bounds_retries(client):
    async with targets("live") as (live,):
        with unanswered_port() as port:
            pool = f"targets: [{{url: 'http://127.0.0.1:{port}', name: gone}}, {{url: {live.url}, name: live}}]\nretries: 3"
            config = pool_config(pool, route_extra="    timeout: {connect: 5s, total: 300ms}\n")
            async with running_gateway(config) as gateway:
                started = time.monotonic()
                async with client.get(gateway.url + "/work") as response:
                    assert response.status == 504
                    assert "total 0.3 s" in (await response.json())["detail"]
                assert time.monotonic() - started < 2.0  # the total, not the 5 s connect timeout
        assert live.hits["/work"] == 0  # no time was left for a retry


async def test_timeout_total_bounds_a_single_upstream_too(client, upstream):
    config = (
        "routes:\n  - match: {path: /}\n"
        f"    upstream: {upstream}\n    timeout: {{total: 200ms}}\n"
    )
    async with running_gateway(config) as gateway:
        async with client.get(gateway.url + "/slow?seconds=5") as response:
            assert response.status == 504


async def test_a_websocket_handshake_goes_to_a_pool_target(client):
    async with running_upstream() as upstream:
        async with running_gateway(pool_config(f"targets: [{upstream}]")) as gateway:
            async with client.ws_connect(gateway.url + "/ws") as ws:
                await ws.send_str("hi")
                assert (await ws.receive()).data == "echo:hi"


async def test_a_websocket_handshake_is_retried_after_a_connect_failure(client):
    """Reproduction: a handshake went to one target without retries or ejection counts, so
    with a dead target first in a pool of two, 2 of 4 handshakes got 502, and would for as
    long as it stayed dead. Now each refused connection goes on to the live target."""
    dead_port = free_port()
    async with running_upstream() as live:
        config = pool_config(f"targets: [{{url: 'http://127.0.0.1:{dead_port}', name: dead}}, {{url: {live}, name: live}}]\npassive: off")
        async with running_gateway(config) as gateway:
            for i in range(4):
                async with client.ws_connect(gateway.url + "/ws") as ws:
                    await ws.send_str(f"hi {i}")
                    assert (await ws.receive()).data == f"echo:hi {i}"
            samples = (await scrape(client, gateway.admin_url))[1]
            assert value(samples, "gateway_upstream_target_errors_total", target="dead", kind="connect") == 2
            assert value(samples, "gateway_upstream_retries_total", route="/") == 2
            assert value(samples, "gateway_upstream_target_requests_total", target="live") == 4


async def test_a_websocket_handshake_is_bounded_by_timeout_connect(client):
    """Reproduction: ws_connect took no timeout and the upstream's session had none, so a
    handshake to a host that never completes a connection was still waiting after 5 s with
    timeout.connect 200ms (an HTTP request there got its 504 in 0.2 s)."""
    async with running_upstream() as live:
        with unanswered_port() as port:
            single = f"routes:\n  - match: {{path: /}}\n    upstream: http://127.0.0.1:{port}\n    timeout: {{connect: 200ms}}\n"
            async with running_gateway(single) as gateway:
                started = time.monotonic()
                async with asyncio.timeout(5):
                    assert await refused_handshake(client, gateway.url + "/ws") == 504
                assert time.monotonic() - started < 2.0
            pool = pool_config(
                f"targets: [{{url: 'http://127.0.0.1:{port}', name: gone}}, {live}]",
                route_extra="    timeout: {connect: 200ms}\n",
            )
            async with running_gateway(pool) as gateway:
                async with asyncio.timeout(5), client.ws_connect(gateway.url + "/ws") as ws:
                    await ws.send_str("hi")
                    assert (await ws.receive()).data == "echo:hi"  # gone timed out; retried on live


async def test_a_post_whose_body_was_sent_is_not_retried(client):
    async with targets("dropper", "other") as (dropper, other):
        config = pool_config(f"targets: [{{url: {dropper.url}, name: dropper}}, {other.url}]\nretries: 2")
        async with running_gateway(config) as gateway:
            # A fresh pool's round robin starts with its first target.
            async with client.post(gateway.url + "/drop", data=b"order #1") as response:
                assert response.status == 502
                assert response.headers["Content-Type"].startswith("application/problem+json")
                problem = await response.json()
        assert problem["title"] == "Bad Gateway"
        assert dropper.hits["/drop"] == 1 and other.hits["/drop"] == 0


async def test_a_target_that_cuts_every_response_mid_body_is_ejected(client):
    """Reproduction: an attempt cut off mid-body counted as an answer (at its status line),
    which reset the failure count, and then as a failure: after 6 cut responses in a row
    with eject_after 2 the target had 6 errors of kind reset and no ejection."""
    async with targets("cutter") as (cutter,):
        config = pool_config(f"targets: [{{url: {cutter.url}, name: cutter}}]\npassive: {{eject_after: 2, eject_for: 60s}}")
        async with running_gateway(config) as gateway:
            for _ in range(2):
                async with client.get(gateway.url + "/cut") as response:
                    assert response.status == 200
                    try:
                        await response.read()
                    except aiohttp.ClientPayloadError:
                        pass
                    else:
                        raise AssertionError("a response cut off upstream reached the client whole")
            async with client.get(gateway.url + "/cut") as response:
                assert response.status == 503  # ejected: no target left in rotation
            samples = (await scrape(client, gateway.admin_url))[1]
            assert value(samples, "gateway_upstream_target_errors_total", target="cutter", kind="reset") == 2
            assert value(samples, "gateway_upstream_target_ejections_total", target="cutter") == 1
        assert cutter.hits["/cut"] == 2


async def test_no_target_in_rotation_is_503_problem_json(client):
    async with targets("a", "b") as (a, b):
        a.healthy = b.healthy = False
        config = pool_config(
            f"targets: [{{url: {a.url}, name: a}}, {{url: {b.url}, name: b}}]\n"
            "health: {path: /healthz, interval: 100ms, timeout: 100ms, unhealthy_after: 1, healthy_after: 1}"
        )
        async with running_gateway(config) as gateway:
            for name in "ab":
                await eventually(healthy_is(client, gateway.admin_url, name, 0), what=f"{name} out of rotation")
            async with client.get(gateway.url + "/work") as response:
                assert response.status == 503
                assert response.headers["Content-Type"].startswith("application/problem+json")
                assert response.headers["Retry-After"] == "1"
                problem = await response.json()
            assert problem["status"] == 503 and "No upstream target is in rotation" in problem["detail"]
            assert a.hits["/work"] == b.hits["/work"] == 0
            b.healthy = True
            await eventually(healthy_is(client, gateway.admin_url, "b", 1), what="b back")
            async with client.get(gateway.url + "/work") as response:
                assert response.status == 200 and await response.text() == "b"


async def test_targets_that_refuse_are_ejected_and_then_answered_with_503(client):
    ports = [free_port(), free_port()]
    config = pool_config(
        f"targets: [{{url: 'http://127.0.0.1:{ports[0]}', name: x}}, {{url: 'http://127.0.0.1:{ports[1]}', name: y}}]\n"
        "passive: {eject_after: 1, eject_for: 60s}\nretries: 1"
    )
    async with running_gateway(config) as gateway:
        async with client.get(gateway.url + "/work") as response:
            assert response.status == 502  # both tried, both refused
        async with client.get(gateway.url + "/work") as response:
            assert response.status == 503  # both ejected: nothing is tried
        samples = (await scrape(client, gateway.admin_url))[1]
        for name in "xy":
            assert value(samples, "gateway_upstream_target_ejections_total", target=name) == 1
            assert value(samples, "gateway_upstream_target_requests_total", target=name) == 1


def unavailable(samples, name: str = "gateway_upstream_unavailable_total") -> dict[tuple[str, str], float]:
    """gateway_upstream_unavailable_total by (route, reason): every series exported."""
    return {(s.labels["route"], s.labels["reason"]): s.value for s in samples if s.name == name}


async def test_each_503_for_want_of_a_target_is_counted_once_by_route_and_reason(client, upstream):
    """Both targets of /down's pool stopped and out of rotation: N requests and a WebSocket
    handshake get N + 1 503s, and gateway_upstream_unavailable_total{route="/down",
    reason="no_target"} reads exactly N + 1, as its 5xx in gateway_requests_total do. Before,
    with every target in rotation, every series the config knows reads 0; the others stay 0."""
    n = 25
    async with targets("a", "b") as (a, b):
        config = f"""\
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
routes:
  - match: {{path: /down}}
    upstream:
      targets: [{{url: "{a.url}", name: a}}, {{url: "{b.url}", name: b}}]
      health: {{path: /healthz, interval: 100ms, timeout: 100ms, unhealthy_after: 1, healthy_after: 1}}
  - match: {{path: /}}
    upstream: {upstream}
"""
        async with gateway_process(config) as gateway:
            for path in ("/down/work", "/down/work", "/echo"):
                async with client.get(gateway.url + path) as response:
                    assert response.status == 200
            # Known from the config, so exported at 0 before anything happens.
            assert unavailable((await scrape(client, gateway.admin_url))[1]) == {
                ("/down", "no_target"): 0, ("/down", "queue_full"): 0, ("/", "queue_full"): 0
            }
            await a.stop()
            await b.stop()
            for name in "ab":
                await eventually(healthy_is(client, gateway.admin_url, name, 0), what=f"{name} out of rotation")

            async def get(path: str) -> tuple[int, str]:
                async with client.get(gateway.url + path) as response:
                    return response.status, (await response.json())["detail"]

            answers = await asyncio.gather(*(get("/down/work") for _ in range(n)))
            assert answers == [(503, "No upstream target is in rotation; retry shortly.")] * n
            assert await refused_handshake(client, gateway.url + "/down/ws") == 503
            async with client.get(gateway.url + "/echo") as response:
                assert response.status == 200
            samples = (await scrape(client, gateway.admin_url))[1]
            assert unavailable(samples) == {("/down", "no_target"): n + 1, ("/down", "queue_full"): 0, ("/", "queue_full"): 0}
            assert value(samples, "gateway_requests_total", route="/down", status_class="5xx") == n + 1


async def test_a_full_queue_to_a_pool_target_is_503_counted_as_queue_full(client):
    """One upstream connection, held by a request on a's /held: each further request to the
    one-target pool waits timeout.queue for it and gets 503, counted once as queue_full."""
    n = 5
    async with targets("a") as (a,):
        config = "upstream_connections: 1\n" + pool_config(
            f"targets: [{{url: {a.url}, name: a}}]", route_extra="    timeout: {queue: 100ms}\n"
        )
        async with running_gateway(config) as gateway:
            held = asyncio.ensure_future(client.get(gateway.url + "/held"))
            await eventually(lambda: a.hits["/held"] == 1, what="a request held on a")

            async def status() -> int:
                async with client.get(gateway.url + "/work") as response:
                    return response.status

            assert await asyncio.gather(*(status() for _ in range(n))) == [503] * n
            a.release.set()
            async with await held as response:
                assert response.status == 200
            assert unavailable((await scrape(client, gateway.admin_url))[1]) == {("/", "queue_full"): n, ("/", "no_target"): 0}
            assert a.hits["/work"] == 0


def health_check_tasks() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "HealthChecks._run" and not t.done()]


async def test_a_reload_starts_and_stops_health_checks(client, tmp_path: Path):
    async with targets("a", "b") as (a, b):
        path = tmp_path / "gateway.yaml"
        health = "health: {path: /healthz, interval: 50ms, timeout: 50ms}"
        path.write_text(pool_config(f"targets: [{a.url}]\n{health}"))
        async with running_gateway(load_config(str(path))) as gateway:
            await eventually(lambda: a.hits["/healthz"] >= 2, what="a checked")
            assert b.hits["/healthz"] == 0
            path.write_text(pool_config(f"targets: [{b.url}]\n{health}"))
            assert gateway.gateway.reload()
            await eventually(lambda: b.hits["/healthz"] >= 2, what="b checked after the reload")
            assert len(health_check_tasks()) == 1  # a's was stopped
            checked = a.hits["/healthz"]
            await eventually(lambda: b.hits["/healthz"] >= 6, what="more checks of b")
            assert a.hits["/healthz"] <= checked + 1  # at most one check was under way
            async with client.get(gateway.url + "/work") as response:
                assert await response.text() == "b"
        assert health_check_tasks() == []  # the gateway's close stopped them


async def test_a_sighup_reload_keeps_pool_routes_serving(client):
    async with targets("a", "b") as (a, b):
        async with gateway_process(pool_config(f"targets: [{a.url}]")) as gateway:
            async with client.get(gateway.url + "/work") as response:
                assert await response.text() == "a"
            gateway.config_path.write_text(pool_config(f"targets: [{b.url}]"))
            gateway.signal(signal.SIGHUP)

            async def answered_by_b() -> bool:
                async with client.get(gateway.url + "/work") as response:
                    return await response.text() == "b"

            await eventually(answered_by_b, what="the reloaded pool")


async def test_routes_naming_the_same_target_share_its_ejection(client):
    dead_port = free_port()
    async with targets("live") as (live,):
        pool = f"{{targets: [{{url: 'http://127.0.0.1:{dead_port}', name: dead}}, {live.url}], passive: {{eject_after: 1}}}}"
        config = (
            f"routes:\n  - match: {{path: /a}}\n    upstream: {pool}\n"
            f"  - match: {{path: /b}}\n    upstream: {{targets: [{live.url}, {{url: 'http://127.0.0.1:{dead_port}', name: dead}}], "
            "balance: least_requests, passive: {eject_after: 1}}\n"
        )
        async with running_gateway(config) as gateway:
            async with client.get(gateway.url + "/a") as response:
                assert response.status == 200  # dead refused, retried on live, and ejected
            for _ in range(10):
                async with client.get(gateway.url + "/b") as response:
                    assert response.status == 200
            samples = (await scrape(client, gateway.admin_url))[1]
            assert value(samples, "gateway_upstream_target_ejections_total", target="dead") == 1
            assert value(samples, "gateway_upstream_target_requests_total", target="dead") == 1  # /b never tried it
            assert value(samples, "gateway_upstream_retries_total", route="/a") == 1
            assert value(samples, "gateway_upstream_retries_total", route="/b") == 0


async def test_the_admin_api_shows_a_pool_with_its_passwords_hidden(client):
    async with targets("a", "b") as (a, b):
        secret_url = a.url.replace("http://", "http://svc:hunter2@")
        config = pool_config(f"targets: [{{url: '{secret_url}', name: a}}, {b.url}]\nhealth: {{path: /healthz}}")
        async with running_gateway(config) as gateway:
            async with client.get(gateway.admin_url + "/config") as response:
                assert response.status == 200
                shown = await response.json()
            async with client.get(gateway.admin_url + "/stats") as response:
                assert response.status == 200
                stats = await response.json()
    pool = shown["config"]["routes"][0]["upstream"]
    assert [t["url"] for t in pool["targets"]] == [a.url.replace("http://", "http://svc:***@"), b.url]
    assert pool["balance"] == "round_robin" and pool["health"]["path"] == "/healthz"
    assert stats["routes"][0]["upstream"] == f"{a.url.replace('http://', 'http://svc:***@')}, {b.url}"
    assert "hunter2" not in str(shown) + str(stats)


async def test_a_reload_that_renames_a_checked_target_moves_its_health_gauge(client, tmp_path: Path):
    """Reproduction: the health check task was kept by URL with the plan it started with, so
    after a reload renamed the target (same URL and settings) it went on setting
    gateway_upstream_target_healthy under the old name, the new name never got the gauge, and
    /stats showed the renamed target as never checked (healthy: null)."""
    async with targets("a") as (a,):
        path = tmp_path / "gateway.yaml"
        health = "health: {path: /healthz, interval: 50ms, timeout: 50ms, unhealthy_after: 1}"
        path.write_text(pool_config(f"targets: [{{url: {a.url}, name: first}}]\n{health}"))
        async with running_gateway(load_config(str(path))) as gateway:
            await eventually(healthy_is(client, gateway.admin_url, "first", 1), what="first checked")
            a.healthy = False
            await eventually(healthy_is(client, gateway.admin_url, "first", 0), what="first out of rotation")
            path.write_text(pool_config(f"targets: [{{url: {a.url}, name: second}}]\n{health}"))
            assert gateway.gateway.reload()
            # The state is kept (still out), and the gauge follows the name.
            await eventually(healthy_is(client, gateway.admin_url, "second", 0), what="the gauge under the new name")
            _, samples = await scrape(client, gateway.admin_url)
            assert {s.labels["target"] for s in samples if s.name == "gateway_upstream_target_healthy"} == {"second"}
            async with client.get(gateway.url + "/work") as response:
                assert response.status == 503  # kept out of rotation across the rename
            async with client.get(gateway.admin_url + "/stats") as response:
                assert [(t["target"], t["healthy"]) for t in (await response.json())["targets"]] == [("second", 0)]
            a.healthy = True
            await eventually(healthy_is(client, gateway.admin_url, "second", 1), what="second back, under its name")
            assert len(health_check_tasks()) == 1


async def test_with_workers_a_target_a_reload_renamed_leaves_metrics(client, redis_server):
    """Reproduction: with several workers prometheus_client cannot remove a gauge's child, so
    after a reload renamed an unhealthy target /metrics showed it under both names,
    gateway_upstream_target_healthy{target="first"} 0 included, and GatewayUpstreamTargetUnhealthy
    would have fired for a name no longer configured until the next restart. The target's
    other families (requests, latency, errors, ejections) kept the old name too."""
    async with targets("a") as (a,):
        ports = f"listen: 127.0.0.1:{free_port()}\nadmin_listen: 127.0.0.1:{free_port()}\n"
        health = "health: {path: /healthz, interval: 50ms, timeout: 50ms, unhealthy_after: 1}"

        def config(name: str) -> str:
            pool = pool_config(f"targets: [{{url: {a.url}, name: {name}}}]\n{health}")
            return f"workers: 2\nstore: {{url: '{redis_server.url}'}}\n" + pool.replace(
                "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\n", ports
            )

        async def gauges() -> dict[str, float]:
            _, samples = await scrape(client, gateway.admin_url)
            return {s.labels["target"]: s.value for s in samples if s.name == "gateway_upstream_target_healthy"}

        def gauges_are(expected: dict[str, float]):
            async def check() -> bool:
                return await gauges() == expected

            return check

        async with gateway_process(config("first")) as gateway:
            await eventually(gauges_are({"first": 2}), what="first healthy in both workers")
            a.healthy = False
            await eventually(gauges_are({"first": 0}), what="first out of rotation in both")
            gateway.config_path.write_text(config("second"))
            gateway.signal(signal.SIGHUP)
            await eventually(lambda: sum("config reloaded" in line for line in gateway.stderr_lines) == 2, what="both reloaded")
            await eventually(gauges_are({"second": 0}), what="only the new name, out of rotation in both")
            # Nor do its other families keep the old name (each worker bound them at its start).
            _, samples = await scrape(client, gateway.admin_url)
            assert {s.labels["target"] for s in samples if s.name.startswith("gateway_upstream_target_")} == {"second"}
            a.healthy = True
            await eventually(gauges_are({"second": 2}), what="second healthy in both")


def replaced_target_pool(kept: str, i: int) -> str:
    """A pool of `kept` and a target, named t<i>, that nothing listens on and every reload replaces."""
    return pool_config(f"targets: [{{url: {kept}, name: kept}}, {{url: 'http://127.0.0.1:{free_port()}', name: t{i}}}]")


async def test_reloads_that_replace_a_target_leave_only_the_named_targets_on_metrics(upstream, tmp_path):
    """Reproduction: each target's children were bound when a config was compiled and never
    removed, so a fleet whose targets change on every deploy grew /metrics by a series set
    per target it ever had: 200 reloads that each replaced one target left 4,312 samples."""
    path = tmp_path / "gateway.yaml"
    path.write_text(replaced_target_pool(upstream, 0))
    async with running_gateway(load_config(str(path))) as gateway, aiohttp.ClientSession() as client:
        for i in range(1, 31):
            path.write_text(replaced_target_pool(upstream, i))
            assert gateway.gateway.reload()
            for _ in range(2):  # one of the two picks the dead target first: a connect error, then a retry
                async with client.get(gateway.url + "/echo") as response:
                    assert response.status == 200
        _, samples = await scrape(client, gateway.admin_url)
    named = {s.labels["target"] for s in samples if s.name.startswith("gateway_upstream_target_")}
    assert named == {"kept", "t30"}
    assert value(samples, "gateway_upstream_target_requests_total", target="kept") >= 30
