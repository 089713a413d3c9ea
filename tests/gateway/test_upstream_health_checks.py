"""Active health checks on the upstream package's own HTTP/1.1 client, against real
aiohttp upstreams on free ports (plain and, with a trustme CA, TLS).

What the tests prove:
- a check is a GET of the health path under the URL's base path, with the URL's Host and
  credentials and no header lines of its own;
- a 2xx passes; a 503, an upstream that never answers, a refused connection and an
  untrusted certificate fail, each with the reason the log gives (`status 503`,
  `no answer within 0.2s`, `cannot connect: ...`);
- a check's body is drained, so the next check reuses its connection; a body past
  DRAIN_BYTES, or one that does not end within the timeout, closes it instead, and the
  check still passes on its status;
- `HealthChecks` reads a target through the small CheckedTarget protocol (its URL, name
  and TargetState: no route plan), moves the target out of rotation and back with a log
  line naming the last failure, and closes its connections when it stops;
- the package runs without aiohttp loaded, and import-linter refuses a module of it that
  imports aiohttp.

Nothing is mocked; the tests wait on what the upstream or the gauge shows (`eventually`)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import shutil
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme
from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge

from gateway.config.pool_model import HealthCheck
from gateway.upstream.balancing import TargetState
from gateway.upstream.client import UpstreamClient
from gateway.upstream.health_checks import DRAIN_BYTES, HealthChecks, probe
from tests.processes import eventually, free_port

ROOT = Path(__file__).resolve().parents[2]
# Short enough that the hanging upstream's check ends soon; a loaded machine that misses
# it only turns a pass into a failure, which the tests of passes would show as such.
TIMEOUT = 0.2


def check(path: str = "/healthz", *, timeout: float = TIMEOUT, interval: float = TIMEOUT) -> HealthCheck:
    return HealthCheck(path=path, interval=interval, timeout=timeout, unhealthy_after=1, healthy_after=1)


@dataclass
class Seen:
    """A request as the upstream saw it."""

    path: str  # with the query
    headers: list[tuple[str, str]]
    port: int  # the client's port: the same one for a reused connection


Answer = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


class HealthUpstream:
    """Answers every request with `answer` (200 "ok" at first) and records it. Answers
    that hang wait for `release`, which the context manager sets when it ends."""

    def __init__(self) -> None:
        self.url = ""
        self.seen: list[Seen] = []
        self.transports: list[asyncio.BaseTransport] = []
        self.release = asyncio.Event()
        self.answer: Answer = self.status(200)

    def status(self, code: int, body: bytes = b"ok") -> Answer:
        async def answer(_: web.BaseRequest) -> web.StreamResponse:
            return web.Response(status=code, body=body)

        return answer

    async def hang(self, _: web.BaseRequest) -> web.StreamResponse:
        await self.release.wait()
        return web.Response(text="late")

    async def paced(self, request: web.BaseRequest) -> web.StreamResponse:
        """A 200 whose chunked body comes in two writes, the second a moment after the head,
        as a slow health endpoint's would: reused, its connection shows the body was read."""
        response = web.StreamResponse(status=200)
        await response.prepare(request)
        await response.write(b"checking")
        await asyncio.sleep(0.05)
        await response.write(b", ok")
        await response.write_eof()
        return response

    async def endless(self, request: web.BaseRequest) -> web.StreamResponse:
        """A 200 whose chunked body starts and then never ends."""
        response = web.StreamResponse(status=200)
        await response.prepare(request)
        await response.write(b"still going")
        await self.release.wait()
        return response

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        assert request.transport is not None
        self.seen.append(Seen(request.raw_path, list(request.headers.items()), request.transport.get_extra_info("peername")[1]))
        self.transports.append(request.transport)
        return await self.answer(request)


@contextlib.asynccontextmanager
async def health_upstream(tls: ssl.SSLContext | None = None) -> AsyncIterator[HealthUpstream]:
    upstream = HealthUpstream()
    runner = web.ServerRunner(web.Server(upstream.handle), access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls).start()
    port = runner.addresses[0][1]
    upstream.url = f"https://localhost:{port}" if tls is not None else f"http://127.0.0.1:{port}"
    try:
        yield upstream
    finally:
        upstream.release.set()
        await runner.cleanup()


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def server_tls(ca: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(context)
    return context


def trusting(ca: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return context


# One check at a time


async def test_a_check_is_a_get_of_the_path_under_the_base_path_with_the_urls_host_and_credentials() -> None:
    async with health_upstream() as upstream:
        authority = upstream.url.removeprefix("http://")
        with contextlib.closing(UpstreamClient(f"http://alice:s%3Acret@{authority}/base/", None)) as client:
            assert await probe(client, check("/healthz?full=1")) is None
    credentials = base64.b64encode(b"alice:s:cret").decode()
    assert [(s.path, s.headers) for s in upstream.seen] == [
        ("/base/healthz?full=1", [("Host", authority), ("Authorization", f"Basic {credentials}")])
    ]


async def test_a_2xx_passes_and_any_other_status_fails_with_it_the_connection_kept_for_the_next() -> None:
    async with health_upstream() as upstream:
        with contextlib.closing(UpstreamClient(upstream.url, None)) as client:
            results = []
            for answer in (upstream.status(200), upstream.paced, upstream.status(204, b""), upstream.status(503, b"down"), upstream.status(301)):
                upstream.answer = answer
                results.append(await probe(client, check(timeout=10.0)))
    assert results == [None, None, None, "status 503", "status 301"]
    # Each answer's body was read to its end: one connection served every check.
    assert len({s.port for s in upstream.seen}) == 1, upstream.seen


async def test_an_upstream_that_never_answers_fails_within_the_timeout_and_its_connection_is_closed() -> None:
    async with health_upstream() as upstream:
        with contextlib.closing(UpstreamClient(upstream.url, None)) as client:
            upstream.answer = upstream.hang
            hung = await probe(client, check())
            upstream.answer = upstream.status(200)
            passed = await probe(client, check(timeout=10.0))
    assert (hung, passed) == (f"no answer within {TIMEOUT:g}s", None)
    assert len({s.port for s in upstream.seen}) == 2  # the hung connection was not reused


async def test_a_refused_connection_fails_with_the_reason() -> None:
    with contextlib.closing(UpstreamClient(f"http://127.0.0.1:{free_port()}", None)) as client:
        failure = await probe(client, check(timeout=10.0))
    assert failure is not None and failure.startswith("cannot connect: Connect call failed"), failure


async def test_a_body_past_the_drain_bound_passes_and_closes_its_connection() -> None:
    async with health_upstream() as upstream:
        with contextlib.closing(UpstreamClient(upstream.url, None)) as client:
            upstream.answer = upstream.status(200, b"x" * (4 * DRAIN_BYTES))
            first = await probe(client, check(timeout=10.0))
            upstream.answer = upstream.status(200)
            second = await probe(client, check(timeout=10.0))
            third = await probe(client, check(timeout=10.0))
    assert (first, second, third) == (None, None, None)
    first_port, second_port, third_port = (s.port for s in upstream.seen)
    assert first_port != second_port == third_port


async def test_a_body_that_does_not_end_within_the_timeout_passes_and_closes_its_connection() -> None:
    async with health_upstream() as upstream:
        with contextlib.closing(UpstreamClient(upstream.url, None)) as client:
            upstream.answer = upstream.endless
            endless = await probe(client, check())
            upstream.answer = upstream.status(200)
            after = await probe(client, check(timeout=10.0))
    assert (endless, after) == (None, None)
    assert len({s.port for s in upstream.seen}) == 2


async def test_an_https_target_is_checked_over_tls_and_an_untrusted_certificate_fails(ca: trustme.CA) -> None:
    async with health_upstream(server_tls(ca)) as upstream:
        with contextlib.closing(UpstreamClient(upstream.url, trusting(ca))) as client:
            trusted = await probe(client, check(timeout=10.0))
        with contextlib.closing(UpstreamClient(upstream.url, ssl.create_default_context())) as client:
            untrusted = await probe(client, check(timeout=10.0))
    assert trusted is None
    assert untrusted is not None and untrusted.startswith("cannot connect: [SSL: CERTIFICATE_VERIFY_FAILED]"), untrusted
    assert [s.path for s in upstream.seen] == ["/healthz"]  # the untrusted handshake sent nothing


# The background checks


@dataclass(frozen=True)
class Target:
    """A pool target as the checks read it (gateway.upstream.health_checks.CheckedTarget)."""

    url: str
    name: str
    state: TargetState


def healthy_gauge() -> tuple[Gauge, CollectorRegistry]:
    registry = CollectorRegistry()
    return Gauge("healthy", "a target's health", ["target"], registry=registry), registry


def gauge_reads(registry: CollectorRegistry, name: str, value: float) -> Callable[[], bool]:
    return lambda: registry.get_sample_value("healthy", {"target": name}) == value


@pytest.mark.parametrize("scheme", ["http", "https"])
async def test_checks_take_a_target_out_of_rotation_and_back_with_the_last_failure_logged(
    scheme: str, ca: trustme.CA, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="gateway.upstream.health_checks")
    client_tls = trusting(ca)
    asked: list[str] = []

    def tls(url: str) -> ssl.SSLContext | None:
        asked.append(url)
        return client_tls if url.startswith("https:") else None

    (gauge, registry), shown = healthy_gauge(), []
    async with health_upstream(server_tls(ca) if scheme == "https" else None) as upstream:
        # Long enough that a loaded machine answers each check in time: the log must name the 503.
        target = Target(upstream.url, "t", TargetState(None, check(timeout=0.5, interval=0.5)))
        checks = HealthChecks(gauge, shown.append, tls)
        try:
            checks.update([target, Target("http://127.0.0.1:1", "unchecked", TargetState(None, None))])
            await eventually(lambda: len(upstream.seen) >= 1, what="a first check")
            assert target.state.healthy
            upstream.answer = upstream.status(503)
            await eventually(gauge_reads(registry, "t", 0), what="the target out of rotation")
            assert not target.state.healthy
            upstream.answer = upstream.status(200)
            await eventually(gauge_reads(registry, "t", 1), what="the target back in rotation")
        finally:
            await checks.close()
    assert shown == [frozenset({"t"})]
    assert asked == [upstream.url]
    messages = [r.getMessage() for r in caplog.records]
    assert "upstream target t is out of rotation: health checks fail (the last: status 503)" in messages
    assert "upstream target t is back in rotation: health checks pass" in messages


async def test_close_stops_the_checks_and_closes_their_connections() -> None:
    gauge, _ = healthy_gauge()
    async with health_upstream() as hanging, health_upstream() as answering:
        hanging.answer = hanging.hang
        checks = HealthChecks(gauge, lambda _: None, lambda _: None)
        checks.update(
            [Target(u.url, u.url, TargetState(None, check(timeout=60.0, interval=60.0))) for u in (hanging, answering)]
        )
        # One check under way, the other done with its connection kept idle.
        await eventually(lambda: len(hanging.seen) == len(answering.seen) == 1, what="both checked")
        await checks.close()
        assert [t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "HealthChecks._run"] == []
        await eventually(lambda: hanging.transports[0].is_closing(), what="the connection of the check under way closed")
        await eventually(lambda: answering.transports[0].is_closing(), what="the idle connection closed")


# The package's boundary


def test_the_upstream_package_runs_without_aiohttp() -> None:
    modules = ["body", "client", "connection", "slots", "balancing", "health_checks", "errors"]
    imports = "; ".join(f"import gateway.upstream.{m}" for m in modules)
    script = f"import sys; {imports}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'aiohttp'))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, check=True)
    assert result.stdout.strip() == "[]", result.stdout


def test_lint_imports_refuses_a_module_of_the_package_that_imports_aiohttp(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "gateway", tmp_path / "gateway")
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    slots = tmp_path / "gateway" / "upstream" / "slots.py"
    slots.write_text(slots.read_text().replace("import asyncio\n", "import asyncio\n\nfrom aiohttp import web\n", 1))
    lint = str(Path(sys.executable).parent / "lint-imports")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([lint, "--no-cache"], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert result.returncode != 0
    assert "gateway.upstream is not allowed to import aiohttp" in result.stdout
    assert "gateway.upstream.slots -> aiohttp" in result.stdout
