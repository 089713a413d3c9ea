"""Keys on the request path: which bucket a request is charged to.

Pure parts first (ip_group, composite_value, forwarded_for, held_to), then
through a real gateway (`gateway.testing.running_gateway`, in-process store) and
a real upstream: every limit allows one request an hour, so a 200 means a fresh
bucket and a 429 a shared one. The test client connects from 127.0.0.1, trusted
only where a test says so."""

from __future__ import annotations

import hashlib
import itertools

import aiohttp
import pytest

from gateway.identity.sources import composite_value, forwarded_for, ip_group
from gateway.identity.tiers import held_to, with_allowlisted
from gateway.limiter.decision import Decision, LimitStatus
from gateway.limiter.outcomes import ALLOW, ALLOWLISTED, DELAYED
from gateway.limiter.store import LimitCheck
from gateway.proxy.headers import forwarded_element
from gateway.testing import config_from_yaml, running_gateway
from tests.scrape import decisions

ROUTE = "routes:\n  - match: {path: /}\n    upstream: http://127.0.0.1:9000\n"


# --- pure ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("client", "v4", "v6", "group"),
    [
        ("192.0.2.77", 24, 128, "192.0.2.0/24"),
        ("192.0.2.77", 32, 64, "192.0.2.77/32"),
        ("2001:db8:1:2:aaaa::1", 24, 64, "2001:db8:1:2::/64"),
        ("2001:db8:1:2:aaaa::1", 24, 128, "2001:db8:1:2:aaaa::1/128"),
        ("unix-socket-peer", 24, 64, "unix-socket-peer"),
    ],
)
def test_ip_group_is_the_clients_network_for_its_family(client, v4, v6, group):
    assert ip_group(client, v4, v6) == group


def test_composite_values_are_one_to_one():
    parts = ["a", "b", ",", "%", "a,b", "%2C", ""]
    combos = list(itertools.product(parts, repeat=2))
    assert len({composite_value(c) for c in combos}) == len(combos)


def test_forwarded_reads_each_elements_for_unquoted():
    lines = ['for=192.0.2.60;proto=http;by=203.0.113.43, for="[2001:db8:cafe::17]:4711"', "proto=https, For=_hidden"]
    assert forwarded_for(lines) == ["192.0.2.60", "[2001:db8:cafe::17]:4711", "unknown", "_hidden"]


def test_a_comma_or_semicolon_inside_a_quoted_forwarded_value_separates_nothing():
    """Reproduction: `host="x,for=1.2.3.4"` was read as a second element naming 1.2.3.4."""
    lines = ['for=192.0.2.9;host="x,for=1.2.3.4;y", for=198.51.100.2;host="a\\"b,c"']
    assert forwarded_for(lines) == ["192.0.2.9", "198.51.100.2"]


@pytest.mark.parametrize(
    "peer, proto, host, element",
    [
        ("192.0.2.7", "http", "api.example", "for=192.0.2.7;host=api.example;proto=http"),
        ("2001:db8::7", "https", "api.example:8443", 'for="[2001:db8::7]";host="api.example:8443";proto=https'),
        ("192.0.2.7", "http", 'x",for=1.2.3.4', 'for=192.0.2.7;host="x\\",for=1.2.3.4";proto=http'),
        ("192.0.2.7", "http", "", "for=192.0.2.7;proto=http"),
    ],
)
def test_our_forwarded_hop_is_an_element_every_reader_parses_back(peer, proto, host, element):
    assert forwarded_element(peer, proto, host) == element
    assert forwarded_for(["for=203.0.113.1", element]) == ["203.0.113.1", f"[{peer}]" if ":" in peer else peer]


TIER_FILE_KEYS = {hashlib.sha256(b"gold-key").hexdigest(): "gold"}


def tiered(tmp_path, extra: str = "", source: str = "file"):
    (tmp_path / "keys.yaml").write_text("gold: [gold-key]\n")
    origin = f"{{file: '{tmp_path / 'keys.yaml'}'}}" if source == "file" else "{header: X-Tier}"
    return config_from_yaml(
        "trusted_proxies: [10.0.0.0/8]\n"
        f"limits:\n  a: {{rate: 1/second, key: [header:X-API-Key, ip], tiers: {{from: {origin}, gold: {{rate: 9/second}}}}{extra}}}\n"
        + ROUTE
    ).limits[0]


def test_held_to_a_key_files_tier_by_the_identity_value(tmp_path):
    limit = tiered(tmp_path)
    assert held_to(limit, "header:x-api-key=gold-key", "192.0.2.1", None).name == "a/gold"
    assert held_to(limit, "header:x-api-key=other", "192.0.2.1", None) is limit
    # A tier header means nothing to a limit whose tiers come from a file.
    assert held_to(limit, "header:x-api-key=other", "192.0.2.1", "gold") is limit


def test_held_to_a_header_tier_only_as_given_and_unknown_tiers_are_the_default(tmp_path):
    limit = tiered(tmp_path, source="header")
    assert held_to(limit, "ip=192.0.2.1", "192.0.2.1", "gold").name == "a/gold"
    assert held_to(limit, "ip=192.0.2.1", "192.0.2.1", "platinum") is limit
    assert held_to(limit, "ip=192.0.2.1", "192.0.2.1", None) is limit


def test_held_to_nothing_when_allowlisted_by_network_or_identity(tmp_path):
    limit = tiered(tmp_path, extra=", allow: [192.0.2.0/24, 'header:X-API-Key=ops']")
    assert held_to(limit, "ip=192.0.2.9", "192.0.2.9", None) is None
    assert held_to(limit, "header:x-api-key=gold-key", "192.0.2.9", None) is None  # the address decides
    assert held_to(limit, "header:x-api-key=ops", "198.51.100.1", None) is None
    assert held_to(limit, "header:x-api-key=gold-key", "198.51.100.1", None).name == "a/gold"


def test_with_allowlisted_puts_each_status_back_in_its_place(tmp_path):
    limit = tiered(tmp_path)
    checks = [LimitCheck(limit=limit, identity=f"ip={i}", cost=1) for i in range(3)]
    checked = Decision(
        allowed=True, statuses=(LimitStatus(limit, 1, 5.0, ALLOW), LimitStatus(limit, 1, 6.0, ALLOW)),
        retry_after=0.0, store_failed=False,
    )
    merged = with_allowlisted(checked, checks, [limit, None, limit])
    assert [(s.outcome, s.remaining) for s in merged.statuses] == [(ALLOW, 5.0), (ALLOWLISTED, None), (ALLOW, 6.0)]


def test_with_allowlisted_keeps_the_wait_of_a_delayed_decision(tmp_path):
    # A mode: delay limit with `allow` or `tiers` charged the request into its debt; dropping
    # the wait here admitted it at once, past the rate (found by tests/gateway/test_deploy_prometheus.py).
    limit = tiered(tmp_path)
    checks = [LimitCheck(limit=limit, identity=f"ip={i}", cost=1) for i in range(2)]
    checked = Decision(
        allowed=True, statuses=(LimitStatus(limit, 1, -1.0, DELAYED),), retry_after=0.0, store_failed=False, wait=0.25
    )
    merged = with_allowlisted(checked, checks, [limit, None])
    assert merged.wait == 0.25
    assert [s.outcome for s in merged.statuses] == [DELAYED, ALLOWLISTED]


# --- through the gateway --------------------------------------------------------------------


async def statuses(client: aiohttp.ClientSession, url: str, requests: list[dict]) -> list[int]:
    found = []
    for request in requests:
        async with client.request(request.pop("method", "GET"), url + request.pop("path", "/"), **request) as response:
            found.append(response.status)
    return found


def one_an_hour(upstream: str, key: str, *, top: str = "", path: str = "/") -> str:
    return (
        f"{top}limits:\n  a: {{rate: 1/hour, burst: 1, key: {key}}}\n"
        f"routes:\n  - match: {{path: {path}}}\n    upstream: {upstream}\n    limits: [a]\n"
    )


def xff(address: str) -> dict:
    return {"headers": {"X-Forwarded-For": address}}


async def test_a_global_key_is_one_bucket_for_every_client(upstream, client):
    config = one_an_hour(upstream, "[]", top="trusted_proxies: [127.0.0.1]\n")
    async with running_gateway(config) as gw:
        assert await statuses(client, gw.url, [xff("192.0.2.1"), xff("198.51.100.2"), {}]) == [200, 429, 429]


async def test_a_composite_key_is_one_bucket_per_combination_and_absent_without_all_parts(upstream, client):
    text = (
        "limits:\n  a: {rate: 1/hour, burst: 1, key: [[header:X-API-Key, path], header:X-Team]}\n"
        f"routes:\n  - match: {{path: /one}}\n    upstream: {upstream}\n    limits: [a]\n"
        f"  - match: {{path: /two}}\n    upstream: {upstream}\n    limits: [a]\n"
    )
    k1, k2 = {"X-API-Key": "k1"}, {"X-API-Key": "k2"}
    async with running_gateway(text) as gw:
        assert await statuses(
            client, gw.url,
            [
                {"path": "/one", "headers": k1}, {"path": "/one/sub", "headers": k1},  # one route: one bucket
                {"path": "/two", "headers": k1}, {"path": "/one", "headers": k2},  # fresh combinations
                # Without X-API-Key the composite is absent and the next entry keys the client.
                {"path": "/one", "headers": {"X-Team": "t"}}, {"path": "/two", "headers": {"X-Team": "t"}},
            ],
        ) == [200, 429, 200, 200, 200, 429]


async def test_method_and_host_sources_and_methods_outside_the_metric_set_share_one_bucket(upstream, client):
    text = one_an_hour(upstream, "[[method, host]]")
    async with running_gateway(text) as gw:
        assert await statuses(
            client, gw.url,
            [
                {"headers": {"Host": "a.example"}}, {"headers": {"Host": "A.example:8080"}},
                {"method": "POST", "headers": {"Host": "a.example"}}, {"headers": {"Host": "b.example"}},
                {"method": "PROPFIND", "headers": {"Host": "a.example"}}, {"method": "MKCOL", "headers": {"Host": "a.example"}},
            ],
        ) == [200, 429, 200, 200, 200, 429]


async def test_ip_prefixes_group_ipv4_and_ipv6_clients_by_network(upstream, client):
    config = one_an_hour(upstream, "'ip/24,64'", top="trusted_proxies: [127.0.0.1]\n")
    async with running_gateway(config) as gw:
        assert await statuses(
            client, gw.url,
            [
                xff("192.0.2.1"), xff("192.0.2.200"), xff("192.0.3.1"),
                xff("2001:db8:0:1::1"), xff("2001:db8:0:1:ffff::2"), xff("2001:db8:0:2::1"),
            ],
        ) == [200, 429, 200, 200, 429, 200]


@pytest.mark.parametrize(
    ("strategy", "headers_seen_as_one", "headers_apart"),
    [
        # X-Real-IP: the one address a trusted proxy wrote.
        ("{header: X-Real-IP}", ({"X-Real-IP": "192.0.2.1"}, {"X-Real-IP": "192.0.2.1"}), {"X-Real-IP": "192.0.2.2"}),
        # Forwarded: right to left, skipping trusted proxies (127.0.0.1 here).
        (
            "{header: Forwarded}",
            ({"Forwarded": "for=192.0.2.1"}, {"Forwarded": 'for=203.0.113.9, for=192.0.2.1, for="127.0.0.1"'}),
            {"Forwarded": "for=192.0.2.2"},
        ),
        # depth 2: the second from the right, whatever it is; what the client wrote left of it is ignored.
        (
            "{depth: 2}",
            ({"X-Forwarded-For": "6.6.6.6, 192.0.2.1, 10.1.1.1"}, {"X-Forwarded-For": "7.7.7.7, 192.0.2.1, 10.9.9.9"}),
            {"X-Forwarded-For": "192.0.2.1, 10.1.1.1, 10.2.2.2"},
        ),
    ],
)
async def test_client_ip_strategies_read_the_chosen_header(upstream, client, strategy, headers_seen_as_one, headers_apart):
    config = one_an_hour(upstream, "ip", top=f"trusted_proxies: [127.0.0.1]\nclient_ip: {strategy}\n")
    first, second = headers_seen_as_one
    async with running_gateway(config) as gw:
        got = await statuses(client, gw.url, [{"headers": first}, {"headers": second}, {"headers": headers_apart}])
    assert got == [200, 429, 200]


@pytest.mark.parametrize(
    ("strategy", "header", "value"),
    [
        ("{header: X-Real-IP}", "X-Real-IP", "192.0.2.{}"),
        ("{header: Forwarded}", "Forwarded", "for=192.0.2.{}"),
        ("{header: X-Forwarded-For, depth: 1}", "X-Forwarded-For", "192.0.2.{}"),
    ],
)
async def test_client_ip_headers_are_not_believed_from_an_untrusted_peer(upstream, client, strategy, header, value):
    config = one_an_hour(upstream, "ip", top=f"trusted_proxies: [10.0.0.0/8]\nclient_ip: {strategy}\n")
    async with running_gateway(config) as gw:
        got = await statuses(client, gw.url, [{"headers": {header: value.format(i)}} for i in (1, 2)])
    assert got == [200, 429]  # both are 127.0.0.1


async def test_a_tier_header_is_ignored_unless_a_trusted_proxy_sent_it(upstream, client):
    tiers = "{from: {header: X-Tier}, gold: {rate: 1/hour, burst: 2}}"
    text = (
        "trusted_proxies: [10.0.0.0/8]\n"
        f"limits:\n  a: {{rate: 1/hour, burst: 1, key: ip, tiers: {tiers}}}\n"
        f"routes:\n  - match: {{path: /}}\n    upstream: {upstream}\n    limits: [a]\n"
    )
    gold = {"headers": {"X-Tier": "gold"}}
    async with running_gateway(text) as gw:
        # 127.0.0.1 is not trusted: its X-Tier is its own say, and it stays in the default tier.
        assert await statuses(client, gw.url, [dict(gold), dict(gold)]) == [200, 429]
    async with running_gateway(text.replace("10.0.0.0/8", "127.0.0.1")) as gw:
        assert await statuses(client, gw.url, [dict(gold), dict(gold), dict(gold)]) == [200, 200, 429]
        async with client.get(gw.url + "/", headers=[("X-Tier", "gold"), ("X-Tier", "gold")]) as response:
            assert response.status == 400  # which line the authenticator wrote is unknowable


async def test_an_allowlisted_identity_is_never_limited_and_counted_as_allowlisted(upstream, client):
    config = one_an_hour(upstream, "[header:X-API-Key, ip]").replace("key:", "allow: ['header:X-API-Key=ops'], key:")
    async with running_gateway(config) as gw:
        ops = {"headers": {"X-API-Key": "ops"}}
        assert await statuses(client, gw.url, [dict(ops) for _ in range(5)] + [{}, {}]) == [200] * 5 + [200, 429]
        counts = await decisions(client, gw.admin_url)
    assert (counts["a", "allowlisted"], counts["a", "allow"], counts["a", "deny"]) == (5, 1, 1)
