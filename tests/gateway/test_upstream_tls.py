"""https:// upstreams, served here by a real aiohttp app on a certificate from a
trustme CA the system does not trust: verification is on, a private CA is trusted
through SSL_CERT_FILE, SNI and Host name the upstream, a Location naming it is
rewritten, and WebSockets (wss://) and health checks go over TLS too."""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator

import aiohttp
import pytest
import trustme
from aiohttp import web

from tests.processes import GatewayProcess, eventually
from tests.upstream import upstream_app


@pytest.fixture(scope="module")
def ca():
    return trustme.CA()


@contextlib.asynccontextmanager
async def https_upstream(ca) -> AsyncIterator[tuple[str, list[str | None], list[str]]]:
    """The upstream app over TLS as https://localhost:PORT, the SNI names its handshakes
    carried, and the paths it was asked for."""
    names: list[str | None] = []
    paths: list[str] = []
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(context)
    context.sni_callback = lambda _tls, name, _context: names.append(name)

    @web.middleware
    async def record(request: web.Request, handler):
        paths.append(request.path)
        return await handler(request)

    app = upstream_app()
    app.middlewares.append(record)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context).start()
    try:
        yield f"https://localhost:{runner.addresses[0][1]}", names, paths
    finally:
        await runner.cleanup()


def config(upstream: str) -> str:
    return f"""
admin_listen: 127.0.0.1:0
routes:
  - match: {{path: /checked}}
    strip_prefix: true
    upstream:
      targets: [{{url: "{upstream}", name: tls-target}}]
      health: {{path: /status/200, interval: 100ms, timeout: 100ms, unhealthy_after: 1, healthy_after: 1}}
  - match: {{path: /}}
    upstream: {upstream}
"""


async def healthy(session: aiohttp.ClientSession, gw: GatewayProcess) -> str | None:
    async with session.get(gw.admin_url + "/metrics") as response:
        text = await response.text()
    lines = [line for line in text.splitlines() if line.startswith('gateway_upstream_target_healthy{target="tls-target"}')]
    return lines[0].split()[-1] if lines else None


async def test_an_upstream_certificate_no_trusted_ca_signed_is_a_502_with_the_reason_logged(ca):
    async with https_upstream(ca) as (upstream, _, _), aiohttp.ClientSession() as session:
        with GatewayProcess(config(upstream)) as gw:
            async with session.get(gw.url + "/echo") as response:
                status = response.status
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await session.ws_connect(gw.url + "/ws")
            await eventually(lambda: _equals(healthy(session, gw), "0.0"), what="the failing health check")
            # Lines reach stderr_lines through a reader thread: wait for them, not for a moment.
            expected = (
                f"cannot connect to upstream {upstream}: [SSL: CERTIFICATE_VERIFY_FAILED]",
                f"cannot open a WebSocket to upstream {upstream}: [SSL: CERTIFICATE_VERIFY_FAILED]",
                "tls-target is out of rotation: health checks fail (the last: cannot connect: [SSL: CERTIFICATE_VERIFY_FAILED]",
            )
            await eventually(lambda: all(line in "".join(gw.stderr_lines) for line in expected), what="the log lines")
            log = "".join(gw.stderr_lines)
    assert status == refused.value.status == 502
    assert "Traceback" not in log


async def test_ssl_cert_file_trusts_a_private_ca_for_https_upstreams(ca, tmp_path):
    bundle = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    async with https_upstream(ca) as (upstream, names, paths), aiohttp.ClientSession() as session:
        with GatewayProcess(config(upstream), env={"SSL_CERT_FILE": str(bundle)}) as gw:
            async with session.get(gw.url + "/echo", headers={"Host": "api.example.com"}) as response:
                assert response.status == 200
                echo = await response.json()
            async with session.get(
                gw.url + "/location", params={"value": "{self}/login"}, headers={"Host": "api.example.com"},
                allow_redirects=False,
            ) as response:
                location = response.headers["Location"]
            async with session.ws_connect(gw.url + "/ws") as ws:  # wss:// to the upstream
                await ws.send_str("hi")
                reply = await ws.receive_str()
            await eventually(lambda: "/status/200" in paths, what="a health check over TLS")
            gauge = await healthy(session, gw)
    assert names and set(names) == {"localhost"}
    assert ["Host", upstream.removeprefix("https://")] in echo["headers"]
    assert location == "/login"  # the upstream's https address rewritten; a path, as the route names no host
    assert reply == "echo:hi"
    assert gauge == "1.0"


async def _equals(value, expected) -> bool:
    return await value == expected
