"""Who the client is, proved through rate limiting: two requests share a bucket
exactly when the gateway took them for the same client.

Every limit here allows one request an hour, so a first request from a client
gets 200 and the next from the same client gets 429; a 200 means a new bucket.
The test client connects from 127.0.0.1, which is trusted only where a test says so.
Also: identity values are hashed to fixed-length keys (gateway.limiter.keys)."""

from __future__ import annotations

import ipaddress
import re

import aiohttp
import pytest
from multidict import CIMultiDict

from gateway.limiter.keys import DIGEST_BYTES, bucket_key, identity_digest
from gateway.proxy.client_identity import ADDRESS_MEMO_SIZE, ClientIdentity
from gateway.testing import running_gateway


def identity_config(upstream: str, trusted: str = "[]") -> str:
    return f"""
trusted_proxies: {trusted}
limits:
  per_ip: {{rate: 1/hour, burst: 1, key: ip}}
  per_key: {{rate: 1/hour, burst: 1, key: [header:X-Api-Key, query:key, cookie:sid]}}
routes:
  - match: {{path: /by-ip}}
    upstream: {upstream}
    limits: [per_ip]
  - match: {{path: /by-key}}
    upstream: {upstream}
    limits: [per_key]
"""



def forwarded(*lines: str) -> CIMultiDict[str]:
    """One X-Forwarded-For header line per argument."""
    return CIMultiDict(("X-Forwarded-For", line) for line in lines)


class Statuses:
    def __init__(self, client: aiohttp.ClientSession, base: str) -> None:
        self._client = client
        self._base = base

    async def __call__(self, path: str, headers: CIMultiDict[str] | dict[str, str] | None = None) -> int:
        async with self._client.get(self._base + path, headers=headers) as response:
            return response.status


# --- ip and X-Forwarded-For -----------------------------------------------------------


async def test_a_forged_x_forwarded_for_from_an_untrusted_peer_changes_nothing(upstream, client):
    async with running_gateway(identity_config(upstream)) as gw:
        status = Statuses(client, gw.url)
        assert await status("/by-ip", forwarded("192.0.2.1")) == 200
        assert await status("/by-ip", forwarded("192.0.2.2")) == 429
        assert await status("/by-ip", forwarded("192.0.2.3", "198.51.100.9")) == 429
        assert await status("/by-ip") == 429


async def test_behind_a_trusted_proxy_each_forwarded_client_gets_its_own_bucket(upstream, client):
    async with running_gateway(identity_config(upstream, "[127.0.0.1/32]")) as gw:
        status = Statuses(client, gw.url)
        assert await status("/by-ip", forwarded("192.0.2.1")) == 200
        assert await status("/by-ip", forwarded("192.0.2.2")) == 200
        assert await status("/by-ip", forwarded("192.0.2.1")) == 429
        assert await status("/by-ip", forwarded("192.0.2.2")) == 429
        # The proxy itself, sending no X-Forwarded-For, is one more client.
        assert await status("/by-ip") == 200
        assert await status("/by-ip") == 429


async def test_x_forwarded_for_is_read_right_to_left_skipping_trusted_proxies(upstream, client):
    async with running_gateway(identity_config(upstream, "[127.0.0.1/32, 10.0.0.0/8]")) as gw:
        status = Statuses(client, gw.url)
        # 203.0.113.66 was written by the client itself: the first untrusted address from the right wins.
        assert await status("/by-ip", forwarded("203.0.113.66, 192.0.2.5, 10.1.2.3")) == 200
        assert await status("/by-ip", forwarded("203.0.113.77, 192.0.2.5")) == 429
        assert await status("/by-ip", forwarded("192.0.2.5, 10.9.9.9, 10.1.1.1")) == 429
        assert await status("/by-ip", forwarded("203.0.113.66")) == 200


async def test_several_x_forwarded_for_lines_are_merged_in_order(upstream, client):
    async with running_gateway(identity_config(upstream, "[127.0.0.1/32, 10.0.0.0/8]")) as gw:
        status = Statuses(client, gw.url)
        assert await status("/by-ip", forwarded("192.0.2.3", "192.0.2.4, 10.0.0.1")) == 200
        assert await status("/by-ip", forwarded("192.0.2.4")) == 429
        assert await status("/by-ip", forwarded("192.0.2.9", "192.0.2.4", "10.0.0.7")) == 429
        assert await status("/by-ip", forwarded("192.0.2.3")) == 200


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("[2001:db8::1]:443", "2001:db8::1"),
        ("192.0.2.1:8080", "192.0.2.1"),
        ("::ffff:192.0.2.2", "192.0.2.2"),
        (" 192.0.2.3 ", "192.0.2.3"),
    ],
)
async def test_forwarded_address_spellings_of_one_client_share_a_bucket(upstream, client, first, second):
    async with running_gateway(identity_config(upstream, "[127.0.0.1/32]")) as gw:
        status = Statuses(client, gw.url)
        assert await status("/by-ip", forwarded(first)) == 200
        assert await status("/by-ip", forwarded(second)) == 429


async def test_a_non_address_from_a_trusted_proxy_stops_the_walk_at_that_proxy(upstream, client):
    async with running_gateway(identity_config(upstream, "[127.0.0.1/32]")) as gw:
        status = Statuses(client, gw.url)
        assert await status("/by-ip", forwarded("192.0.2.1, not-an-address")) == 200
        # Keyed as the proxy itself: nothing left of the garbage was believed.
        assert await status("/by-ip") == 429
        assert await status("/by-ip", forwarded("192.0.2.1")) == 200


# --- header, query and cookie sources ----------------------------------------------------


async def test_a_header_identity_keys_the_bucket(upstream, client):
    async with running_gateway(identity_config(upstream)) as gw:
        status = Statuses(client, gw.url)
        assert await status("/by-key", {"X-Api-Key": "alpha"}) == 200
        assert await status("/by-key", {"x-api-key": "alpha"}) == 429  # header names are case-insensitive
        assert await status("/by-key", {"X-Api-Key": "beta"}) == 200


async def test_a_query_identity_keys_the_bucket(upstream, client):
    async with running_gateway(identity_config(upstream)) as gw:
        status = Statuses(client, gw.url)
        assert await status("/by-key?key=gamma") == 200
        assert await status("/by-key?other=1&key=gamma") == 429
        assert await status("/by-key?key=delta") == 200


async def test_a_cookie_identity_keys_the_bucket(upstream, client):
    async with running_gateway(identity_config(upstream)) as gw:
        status = Statuses(client, gw.url)
        assert await status("/by-key", {"Cookie": "sid=epsilon"}) == 200
        assert await status("/by-key", {"Cookie": "theme=dark; sid=epsilon"}) == 429
        assert await status("/by-key", {"Cookie": "sid=zeta"}) == 200
        several_lines = CIMultiDict([("Cookie", "theme=dark"), ("Cookie", "sid=iota")])
        assert await status("/by-key", several_lines) == 200
        assert await status("/by-key", {"Cookie": "sid=iota"}) == 429


@pytest.mark.parametrize(
    "cookie_header",
    [
        '_ga=GA1.2.3; prefs={"theme":"dark"}; sid=theta',
        "note=two words; sid=theta",
        'tok="unterminated; sid=theta',
        'sid="theta"',
        "sid=theta;flag",
    ],
)
async def test_a_cookie_identity_is_read_from_a_header_with_other_unusual_cookies(upstream, client, cookie_header):
    async with running_gateway(identity_config(upstream)) as gw:
        status = Statuses(client, gw.url)
        assert await status("/by-key", {"Cookie": cookie_header}) == 200
        assert await status("/by-key", {"Cookie": "sid=theta"}) == 429
        assert await status("/by-key") == 200  # not keyed by ip: that bucket is still full


async def test_the_first_identity_source_present_wins(upstream, client):
    async with running_gateway(identity_config(upstream)) as gw:
        status = Statuses(client, gw.url)
        # Header, query and cookie all present: the header is the identity.
        assert await status("/by-key?key=q1", {"X-Api-Key": "h1", "Cookie": "sid=c1"}) == 200
        assert await status("/by-key", {"X-Api-Key": "h1"}) == 429
        assert await status("/by-key?key=q1") == 200  # the query bucket was not charged
        # Query and cookie present: the query is the identity.
        assert await status("/by-key?key=q2", {"Cookie": "sid=c2"}) == 200
        assert await status("/by-key?key=q2") == 429
        assert await status("/by-key", {"Cookie": "sid=c2"}) == 200


async def test_with_no_identity_source_present_the_client_is_keyed_by_ip(upstream, client):
    async with running_gateway(identity_config(upstream)) as gw:
        status = Statuses(client, gw.url)
        assert await status("/by-key") == 200
        assert await status("/by-key", {"X-Api-Key": ""}) == 429  # an empty value is not present
        assert await status("/by-key", {"Cookie": "other=1"}) == 429
        assert await status("/by-key", {"X-Api-Key": "eta"}) == 200


# --- gateway.limiter.keys -------------------------------------------------------------------

SECRET = b"s" * 32
HEX_DIGEST = re.compile(rf"^[0-9a-f]{{{DIGEST_BYTES * 2}}}$")


@pytest.mark.parametrize(
    "identity",
    [
        "",
        "ip=127.0.0.1",
        "header:x-api-key=" + "k" * 100_000,
        "cookie:sid={evil}:hash{tag}",
        "query:key=\u00e9\u4e2d\U0001f600",
        "header:x-api-key=\udcff\x00\r\n",
    ],
)
def test_an_identity_digest_has_a_fixed_length_whatever_the_input(identity):
    digest = identity_digest(SECRET, identity)
    assert HEX_DIGEST.match(digest)


def test_an_identity_digest_is_stable_and_distinct_per_identity_and_secret():
    assert identity_digest(SECRET, "ip=192.0.2.1") == identity_digest(SECRET, "ip=192.0.2.1")
    assert identity_digest(SECRET, "ip=192.0.2.1") != identity_digest(SECRET, "ip=192.0.2.2")
    assert identity_digest(SECRET, "header:x-api-key=a") != identity_digest(SECRET, "query:key=a")
    assert identity_digest(SECRET, "ip=192.0.2.1") != identity_digest(b"t" * 32, "ip=192.0.2.1")


def test_a_bucket_key_holds_the_digest_as_its_only_hash_tag():
    identity = "header:x-api-key={sekrit}" + "x" * 5000
    key = bucket_key("rl:", "per_client", identity_digest(SECRET, identity))
    assert re.fullmatch(rf"rl:per_client:\{{[0-9a-f]{{{DIGEST_BYTES * 2}}}\}}", key)
    assert key.count("{") == 1 and key.count("}") == 1
    assert "sekrit" not in key
    other = bucket_key("rl:", "per_client", identity_digest(SECRET, "ip=192.0.2.1"))
    assert len(other) == len(key)


# --- pure: the remembered addresses -----------------------------------------------------


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("192.0.2.1", ("192.0.2.1", False)),
        ("10.1.2.3", ("10.1.2.3", True)),
        ("::ffff:10.1.2.3", ("10.1.2.3", True)),
        ("[2001:DB8::1]:443", ("2001:db8::1", False)),
        ("192.0.2.1:8080", ("192.0.2.1", False)),
        ("unknown", (None, False)),
        ("10.0.0.1" + " " * 100 + "x", (None, False)),
    ],
)
def test_an_address_reads_the_same_when_remembered(text, answer):
    identity = ClientIdentity([ipaddress.ip_network("10.0.0.0/8")])
    assert identity.address(text) == answer
    assert identity.address(text) == answer


def test_the_remembered_addresses_stay_bounded_however_many_clients_come():
    identity = ClientIdentity([])
    for i in range(3 * ADDRESS_MEMO_SIZE):
        text = f"2001:db8::{i + 1:x}"
        assert identity.address(text) == (text, False)
    assert len(identity._addresses) <= ADDRESS_MEMO_SIZE  # the memo itself: no public view of it
