"""Exposure, TLS and the parser: what is reachable from where, the
admin bearer token, TLS on the public listener with certificates made here by
trustme, llhttp in charge of parsing, and aiohttp at or above its last advisory.

The public listener serving no admin path is tested in tests/gateway/test_admin.py
(`test_admin_paths_*`): /metrics, /healthz and /readyz are proxied like any
path, or get the 404 of an unmatched path.

The tests that only connect to a TLS listener share one gateway process (`tls_gateway`);
a reload and another parser start their own."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import re
import signal
import ssl
from pathlib import Path

import aiohttp
import pytest
import trustme
from aiohttp import web
from cryptography.hazmat.primitives import serialization

from gateway.config import ConfigError, parse_config
from gateway.proxy.protocol import request_parser
from gateway.testing import config_from_yaml, running_gateway
from tests.processes import GatewayProcess, eventually, run_cli
from tests.raw_client import raw_exchange

ROUTE = "routes:\n  - match: {path: /}\n    upstream: http://127.0.0.1:9000\n"
TOKEN = "adm1n-t0ken-5f0c2e9a"


def parse(text: str, environ: dict[str, str] | None = None):
    return parse_config(text, source="gw.yaml", environ=environ or {})


def test_the_admin_listener_binds_to_loopback_by_default():
    config = parse(ROUTE)
    assert (config.admin_listen.host, config.admin_listen.port) == ("127.0.0.1", 9090)
    assert config.admin_token is None


# --- never a tunnel -------------------------------------------------------------------


@pytest.mark.parametrize("target", ["/api/x", "http://gw/api/x", "gw:443"])
async def test_connect_is_refused_whatever_its_target_form(target):
    """A CONNECT with an origin-form target used to be forwarded: the upstream's 2xx then
    turned the connection into a tunnel, and whatever followed went through unparsed."""
    seen: list[str] = []

    async def ok(request: web.BaseRequest) -> web.Response:
        seen.append(request.method)
        return web.Response(text="ok")

    runner = web.ServerRunner(web.Server(ok), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    config = f"routes:\n  - match: {{path: /}}\n    upstream: http://127.0.0.1:{runner.addresses[0][1]}\n"
    try:
        async with running_gateway(config) as gw:
            request = f"CONNECT {target} HTTP/1.1\r\nHost: gw\r\n\r\nGET /api/after HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n"
            status, _headers, body = await raw_exchange(gw.url, request.encode())
    finally:
        await runner.cleanup()
    assert status == 400, body
    assert json.loads(body)["status"] == 400
    assert "CONNECT" not in seen


# --- the admin bearer token ------------------------------------------------------------


def token_config(upstream: str) -> str:
    return f"admin_token_env: GW_ADMIN_TOKEN\nroutes:\n  - match: {{path: /}}\n    upstream: {upstream}\n"


@pytest.mark.parametrize(
    "authorization",
    [None, "", f"Bearer {TOKEN[:-1]}x", f"Bearer {TOKEN}x", f"bearer {TOKEN}", TOKEN, f"Basic {TOKEN}", "Bearer \udcff"],
)
async def test_metrics_and_readyz_need_the_admin_token(upstream, client, authorization):
    config = config_from_yaml(token_config(upstream), environ={"GW_ADMIN_TOKEN": TOKEN})
    headers = {} if authorization is None else {"Authorization": authorization.encode("utf-8", "surrogateescape").decode("latin-1")}
    async with running_gateway(config) as gw:
        for path in ("/metrics", "/readyz"):
            async with client.get(gw.admin_url + path, headers=headers) as response:
                assert response.status == 401
                assert response.headers["WWW-Authenticate"].startswith("Bearer")
                body = await response.read()
            assert TOKEN.encode() not in body and b"gateway_requests" not in body


async def test_the_right_token_opens_metrics_and_readyz_and_healthz_stays_open(upstream, client):
    config = config_from_yaml(token_config(upstream), environ={"GW_ADMIN_TOKEN": TOKEN})
    assert TOKEN not in repr(config)
    async with running_gateway(config) as gw:
        for path in ("/metrics", "/readyz"):
            async with client.get(gw.admin_url + path, headers={"Authorization": f"Bearer {TOKEN}"}) as response:
                assert response.status == 200
        async with client.get(gw.admin_url + "/healthz") as response:
            assert response.status == 200


@pytest.mark.parametrize(
    ("environ", "expected"),
    [({}, "admin_token_env: environment variable GW_ADMIN_TOKEN is not set"),
     ({"GW_ADMIN_TOKEN": "short"}, "admin_token_env: the token in GW_ADMIN_TOKEN must be at least 16")],
)
def test_an_admin_token_that_is_missing_or_weak_is_a_config_error(environ, expected):
    with pytest.raises(ConfigError) as info:
        parse("admin_token_env: GW_ADMIN_TOKEN\n" + ROUTE, environ)
    assert expected in str(info.value)
    assert "short" not in str(info.value)


# --- TLS on the public listener --------------------------------------------------------


@pytest.fixture(scope="module")
def ca():
    return trustme.CA()


def issue(ca, directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost signed by `ca`, and its key, written to `directory`."""
    issued = ca.issue_cert("127.0.0.1", "localhost")
    cert, key = directory / "cert.pem", directory / "key.pem"
    issued.cert_chain_pems[0].write_to_path(str(cert))
    for pem in issued.cert_chain_pems[1:]:
        pem.write_to_path(str(cert), append=True)
    issued.private_key_pem.write_to_path(str(key))
    return cert, key


@pytest.fixture
def certificate(ca, tmp_path):
    return issue(ca, tmp_path)


def tls_config(upstream: str, cert, key, min_version: str | None = None) -> str:
    version = f", min_version: {min_version}" if min_version else ""
    return f"""
listen: {{address: 127.0.0.1:0, tls: {{cert: {cert}, key: {key}{version}}}}}
admin_listen: 127.0.0.1:0
routes:
  - match: {{path: /}}
    upstream: {upstream}
"""


@pytest.fixture(scope="module")
def tls_gateway(ca, tmp_path_factory, module_upstream):
    """One gateway process for the tests that only connect to it: TLS on its public listener
    (TLSv1.3 or newer), a client_header_timeout of 200ms, the module's upstream behind it."""
    cert, key = issue(ca, tmp_path_factory.mktemp("tls"))
    with GatewayProcess(tls_config(module_upstream, cert, key, "TLSv1.3") + "client_header_timeout: 200ms\n") as gw:
        yield gw


def client_context(ca, *, maximum: ssl.TLSVersion | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    if maximum is not None:
        context.maximum_version = maximum
    return context


async def test_the_public_listener_serves_tls_with_the_configured_certificate(tls_gateway, ca):
    gw = tls_gateway
    assert gw.url.startswith("https://127.0.0.1:")
    connector = aiohttp.TCPConnector(ssl=client_context(ca))
    async with aiohttp.ClientSession(connector=connector) as session:
        async with session.get(gw.url + "/echo/tls") as response:
            assert response.status == 200
            echo = await response.json()
        # Plain HTTP on the TLS port gets no answer in the clear.
        with pytest.raises(aiohttp.ClientError):
            async with session.get(gw.url.replace("https://", "http://") + "/echo/plain") as response:
                await response.read()
    assert echo["path"] == "/echo/tls"
    assert ["X-Forwarded-Proto", "https"] in echo["headers"]


async def test_tls_min_version_refuses_older_clients(tls_gateway, ca):
    host, port = tls_gateway.url.removeprefix("https://").split(":")
    with pytest.raises((ssl.SSLError, ConnectionResetError)):  # an alert, or a reset first
        await asyncio.open_connection(host, int(port), ssl=client_context(ca, maximum=ssl.TLSVersion.TLSv1_2))
    _reader, writer = await asyncio.open_connection(host, int(port), ssl=client_context(ca))
    assert writer.get_extra_info("ssl_object").version() == "TLSv1.3"
    writer.close()
    await writer.wait_closed()


@pytest.mark.parametrize(
    ("tls", "expected"),
    [
        ("{cert: /nonexistent/cert.pem, key: /nonexistent/key.pem}", "listen.tls: cannot load the certificate and key"),
        ("{cert: CERT, key: CERT}", "listen.tls: cannot load the certificate and key"),
        ("{cert: CERT, key: KEY.encrypted}", "listen.tls.key: the key is encrypted; give the gateway an unencrypted key"),
        ("{cert: CERT, key: KEY, min_version: TLSv1.1}", "listen.tls.min_version: expected TLSv1.2 or TLSv1.3"),
        ("{cert: CERT}", "listen.tls.key: required key is missing"),
        ("{cert: CERT, key: KEY, ciphers: ALL}", "listen.tls.ciphers: unknown key"),
    ],
)
def test_a_tls_block_that_cannot_serve_is_a_config_error(certificate, tls, expected):
    cert, key = certificate
    # A passphrase-protected key: without a callback OpenSSL would prompt on the terminal.
    private = serialization.load_pem_private_key(key.read_bytes(), password=None)
    (key.parent / "key.pem.encrypted").write_bytes(private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.BestAvailableEncryption(b"secret")
    ))
    text = f"listen: {{address: 127.0.0.1:8443, tls: {tls.replace('CERT', str(cert)).replace('KEY', str(key))}}}\n" + ROUTE
    with pytest.raises(ConfigError) as info:
        parse(text)
    assert expected in str(info.value)


async def served_certificate(url: str, ca) -> tuple[bytes, str | None]:
    """The DER certificate a new TLS connection to `url` is shown, and the ALPN protocol
    chosen from the h2 and http/1.1 a browser offers."""
    host, port = url.removeprefix("https://").split(":")
    context = client_context(ca)
    context.set_alpn_protocols(["h2", "http/1.1"])
    _, writer = await asyncio.open_connection(host, int(port), ssl=context)
    tls = writer.get_extra_info("ssl_object")
    served = tls.getpeercert(binary_form=True), tls.selected_alpn_protocol()
    writer.close()
    await writer.wait_closed()
    return served


def der(issued: trustme.LeafCert) -> bytes:
    return ssl.PEM_cert_to_DER_cert(issued.cert_chain_pems[0].bytes().decode())


async def test_running_gateway_serves_listen_tls_as_the_cli_does(upstream, ca, certificate):
    cert, key = certificate
    async with running_gateway(tls_config(upstream, cert, key)) as gw:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=client_context(ca))) as session:
            async with session.get(gw.url + "/echo/tls") as response:
                echo = await response.json()
    assert gw.url.startswith("https://")
    assert ["X-Forwarded-Proto", "https"] in echo["headers"]


@pytest.mark.parametrize("sent", [b"", b"\x16\x03\x01\x00\xff\x01"], ids=["nothing", "half a ClientHello"])
async def test_a_tls_handshake_that_stalls_is_closed_at_client_header_timeout(tls_gateway, sent):
    host, port = tls_gateway.url.removeprefix("https://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(sent)
    # Closed at the timeout, not at asyncio's 60 s handshake default; 5 s is only a bound.
    with contextlib.suppress(ConnectionResetError):
        assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    assert "Traceback" not in "".join(tls_gateway.stderr_lines)


async def test_the_listener_answers_alpn_with_http_1_1(tls_gateway, ca):
    _, protocol = await served_certificate(tls_gateway.url, ca)
    assert protocol == "http/1.1"


async def test_sighup_serves_a_renewed_certificate_from_the_next_handshake(upstream, ca, certificate):
    # certbot and cert-manager renew in place, under the same paths, then signal a reload.
    cert, key = certificate
    with GatewayProcess(tls_config(upstream, cert, key)) as gw:
        first, _ = await served_certificate(gw.url, ca)
        renewed = ca.issue_cert("127.0.0.1", "localhost")
        renewed.cert_chain_pems[0].write_to_path(str(cert))
        renewed.private_key_pem.write_to_path(str(key))
        gw.signal(signal.SIGHUP)
        await eventually(lambda: any("config reloaded" in line for line in gw.stderr_lines), what="the reload")
        now, _ = await served_certificate(gw.url, ca)
        # A key that is not the certificate's fails the whole reload; the renewed pair serves on.
        ca.issue_cert("127.0.0.1").private_key_pem.write_to_path(str(key))
        gw.signal(signal.SIGHUP)
        await eventually(lambda: any("config reload failed" in line for line in gw.stderr_lines), what="the refusal")
        kept, _ = await served_certificate(gw.url, ca)
        log = "".join(gw.stderr_lines)
    assert first != der(renewed)
    assert now == kept == der(renewed), log
    assert "listen.tls: cannot load the certificate and key: [X509: KEY_VALUES_MISMATCH]" in log
    assert "take effect only at restart" not in log and "Traceback" not in log


def test_listen_may_still_be_a_plain_address():
    config = parse("listen: 127.0.0.1:8081\n" + ROUTE)
    assert (config.listen.port, config.listen_tls) == (8081, None)


# --- the parser and the aiohttp pin ----------------------------------------------------


def test_aiohttp_parses_requests_with_llhttp_in_the_gateway_process(tls_gateway):
    # Most aiohttp request-smuggling advisories hit only the pure-Python parser.
    assert request_parser() == "llhttp"
    startup = next(line for line in tls_gateway.stderr_lines if "listening on" in line)
    assert startup.rstrip().endswith("parser: llhttp"), startup


async def test_the_pure_python_parser_is_named_and_warned_about(upstream):
    config = f"admin_listen: 127.0.0.1:0\nroutes:\n  - match: {{path: /}}\n    upstream: {upstream}\n"
    with GatewayProcess(config, env={"AIOHTTP_NO_EXTENSIONS": "1"}) as gw:
        startup = next(line for line in gw.stderr_lines if "listening on" in line)
        warnings = [line for line in gw.stderr_lines if "pure Python" in line]
    assert startup.rstrip().endswith("parser: python"), startup
    assert warnings, gw.stderr_lines


def test_check_shows_tls_and_the_admin_token_but_never_the_token(certificate, tmp_path):
    cert, key = certificate
    path = tmp_path / "gw.yaml"
    path.write_text(
        f"listen: {{address: 127.0.0.1:8443, tls: {{cert: {cert}, key: {key}}}}}\nadmin_token_env: GW_ADMIN_TOKEN\n" + ROUTE
    )
    result = run_cli("check", "-c", str(path), env={"GW_ADMIN_TOKEN": TOKEN})
    assert result.returncode == 0, result.stderr
    assert "listen 127.0.0.1:8443 (TLS, TLSv1.2 or newer)" in result.stdout
    assert "(bearer token)" in result.stdout
    assert TOKEN not in result.stdout + result.stderr


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def test_aiohttp_is_at_or_above_the_release_that_fixed_its_latest_advisory():
    (requirement,) = [r for r in importlib.metadata.requires("ratelimit-gateway") if r.startswith("aiohttp")]
    floor = _version(requirement)
    assert floor >= (3, 14, 3), requirement  # GHSA-cq5v-8q36-5273, see pyproject.toml
    assert _version(importlib.metadata.version("aiohttp")) >= floor


