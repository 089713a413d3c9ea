"""Forwarding headers: what the upstream is told about the client.

With `forwarded_headers: replace`, the default, a peer outside `trusted_proxies`
cannot forge X-Forwarded-For, X-Forwarded-Proto, X-Forwarded-Host or
Forwarded: they are replaced by the gateway's own. A trusted proxy's are kept,
the gateway's hop appended. IPv6 zone ids name an interface, not a client, so
they are stripped before keying. Clients here are 127.0.0.1 (untrusted) and
127.0.0.2 (the trusted proxy), over raw sockets."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError
from gateway.testing import config_from_yaml, running_gateway
from tests.raw_client import echoed, echoed_headers, raw_request, request_bytes

TRUSTED_PROXY = "127.0.0.2"
FORGED = [
    ("X-Forwarded-For", "1.2.3.4"),
    ("X-Forwarded-Proto", "https"),
    ("X-Forwarded-Host", "forged.example"),
    ("Forwarded", "for=1.2.3.4;proto=https;host=forged.example"),
]


def forwarding_config(upstream: str, mode: str | None = None) -> str:
    setting = f"forwarded_headers: {mode}\n" if mode else ""
    return f"""{setting}
trusted_proxies: [{TRUSTED_PROXY}/32]
limits:
  per_ip: {{rate: 1/hour, burst: 1, key: ip}}
routes:
  - match: {{path: /by-ip}}
    upstream: {upstream}
    limits: [per_ip]
  - match: {{path: /}}
    upstream: {upstream}
"""


async def test_an_untrusted_peers_forwarding_headers_are_replaced_by_default(upstream):
    """Reproduction: a forged X-Forwarded-For from an untrusted peer was passed on as `1.2.3.4, 127.0.0.1`."""
    async with running_gateway(forwarding_config(upstream)) as gw:
        status, _, body = await raw_request(gw.url, request_bytes("/echo", FORGED))
        assert status == 200
        echo = echoed(body)
        assert echoed_headers(echo, "X-Forwarded-For") == ["127.0.0.1"]
        assert echoed_headers(echo, "X-Forwarded-Proto") == ["http"]
        assert echoed_headers(echo, "X-Forwarded-Host") == ["gateway.test"]
        assert echoed_headers(echo, "Forwarded") == []


async def test_a_trusted_proxys_forwarding_headers_are_kept_and_our_hop_appended(upstream):
    async with running_gateway(forwarding_config(upstream)) as gw:
        status, _, body = await raw_request(gw.url, request_bytes("/echo", FORGED), local_host=TRUSTED_PROXY)
        assert status == 200
        echo = echoed(body)
        assert echoed_headers(echo, "X-Forwarded-For") == [f"1.2.3.4, {TRUSTED_PROXY}"]
        assert echoed_headers(echo, "X-Forwarded-Proto") == ["https"]  # it saw the client's scheme; we did not
        assert echoed_headers(echo, "X-Forwarded-Host") == ["forged.example"]
        assert echoed_headers(echo, "Forwarded") == [
            f"for=1.2.3.4;proto=https;host=forged.example, for={TRUSTED_PROXY};host=gateway.test;proto=http"
        ]


async def test_with_append_an_untrusted_peers_chain_is_passed_on_with_our_hop(upstream):
    async with running_gateway(forwarding_config(upstream, "append")) as gw:
        status, _, body = await raw_request(gw.url, request_bytes("/echo", FORGED))
        assert status == 200
        echo = echoed(body)
        assert echoed_headers(echo, "X-Forwarded-For") == ["1.2.3.4, 127.0.0.1"]
        assert echoed_headers(echo, "X-Forwarded-Proto") == ["http"]
        assert echoed_headers(echo, "Forwarded") == [
            "for=1.2.3.4;proto=https;host=forged.example, for=127.0.0.1;host=gateway.test;proto=http"
        ]


@pytest.mark.parametrize("mode", ["replace", "append"])
async def test_either_way_the_upstream_can_find_the_client_the_limiter_charged(upstream, mode):
    """The upstream, trusting the gateway and the same proxies, reads X-Forwarded-For right to
    left and stops at the first untrusted address: the client the limiter charged."""
    async with running_gateway(forwarding_config(upstream, mode)) as gw:
        forged = request_bytes("/by-ip/echo", [("X-Forwarded-For", "198.51.100.1")])
        status, _, body = await raw_request(gw.url, forged)
        assert status == 200
        chain = [e.strip() for e in echoed_headers(echoed(body), "X-Forwarded-For")[0].split(",")]
        assert chain[-1] == "127.0.0.1"  # untrusted: the client, and the bucket charged
        assert (await raw_request(gw.url, request_bytes("/by-ip", [])))[0] == 429


@pytest.mark.parametrize("spelling", ["2001:db8::5%2", "2001:db8::5%eth0", "[2001:db8::5%25eth0]:443", "2001:db8::5"])
async def test_ipv6_zone_ids_are_stripped_before_keying(upstream, spelling):
    """Reproduction: `2001:db8::5%1`, `%2` and `%eth0` were different buckets."""
    async with running_gateway(forwarding_config(upstream)) as gw:
        first = request_bytes("/by-ip", [("X-Forwarded-For", "2001:db8::5%1")])
        assert (await raw_request(gw.url, first, local_host=TRUSTED_PROXY))[0] == 200
        again = request_bytes("/by-ip", [("X-Forwarded-For", spelling)])
        assert (await raw_request(gw.url, again, local_host=TRUSTED_PROXY))[0] == 429


def test_an_unknown_forwarded_headers_setting_is_a_one_line_config_error():
    with pytest.raises(ConfigError) as caught:
        config_from_yaml("forwarded_headers: keep\nroutes: [{match: {path: /}, upstream: 'http://127.0.0.1:1'}]")
    assert str(caught.value) == "<test>: forwarded_headers: expected replace or append, got 'keep'"


async def test_connection_naming_host_does_not_take_the_clients_host_from_a_preserve_host_route(upstream):
    async with running_gateway(f"routes: [{{match: {{path: /}}, upstream: '{upstream}', preserve_host: true}}]") as gw:
        status, _, body = await raw_request(gw.url, request_bytes("/echo", [("Connection", "Host")]))
        assert status == 200
        assert echoed_headers(echoed(body), "Host") == ["gateway.test"]
