"""The decision listener and Envoy's rate-limit service through a process's life, as for the
proxy: a SIGHUP reload reaches both (and neither writes a log line per question), and a
SIGTERM drains them (new questions and RPCs are
refused at once, /readyz answers 503, a question in flight is answered before the exit).
The gateway runs as users start it, on its in-process store; a `mode: delay` limit holds
a question in flight for as long as its wait, so nothing here sleeps to synchronise.
"""

from __future__ import annotations

import asyncio
import signal
import socket
from pathlib import Path

import aiohttp
import pytest

from tests.processes import GatewayProcess, eventually, free_port
from tests.scrape import decisions

grpc = pytest.importorskip("grpc")  # the test extra has it; skipped only where it is truly missing

from gateway.envoy.generated import ratelimit_pb2, rls_pb2, rls_pb2_grpc  # noqa: E402

OK = rls_pb2.RateLimitResponse.Code.OK
OVER_LIMIT = rls_pb2.RateLimitResponse.Code.OVER_LIMIT
WAIT_SECONDS = 3  # the delayed question's wait: rate 20/minute, one token
RELOADED = "config reloaded from"


def rls_yaml(requests_per_unit: int) -> str:
    return f"""\
domain: life
descriptors:
  - key: client
    rate_limit: {{unit: hour, requests_per_unit: {requests_per_unit}}}
"""


def config(decision_port: int, rls_port: int, rls_dir: Path, *, limit: str = "per_key", burst: int = 1) -> str:
    return f"""\
decision_listen: 127.0.0.1:{decision_port}
trusted_proxies: [127.0.0.1/32]
rls_listen: 127.0.0.1:{rls_port}
rls_config: {rls_dir}
shutdown_grace: 30s
limits:
  {limit}: {{rate: 1/hour, burst: {burst}, key: header:X-API-Key}}
  paced: {{rate: 20/minute, burst: 1, mode: delay, max_delay: 10s, key: header:X-API-Key}}
routes:
  - match: {{path: /paced}}
    upstream: http://127.0.0.1:9
    limits: [paced]
  - match: {{path: /api}}
    upstream: http://127.0.0.1:9
    limits: [{limit}]
"""


class Beside:
    """A gateway with a decision listener and a rate-limit service, and how to ask both."""

    def __init__(self, tmp_path: Path) -> None:
        self.decision_port, self.rls_port = free_port(), free_port()
        self.rls_dir = tmp_path / "rls"
        self.rls_dir.mkdir()
        (self.rls_dir / "life.yaml").write_text(rls_yaml(2))
        self.gateway = GatewayProcess(config(self.decision_port, self.rls_port, self.rls_dir))

    async def ask(self, client: aiohttp.ClientSession, path: str, key: str = "k") -> aiohttp.ClientResponse:
        """Traefik's ForwardAuth question about GET `path` from API key `key`."""
        headers = {"X-Forwarded-Method": "GET", "X-Forwarded-Uri": path, "X-Forwarded-Host": "api", "X-API-Key": key}
        async with client.get(f"http://127.0.0.1:{self.decision_port}/decide/traefik", headers=headers) as response:
            await response.read()
            return response

    async def rpc(self, value: str) -> int:
        """One ShouldRateLimit on a channel of its own: its overall code."""
        entry = ratelimit_pb2.RateLimitDescriptor.Entry(key="client", value=value)
        request = rls_pb2.RateLimitRequest(domain="life", descriptors=[ratelimit_pb2.RateLimitDescriptor(entries=[entry])])
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.rls_port}") as channel:
            response = await rls_pb2_grpc.RateLimitServiceStub(channel).ShouldRateLimit(request, timeout=5)
        return response.overall_code


def count(gw: GatewayProcess, fragment: str) -> int:
    return sum(fragment in line for line in gw.stderr_lines)


async def test_a_sighup_reload_reaches_the_decision_listener_and_the_rate_limit_service(tmp_path):
    beside = Beside(tmp_path)
    with beside.gateway as gw:
        async with aiohttp.ClientSession() as client:
            assert [(await beside.ask(client, "/api")).status for _ in range(2)] == [200, 429]
            assert [await beside.rpc("a") for _ in range(3)] == [OK, OK, OVER_LIMIT]

            # A renamed limit with a burst of 3, and 4 an hour for Envoy's domain.
            (beside.rls_dir / "life.yaml").write_text(rls_yaml(4))
            gw.config_path.write_text(config(beside.decision_port, beside.rls_port, beside.rls_dir, limit="per_client", burst=3))
            before = count(gw, RELOADED)
            gw.signal(signal.SIGHUP)
            await eventually(lambda: count(gw, RELOADED) > before, what="the reload's log line")

            answers = [await beside.ask(client, "/api") for _ in range(4)]
            assert [a.status for a in answers] == [200, 200, 200, 429]
            assert answers[0].headers["RateLimit-Policy"].startswith('"per_client";q=3'), answers[0].headers
            assert [await beside.rpc("b") for _ in range(5)] == [OK] * 4 + [OVER_LIMIT]
    assert gw.process.returncode == 0
    # The proxy asking logs its requests; the gateway writes no line per question.
    assert not [line for line in gw.stderr_lines if "/decide/" in line]


def refuses_connections(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


async def test_sigterm_drains_the_decision_listener_and_the_rate_limit_service(tmp_path):
    beside = Beside(tmp_path)
    with beside.gateway as gw:
        async with aiohttp.ClientSession() as client:
            assert await beside.rpc("a") == OK
            assert (await beside.ask(client, "/paced")).status == 200
            # The same client's next question waits for the next token, in flight meanwhile.
            held = asyncio.create_task(beside.ask(client, "/paced"))

            async def delayed() -> bool:
                return (await decisions(client, gw.admin_url))["paced", "delayed"] == 1

            await eventually(delayed, what="the second question told to wait")
            assert not held.done()
            gw.signal(signal.SIGTERM)

            async def not_ready() -> bool:
                async with client.get(gw.admin_url + "/readyz") as response:
                    return response.status == 503

            await eventually(not_ready, what="/readyz to answer 503 while draining")
            await eventually(lambda: refuses_connections(beside.decision_port), what="the decision listener closed")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await beside.rpc("a")
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            # The drain waits for the question in flight, which is answered after its wait.
            assert gw.process.poll() is None
            answer = await held
            assert answer.status == 200
            assert answer.headers["RateLimit-Policy"].startswith('"paced"'), answer.headers
            code = await asyncio.to_thread(gw.wait, 30)
    assert code == 0
    assert count(gw, "draining in-flight requests") == 1
