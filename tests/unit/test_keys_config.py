"""Keys in the config: global and composite keys, the path, host and
method sources, ip prefixes, client_ip, tiers and allowlists are read into frozen
objects, and each mistake is one line naming its YAML path."""

from __future__ import annotations

import hashlib
import ipaddress
from pathlib import Path

import pytest

from gateway.config.model import ClientIpHeader, IdentitySource
from gateway.testing import config_from_yaml
from tests.helpers import error_of

ROUTE = "routes:\n  - match: {path: /}\n    upstream: http://127.0.0.1:9000\n"


def limit_of(spec: str, top: str = ""):
    return config_from_yaml(f"{top}limits:\n  a: {spec}\n" + ROUTE).limits[0]


@pytest.mark.parametrize("key", ["[]", "global", "[global]"])
def test_an_empty_key_or_global_is_one_bucket_for_every_client(key):
    assert limit_of(f"{{rate: 1/second, key: {key}}}").key == (IdentitySource(kind="global"),)


def test_a_composite_entry_is_one_source_of_several_parts_beside_single_ones():
    limit = limit_of("{rate: 1/second, key: [[header:X-API-Key, path], header:X-API-Key, ip]}")
    composite = limit.key[0]
    assert composite.kind == "composite"
    assert composite.parts == (IdentitySource(kind="header", name="x-api-key"), IdentitySource(kind="path"))
    assert [str(k) for k in limit.key] == ["header:x-api-key+path", "header:x-api-key", "ip"]


@pytest.mark.parametrize(
    ("text", "v4", "v6", "shown"),
    [("ip", 32, 128, "ip"), ("ip/24", 24, 128, "ip/24"), ("ip/24,64", 24, 64, "ip/24,64"), ("ip/32,56", 32, 56, "ip/32,56")],
)
def test_ip_prefixes_group_each_family_by_its_own_prefix(text, v4, v6, shown):
    source = limit_of(f"{{rate: 1/second, key: '{text}'}}").key[0]
    assert (source.kind, source.ipv4_prefix, source.ipv6_prefix, str(source)) == ("ip", v4, v6, shown)


@pytest.mark.parametrize("kind", ["path", "host", "method"])
def test_request_sources_are_read(kind):
    assert limit_of(f"{{rate: 1/second, key: [[header:X-A, {kind}]]}}").key[0].parts[1] == IdentitySource(kind=kind)


MISTAKES = {
    "unknown method": (
        "routes:\n  - match: {path: /, methods: [GET, GTE]}\n    upstream: http://h:1\n",
        "<test>: routes[0].match.methods[1]: 'GTE' is not a registered HTTP method",
    ),
    "CONNECT route": (
        "routes:\n  - match: {path: /, methods: [CONNECT]}\n    upstream: http://h:1\n",
        "routes[0].match.methods[0]: CONNECT is never routed",
    ),
    "empty methods": (
        "routes:\n  - match: {path: /, methods: []}\n    upstream: http://h:1\n",
        "routes[0].match.methods: an empty list matches no request",
    ),
    "entry after ip": (
        "limits:\n  a: {rate: 1/second, key: [ip, header:X-A]}\n" + ROUTE,
        "limits.a.key[1]: never read: every request has ip, listed before it",
    ),
    "entry after global": (
        "limits:\n  a: {rate: 1/second, key: [global, ip]}\n" + ROUTE,
        "limits.a.key[1]: never read: every request has global",
    ),
    "source twice": (
        "limits:\n  a: {rate: 1/second, key: [header:X-A, header:x-a]}\n" + ROUTE,
        "limits.a.key[1]: header:x-a is listed twice",
    ),
    "one-part composite": (
        "limits:\n  a: {rate: 1/second, key: [[header:X-A]]}\n" + ROUTE,
        "limits.a.key[0]: a composite key entry lists two sources or more",
    ),
    "global in a composite": (
        "limits:\n  a: {rate: 1/second, key: [[header:X-A, global]]}\n" + ROUTE,
        "limits.a.key[0][1]: global names no client",
    ),
    "nested composite": (
        "limits:\n  a: {rate: 1/second, key: [[header:X-A, [path, host]]]}\n" + ROUTE,
        "limits.a.key[0][1]: expected ip, ip/PREFIX",
    ),
    "IPv4 prefix too long": ("limits:\n  a: {rate: 1/second, key: ip/33}\n" + ROUTE, "limits.a.key[0]: expected ip/PREFIX4"),
    "IPv6 prefix too long": ("limits:\n  a: {rate: 1/second, key: 'ip/24,129'}\n" + ROUTE, "an IPv6 prefix from 1 to 128"),
    "unquoted ip/V4,V6 in a flow list": (
        "limits:\n  a: {rate: 1/second, key: [ip/24,64]}\n" + ROUTE,
        "limits.a.key[1]: expected ip, ip/PREFIX, ip/PREFIX4,PREFIX6, header:NAME, query:NAME, cookie:NAME, jwt:CLAIM, "
        "path, host, method or global, got an integer (in a [...] list, quote 'ip/24,64'",
    ),
    "IPv6 prefix left empty": ("limits:\n  a: {rate: 1/second, key: 'ip/24,'}\n" + ROUTE, "an IPv6 prefix from 1 to 128, got 'ip/24,'"),
    "zero prefix": ("limits:\n  a: {rate: 1/second, key: ip/0}\n" + ROUTE, "an IPv4 prefix from 1 to 32"),
    "prefix not a number": ("limits:\n  a: {rate: 1/second, key: ip/x}\n" + ROUTE, "limits.a.key[0]: expected ip/PREFIX4"),
    "client_ip without trusted proxies": (
        "client_ip: {header: X-Real-IP}\n" + ROUTE, "client_ip: the client's address is read from a header only when"
    ),
    "client_ip unknown header": (
        "trusted_proxies: [10.0.0.0/8]\nclient_ip: {header: X-Client}\n" + ROUTE,
        "client_ip.header: expected x-forwarded-for, x-real-ip or forwarded",
    ),
    "client_ip depth with X-Real-IP": (
        "trusted_proxies: [10.0.0.0/8]\nclient_ip: {header: X-Real-IP, depth: 2}\n" + ROUTE,
        "client_ip.depth: X-Real-IP holds one address",
    ),
    "client_ip depth 0": (
        "trusted_proxies: [10.0.0.0/8]\nclient_ip: {depth: 0}\n" + ROUTE, "client_ip.depth: expected an integer >= 1"
    ),
    "tier header without trusted proxies": (
        "limits:\n  a: {rate: 1/second, tiers: {from: {header: X-Tier}, gold: {rate: 5/second}}}\n" + ROUTE,
        "limits.a.tiers.from.header: a tier header is believed only from trusted_proxies",
    ),
    "tiers without from": (
        "limits:\n  a: {rate: 1/second, tiers: {gold: {rate: 5/second}}}\n" + ROUTE, "limits.a.tiers.from: required key"
    ),
    "tiers with two origins": (
        "trusted_proxies: [10.0.0.0/8]\n"
        "limits:\n  a: {rate: 1/second, tiers: {from: {header: X-T, file: k.yaml}, gold: {rate: 5/second}}}\n" + ROUTE,
        "limits.a.tiers.from: expected exactly one of file",
    ),
    "a tier called default": (
        "trusted_proxies: [10.0.0.0/8]\n"
        "limits:\n  a: {rate: 1/second, tiers: {from: {header: X-T}, default: {rate: 5/second}}}\n" + ROUTE,
        "limits.a.tiers.default: the limit's own rate and burst are the default tier",
    ),
    "a tier without rate": (
        "trusted_proxies: [10.0.0.0/8]\n"
        "limits:\n  a: {rate: 1/second, tiers: {from: {header: X-T}, gold: {burst: 5}}}\n" + ROUTE,
        "limits.a.tiers.gold.rate: required key is missing",
    ),
    "no tiers": (
        "trusted_proxies: [10.0.0.0/8]\nlimits:\n  a: {rate: 1/second, tiers: {from: {header: X-T}}}\n" + ROUTE,
        "limits.a.tiers: expected at least one tier",
    ),
    "a cost no tier's bucket can hold": (
        "trusted_proxies: [10.0.0.0/8]\n"
        "limits:\n  a: {rate: 5/second, tiers: {from: {header: X-T}, gold: {rate: 50/second}, trial: {rate: 2/second}}}\n"
        "routes:\n  - match: {path: /}\n    upstream: http://h:1\n    limits: [{name: a, cost: 3}]\n",
        "routes[0].limits[0].cost: cost 3 is greater than the burst 2 of tier 'a/trial'; its clients could never pass",
    ),
    "missing key file": (
        "limits:\n  a: {rate: 1/second, tiers: {from: {file: /nonexistent/keys.yaml}, gold: {rate: 5/second}}}\n" + ROUTE,
        "limits.a.tiers.from.file: cannot read '/nonexistent/keys.yaml'",
    ),
    "allow with host bits": (
        "limits:\n  a: {rate: 1/second, allow: [10.0.0.1/8]}\n" + ROUTE,
        "limits.a.allow[0]: '10.0.0.1/8' has host bits set; write the network, as in 10.0.0.0/8",
    ),
    "trusted proxy with host bits": (
        "trusted_proxies: [10.0.0.1/8]\n" + ROUTE,
        "trusted_proxies[0]: '10.0.0.1/8' has host bits set; write the network, as in 10.0.0.0/8",
    ),
    "allow garbage": ("limits:\n  a: {rate: 1/second, allow: [nonsense]}\n" + ROUTE, "limits.a.allow[0]: expected an address"),
    "allow on a source the key never reads": (
        "limits:\n  a: {rate: 1/second, key: header:X-A, allow: ['header:X-B=k']}\n" + ROUTE,
        "limits.a.allow[0]: this limit's key never reads header:x-b",
    ),
}


@pytest.mark.parametrize(
    "routes",
    [
        # Later routes an earlier one does not always take: another method, host, case or path.
        "- match: {path: /api, methods: [POST]}\n    upstream: http://h:1\n  - match: {path: /api}\n    upstream: http://h:2\n",
        "- match: {path: /api, host: a.example}\n    upstream: http://h:1\n  - match: {path: /api/x}\n    upstream: http://h:2\n",
        "- match: {path: /api}\n    upstream: http://h:1\n  - match: {path: /API/x, case_sensitive: false}\n    upstream: http://h:2\n",
        "- match: {path: /api}\n    upstream: http://h:1\n  - match: {path: /apix}\n    upstream: http://h:2\n",
    ],
)
def test_a_route_an_earlier_one_only_sometimes_takes_is_accepted(routes):
    assert len(config_from_yaml("routes:\n  " + routes).routes) == 2


@pytest.mark.parametrize("case", MISTAKES)
def test_each_mistake_is_one_line_naming_its_yaml_path(case):
    text, expected = MISTAKES[case]
    assert expected in error_of(text, source="<test>")


def key_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    return str(path)


def test_a_key_file_maps_clear_and_hashed_keys_to_their_tiers(tmp_path):
    hashed = hashlib.sha256(b"key-silver").hexdigest()
    # Upper-case hex (PowerShell's Get-FileHash) names the same key.
    file = key_file(tmp_path, f"gold: [key-gold]\nsilver: ['sha256:{hashed.upper()}']\n")
    limit = limit_of(
        f"{{rate: 10/second, key: header:X-API-Key, tiers: {{from: {{file: '{file}'}}, gold: {{rate: 100/second, burst: 200}},"
        " silver: {rate: 50/second}}}"
    )
    tiers = limit.tiers
    assert tiers.members == {hashlib.sha256(b"key-gold").hexdigest(): "gold", hashed: "silver"}
    gold, silver = tiers.limits["gold"], tiers.limits["silver"]
    assert (gold.name, gold.burst, gold.rate.per_second, gold.key) == ("a/gold", 200, 100, limit.key)
    assert (silver.name, silver.burst) == ("a/silver", 50)
    assert (limit.name, limit.burst) == ("a", 10)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("bronze: [k]\n", "keys.yaml: bronze: unknown key (expected one of: gold)"),
        ("gold: [k, k]\n", "keys.yaml: gold[1]: this key is already in tier 'gold'"),
        ("gold: k\n", "keys.yaml: gold: expected a list"),
        ("gold: [[k]]\n", "keys.yaml: gold[0]: expected a non-empty string"),
        # Not 64 hex digits: hashed as a clear key, it silently matched no client.
        ("gold: ['sha256:abc']\n", "keys.yaml: gold[0]: expected sha256: and the key's 64 hex digits"),
    ],
)
def test_a_bad_key_file_names_the_config_path_the_file_and_the_entry(tmp_path, text, expected):
    file = key_file(tmp_path, text)
    message = error_of(
        f"limits:\n  a: {{rate: 1/second, tiers: {{from: {{file: '{file}'}}, gold: {{rate: 5/second}}}}}}\n" + ROUTE,
        source="<test>",
    )
    assert "limits.a.tiers.from.file" in message and expected in message


def test_an_allowlist_holds_networks_and_identities():
    limit = limit_of("{rate: 1/second, key: [header:X-API-Key, ip], allow: [10.0.0.0/8, '2001:db8::1', 'header:X-API-Key=ops']}")
    assert limit.allow.networks == (ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("2001:db8::1/128"))
    assert limit.allow.identities == frozenset({"header:x-api-key=ops"})


def test_client_ip_reads_the_chosen_header_at_a_depth():
    config = config_from_yaml("trusted_proxies: [10.0.0.0/8]\nclient_ip: {header: Forwarded, depth: 2}\n" + ROUTE)
    assert (config.client_ip.header, config.client_ip.depth) == (ClientIpHeader.FORWARDED, 2)
    assert config_from_yaml(ROUTE).client_ip.header is ClientIpHeader.X_FORWARDED_FOR
