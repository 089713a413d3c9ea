"""The admin listener against DNS rebinding: a page whose name the attacker points at the
listener's address reaches it with its own name as Host, so only a Host that names the
listener is answered (an IP literal, localhost, a name in `admin_hosts`), and a request
that changes state from another origin is refused. Raw requests, so any Host can be sent."""

from __future__ import annotations

import json

import pytest

from gateway.config import ConfigError
from gateway.testing import config_from_yaml, running_gateway
from tests.raw_client import raw_exchange

KEY = "k-rebind-1"


def admin_config(upstream: str, extra: str = "") -> str:
    return f"""
{extra}
limits:
  per_key: {{rate: 1/hour, burst: 1, key: header:X-Api-Key}}
routes:
  - match: {{path: /api}}
    upstream: {upstream}
    limits: [per_key]
"""


async def admin(url: str, method: str, target: str, host: str | None, *lines: str) -> tuple[int, str, bytes]:
    """Status, content type and body of one raw request to the admin listener."""
    # Without Host, HTTP/1.0, which allows that (as curl -0 -H 'Host:' sends it).
    head = f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n" if host is not None else f"{method} {target} HTTP/1.0\r\n"
    request = (head + "".join(line + "\r\n" for line in lines) + "Connection: close\r\n\r\n").encode()
    status, headers, body = await raw_exchange(url, request)
    content_type = next((v for n, v in headers if n.lower() == "content-type"), "")
    return status, content_type.split(";")[0], body


async def spent(gw) -> bool:
    """Whether KEY's one request is spent: a request with it is refused now."""
    request = f"GET /api/x HTTP/1.1\r\nHost: gw\r\nX-Api-Key: {KEY}\r\nConnection: close\r\n\r\n".encode()
    return (await raw_exchange(gw.url, request))[0] == 429


@pytest.fixture
async def gw(upstream):
    async with running_gateway(admin_config(upstream, "admin_hosts: [gateway, Admin.Internal.]")) as gateway:
        yield gateway


REBOUND = ("rebind.attacker.example", "rebind.attacker.example:9090", "127.0.0.1.attacker.example")


@pytest.mark.parametrize("host", REBOUND)
@pytest.mark.parametrize(
    ("method", "target"),
    [("GET", "/config"), ("GET", "/top-limited"), ("GET", "/stats"), ("GET", "/metrics"), ("GET", "/readyz"),
     ("GET", f"/buckets/per_key?value={KEY}"), ("DELETE", f"/buckets/per_key?value={KEY}"), ("GET", "/")],
)
async def test_a_host_that_does_not_name_the_listener_is_refused(gw, host, method, target):
    status, content_type, body = await admin(gw.admin_url, method, target, host)
    assert (status, content_type) == (421, "application/problem+json"), body
    assert b"admin_hosts" in body and host.encode() not in body


async def test_a_rebound_delete_resets_nothing(gw):
    await spent(gw)
    assert await spent(gw)
    for host in REBOUND:
        assert (await admin(gw.admin_url, "DELETE", f"/buckets/per_key?value={KEY}", host))[0] == 421
    assert await spent(gw)  # still spent: the reset never ran


@pytest.mark.parametrize(
    "host",
    [None, "127.0.0.1", "{admin}", "10.244.1.7:9090", "[::1]:9090", "[fe80::1]", "localhost", "LocalHost:9091",
     "localhost.", "gateway:9090", "gateway", "admin.internal", "ADMIN.internal.:8080"],
)
async def test_an_ip_literal_localhost_or_a_configured_name_is_answered(gw, host):
    # A pod IP (kubelet probes, Prometheus by pod IP), a published port that differs from the
    # bound one, and the name Prometheus scrapes by in compose.
    if host == "{admin}":
        host = gw.admin_url.removeprefix("http://")
    for target in ("/config", "/top-limited", "/readyz", "/metrics", "/"):
        status, _, body = await admin(gw.admin_url, "GET", target, host)
        assert status == 200, (target, body)


@pytest.mark.parametrize(
    "host", ["other.internal", "gateway.evil.example", "", "[::1", "[::1]x", "127.0.0.1:x", "1.2.3", "[127.0.0.1]"]
)
async def test_names_not_configured_and_malformed_hosts_are_refused(gw, host):
    assert (await admin(gw.admin_url, "GET", "/config", host))[0] == 421


async def test_healthz_answers_whatever_the_host(gw):
    status, _, body = await admin(gw.admin_url, "GET", "/healthz", "rebind.attacker.example")
    assert status == 200 and json.loads(body) == {"status": "alive"}


@pytest.mark.parametrize(
    "origin", ["http://rebind.attacker.example", "null", "http://127.0.0.1:1", "https://{admin}", "http://{admin}/x", "x"]
)
async def test_a_foreign_origin_cannot_change_state(gw, origin):
    address = gw.admin_url.removeprefix("http://")
    await spent(gw)
    status, content_type, body = await admin(
        gw.admin_url, "DELETE", f"/buckets/per_key?value={KEY}", address, "Origin: " + origin.format(admin=address)
    )
    assert (status, content_type) == (403, "application/problem+json"), body
    assert await spent(gw)
    # Reading with a foreign Origin is the browser's to withhold (no CORS headers are sent).
    assert (await admin(gw.admin_url, "GET", "/config", address, "Origin: " + origin.format(admin=address)))[0] == 200


@pytest.mark.parametrize(
    ("host", "origin"),
    [("{admin}", "http://{admin}"), ("localhost:{port}", "http://localhost:{port}"), ("{admin}", None),
     ("gateway:80", "http://gateway"), ("gateway", "http://GATEWAY:80")],
)
async def test_the_listeners_own_origin_or_none_may_change_state(gw, host, origin):
    address = gw.admin_url.removeprefix("http://")
    port = address.rpartition(":")[2]
    await spent(gw)
    host = host.format(admin=address, port=port)
    lines = () if origin is None else ("Origin: " + origin.format(admin=address, port=port),)
    status, _, body = await admin(gw.admin_url, "DELETE", f"/buckets/per_key?value={KEY}", host, *lines)
    assert status == 200, body
    assert not await spent(gw)  # the reset ran: the request passed, and the next is refused


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("admin_hosts: gateway", "admin_hosts: expected a list"),
        ("admin_hosts: ['gateway:9090']", "admin_hosts[0]: expected a host name without a port, got 'gateway:9090'"),
        ("admin_hosts: ['a b']", "admin_hosts[0]: expected a host name without a port"),
        ("admin_hosts: [1]", "admin_hosts[0]"),
    ],
)
def test_admin_hosts_must_be_host_names(value, error):
    with pytest.raises(ConfigError) as raised:
        config_from_yaml(admin_config("http://127.0.0.1:9", value))
    assert error in str(raised.value) and "\n" not in str(raised.value)
