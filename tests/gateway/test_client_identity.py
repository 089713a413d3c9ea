"""Who the client is, proved through rate limiting: two requests share a bucket
exactly when the gateway took them for the same client.

Every limit here allows one request an hour, so a first request from a client
gets 200 and the next from the same client gets 429; a 200 means a new bucket.
The test client connects from 127.0.0.1, which is trusted only where a test says so.
Also: identity values are hashed to fixed-length keys (gateway.limiter.keys)."""

from __future__ import annotations

import ipaddress
import json
import re

import aiohttp
import pytest
from multidict import CIMultiDict

from gateway.config import ConfigError
from gateway.identity.sources import ADDRESS_MEMO_SIZE, ClientIdentity
from gateway.limiter.keys import DIGEST_BYTES, bucket_key, identity_digest
from gateway.testing import config_from_yaml, running_gateway
from tests.raw_client import echoed, echoed_headers, raw_request, request_bytes


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


# --- the limiter and the upstream see the same client ------------------------------------


async def test_a_request_naming_its_identity_header_in_connection_is_rejected_not_stripped(upstream):
    """Reproduction: `Connection: X-API-Key` with a throwaway key on each request was charged
    under the throwaway key while the upstream, the key stripped as hop-by-hop, saw an
    anonymous client; 8 of 8 passed where the same IP without a key was limited."""
    async with running_gateway(identity_config(upstream)) as gw:
        for i in range(8):
            request = request_bytes("/by-key", [("X-Api-Key", f"throwaway-{i}"), ("Connection", "X-Api-Key")])
            status, headers, body = await raw_request(gw.url, request)
            assert status == 400, body
            assert headers["content-type"] == ["application/problem+json; charset=utf-8"]
            assert "x-api-key" in json.loads(body)["detail"].lower()
        # None was charged or forwarded: this client's own buckets are untouched.
        assert (await raw_request(gw.url, request_bytes("/by-key", [])))[0] == 200


@pytest.mark.parametrize("alias", ["X_Api_Key", "x_api-KEY"])
async def test_a_header_that_cgi_reads_as_the_identity_header_is_rejected(upstream, alias):
    """Reproduction: `X_Api_Key: KEY` beside a throwaway `X-Api-Key` was charged under the
    throwaway key and forwarded as sent; a CGI or WSGI upstream (gunicorn before 22,
    werkzeug) reads both names as HTTP_X_API_KEY, so it could take KEY, never charged.
    Without `X-Api-Key` the gateway charged the address while such an upstream saw KEY."""
    async with running_gateway(identity_config(upstream)) as gw:
        for i in range(2):
            request = request_bytes("/by-key", [("X-Api-Key", f"throwaway-{i}"), (alias, "real-key")])
            status, _, body = await raw_request(gw.url, request)
            assert status == 400, body
            assert b"real-key" not in body
        assert (await raw_request(gw.url, request_bytes("/by-key", [(alias, "real-key")])))[0] == 400
        # Underscores elsewhere are nobody's identity, and the client's buckets are untouched.
        assert (await raw_request(gw.url, request_bytes("/by-key", [("X_Trace", "1")])))[0] == 200
        assert (await raw_request(gw.url, request_bytes("/by-ip", [(alias, "real-key")])))[0] == 200


@pytest.mark.parametrize(
    "cookie", ["sid=%61bc", "sid=ab%63", "sid=a%2Dbc", "sid=s%3abc", "%73id=abc", "%73id=abc; sid=throwaway"]
)
async def test_a_cookie_escaped_where_no_encoder_escapes_is_rejected(upstream, cookie):
    """Reproduction: `sid=%61bc`, `sid=a%62c`, ... were each a bucket of their own, while
    PHP, Rack and Express decode cookie values and served them all as the session `abc`:
    2^length buckets for one session. `%73id=abc` was no `sid` at all here (the address
    was charged) and `sid` to PHP and Rack, which decode names too."""
    async with running_gateway(identity_config(upstream)) as gw:
        assert (await raw_request(gw.url, request_bytes("/by-key", [("Cookie", "sid=abc")])))[0] == 200
        status, _, body = await raw_request(gw.url, request_bytes("/by-key", [("Cookie", cookie)]))
        assert status == 400, body
        assert b"abc" not in body
        # Escapes that encoders write are values as they are: Express's `s%3A...` sessions.
        assert (await raw_request(gw.url, request_bytes("/by-key", [("Cookie", "sid=s%3Aabc%2B%2F")])))[0] == 200
        assert (await raw_request(gw.url, request_bytes("/by-key", [("Cookie", "sid=s%3Aabc%2B%2F")])))[0] == 429


@pytest.mark.parametrize("target", ["/by-key?key=t1&x=1;key=real", "/by-key?x;key=real&key=t2", "/by-key?x=1;%6Bey=real"])
async def test_a_query_key_hidden_behind_a_semicolon_is_rejected(upstream, target):
    """Reproduction: `?key=t1&x=1;key=real` was charged under the throwaway `t1`, while Rack 2
    and Python's parse_qs before 3.9.2, which split a query on ';' too, read `key` twice and
    take the last: `real`, never charged. `?x=1;key=real` was no key here at all."""
    async with running_gateway(identity_config(upstream)) as gw:
        status, _, body = await raw_request(gw.url, request_bytes(target, []))
        assert status == 400, body
        assert b"real" not in body
        # A ';' elsewhere in a query is left alone, and nothing above was charged.
        assert (await raw_request(gw.url, request_bytes("/by-key?key=real&x=1;y=2", [])))[0] == 200
        assert (await raw_request(gw.url, request_bytes("/by-key?key=real", [])))[0] == 429


@pytest.mark.parametrize("connection", ["Cookie", "keep-alive, COOKIE"])
async def test_a_request_naming_its_identity_cookie_header_in_connection_is_rejected(upstream, connection):
    async with running_gateway(identity_config(upstream)) as gw:
        request = request_bytes("/by-key", [("Cookie", "sid=abc"), ("Connection", connection)])
        assert (await raw_request(gw.url, request))[0] == 400


async def test_a_header_the_gateway_sets_is_never_removed_by_connection(upstream):
    async with running_gateway(identity_config(upstream, "[127.0.0.1/32]")) as gw:
        request = request_bytes("/by-ip/echo", [("X-Forwarded-For", "192.0.2.7"), ("Connection", "X-Forwarded-For")])
        status, _, body = await raw_request(gw.url, request)
        assert status == 200
        # The upstream sees the client the limiter charged, not the trusted proxy alone.
        assert echoed_headers(echoed(body), "X-Forwarded-For") == ["192.0.2.7, 127.0.0.1"]


@pytest.mark.parametrize("first_byte", [b"\x80", b"\x81", b"\xff", b"\xc3"])
async def test_an_identity_header_with_bytes_outside_visible_ascii_is_rejected_not_normalised(upstream, first_byte):
    """Reproduction: `X-API-Key: \\x80secretkey`, `\\x81secretkey`, ... were each a new bucket,
    while the upstream received `X-API-Key: secretkey` for all of them."""
    async with running_gateway(identity_config(upstream)) as gw:
        request = request_bytes("/by-key", [(b"X-Api-Key", first_byte + b"secretkey")])
        status, headers, body = await raw_request(gw.url, request)
        assert status == 400, body
        assert headers["content-type"] == ["application/problem+json; charset=utf-8"]
        assert b"secretkey" not in body  # the value is not echoed


@pytest.mark.parametrize("target", ["/by-key?key=%80secret", "/by-key?key=se%00cret", "/by-key?key=caf%C3%A9"])
async def test_an_identity_query_value_outside_visible_ascii_is_rejected(upstream, target):
    async with running_gateway(identity_config(upstream)) as gw:
        assert (await raw_request(gw.url, request_bytes(target, [])))[0] == 400


async def test_an_identity_cookie_value_outside_visible_ascii_is_rejected(upstream):
    async with running_gateway(identity_config(upstream)) as gw:
        request = request_bytes("/by-key", [(b"Cookie", b"sid=\x80secret")])
        assert (await raw_request(gw.url, request))[0] == 400


@pytest.mark.parametrize(
    "header_lines",
    [
        [("X-Api-Key", "exhausted"), ("X-Api-Key", "fresh")],
        [("X-Api-Key", "exhausted"), ("x-api-key", "")],
        [("Cookie", "sid=exhausted; sid=fresh")],
        [("Cookie", "sid=exhausted"), ("Cookie", "theme=dark; sid=fresh")],
    ],
    ids=["two-header-lines", "second-line-empty", "two-cookies-one-line", "two-cookies-two-lines"],
)
async def test_an_identity_source_given_twice_is_rejected(upstream, header_lines):
    """Reproduction: the first value was charged and both were forwarded, so an upstream that
    reads the last value served a client past its exhausted key."""
    async with running_gateway(identity_config(upstream)) as gw:
        status, _, body = await raw_request(gw.url, request_bytes("/by-key/echo", header_lines))
        assert status == 400, body
        assert json.loads(body)["title"] == "Bad Request"


@pytest.mark.parametrize("query", ["key=exhausted&key=fresh", "key=exhausted&key=", "key=a&other=1&key=a"])
async def test_an_identity_query_parameter_given_twice_is_rejected(upstream, query):
    async with running_gateway(identity_config(upstream)) as gw:
        assert (await raw_request(gw.url, request_bytes("/by-key?" + query, [])))[0] == 400


async def test_identity_sources_after_the_one_that_keys_the_request_are_not_judged(upstream):
    """Only the sources read to find the identity can reject a request: `key` is never read
    when X-Api-Key is present, and a route without limits reads none."""
    async with running_gateway(identity_config(upstream)) as gw:
        request = request_bytes("/by-key?key=a&key=b", [("X-Api-Key", "gamma")])
        assert (await raw_request(gw.url, request))[0] == 200
        unlimited = request_bytes("/elsewhere", [(b"X-Api-Key", b"\x80"), (b"X-Api-Key", b"x")])
        assert (await raw_request(gw.url, unlimited))[0] == 404  # routed, not judged


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("header:Connection", "connection is not forwarded as the client sent it"),
        ("header:X-Forwarded-For", "x-forwarded-for is not forwarded as the client sent it"),
        ("header:Forwarded", "forwarded is not forwarded as the client sent it"),
    ],
)
def test_a_header_the_upstream_never_receives_as_sent_cannot_be_an_identity(key, message):
    with pytest.raises(ConfigError) as caught:
        config_from_yaml(f"limits: {{l: {{rate: 1/second, key: [{key}]}}}}\nroutes: [{{match: {{path: /}}, upstream: 'http://h'}}]")
    assert str(caught.value).startswith(f"<test>: limits.l.key[0]: {message}")


def test_header_host_as_an_identity_needs_preserve_host():
    text = "limits: {l: {rate: 1/second, key: [header:Host]}}\nroutes: [{match: {path: /}, upstream: 'http://h', limits: [l]%s}]"
    with pytest.raises(ConfigError, match=r"^<test>: routes\[0\].limits\[0\]: limit 'l' reads header:Host, .* preserve_host: true$"):
        config_from_yaml(text % "")
    config_from_yaml(text % ", preserve_host: true")


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
