"""Properties of the client identity, checked with Hypothesis.

The property: for any request the gateway forwards, the identity the
limiter charged equals the identity computed from the request as the upstream
receives it. The fuzzing: arbitrary header values, X-Forwarded-For
chains, cookies, query strings and bearer tokens end in a bucket of a fixed-length
key, the ip fallback, or a 400 (401 for a bad token where the config says so);
never a 500, and never a bucket the upstream would not recognise.

How it is observed, with real parts only: each example gets a fresh in-process
gateway in front of the echo upstream (its config, one of a few, parsed once), and one
limit with a burst of 1000. The request R goes over a raw socket from 127.0.0.1
(untrusted) or 127.0.0.2 (a trusted proxy). If it is forwarded, the echo shows what the upstream received;
`upstream_identity` below, written from the rules in docs/configuration.md and not from the
gateway's code, computes the identity from that alone. A probe P carrying only
that identity, in its plainest form, then follows: R's RateLimit header said
r=999 (a fresh bucket charged once), and P must say r=998, the same bucket
charged again. Any other bucket would say 999.
"""

from __future__ import annotations

import functools
import ipaddress
import re
import time
import urllib.parse

import jwt
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from yarl import URL

from gateway.config import GatewayConfig
from gateway.limiter.keys import DIGEST_BYTES, bucket_key, identity_digest
from gateway.testing import config_from_yaml, running_gateway
from tests.raw_client import echoed, raw_request, request_bytes

UNTRUSTED, TRUSTED = "127.0.0.1", "127.0.0.2"
TRUSTED_NETWORKS = [ipaddress.ip_network(f"{TRUSTED}/32"), ipaddress.ip_network("10.0.0.0/8")]
SECRET = "property-test-secret-of-32-bytes-or-more"
BURST = 1000
SOURCES = ("jwt:sub", "header:x-api-key", "query:key", "cookie:sid", "ip")
SETTINGS = settings(
    max_examples=400,  # a few ms each: a fresh gateway per example is cheap
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@functools.cache
def parsed_config(text: str) -> GatewayConfig:
    """`text` parsed, once per text: a GatewayConfig is frozen, and a few key orders and
    two forwarded_headers settings make all the configs the examples run."""
    return config_from_yaml(text, environ={"JWT_SECRET": SECRET})


def property_config(upstream: str, forwarded_headers: str, sources: tuple[str, ...] = SOURCES) -> str:
    return f"""
trusted_proxies: [{TRUSTED}/32, 10.0.0.0/8]
forwarded_headers: {forwarded_headers}
jwt: {{secret_env: JWT_SECRET}}
limits:
  per_client: {{rate: 1/hour, burst: {BURST}, key: [{", ".join(sources)}]}}
routes:
  - match: {{path: /}}
    upstream: {upstream}
    limits: [per_client]
"""


# --- what a client may send ------------------------------------------------------------------

# Header values as bytes: anything but the CR, LF and NUL that frame the message, weighted
# toward the characters that have split identities before (non-ASCII, ';', ',', '"', spaces).
value_bytes = st.one_of(
    st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=12).map(str.encode),
    st.binary(max_size=12).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"").replace(b"\x00", b"")),
    st.sampled_from([b"alpha", b"\x80alpha", b"alpha beta", b"a;b", b"a,b", b'"q"', b" ", b"\xc3\xa9", b"\tx"]),
)
xff_entry = st.one_of(
    st.ip_addresses().map(str),
    st.sampled_from(
        [
            "10.0.0.1", "10.9.9.9", TRUSTED, UNTRUSTED, "2001:db8::5%1", "2001:db8::5%eth0", "[2001:db8::5%25eth0]:443",
            "[2001:db8::1]:443", "192.0.2.1:8080", "::ffff:192.0.2.2", "::ffff:10.0.0.3", "unknown", "", " 192.0.2.3 ",
            "1.2.3.4.5", "\udc801.2.3.4", "_hidden",
        ]
    ),
)
xff_line = st.lists(xff_entry, max_size=4).map(", ".join)
cookie_pair = st.tuples(st.sampled_from(["sid", "SID", " sid", "theme", "sid ", "\x80sid"]), value_bytes).map(
    lambda p: p[0].encode("latin-1") + b"=" + p[1].replace(b";", b"")
)
cookie_line = st.lists(cookie_pair, min_size=1, max_size=3).map(b"; ".join)
visible_text = st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=12)
query_value = st.one_of(
    visible_text.map(lambda t: urllib.parse.quote(t, safe="")),
    visible_text.map(lambda t: urllib.parse.quote_plus(t, safe="/:@!$'()*,")),
    st.text(max_size=8).map(lambda t: urllib.parse.quote(t, safe="")),
    st.sampled_from(["alpha", "%80alpha", "a%3Bb", "a;b", "a+b", "", "caf%C3%A9", "%00"]),
)
query_part = st.one_of(
    st.tuples(st.just("key"), query_value).map("=".join),
    st.tuples(st.just("key"), query_value).map("=".join),
    st.just("other=1"),
    st.just("key"),
    st.just("%80key=a"),
)
connection_tokens = st.lists(
    st.sampled_from(["keep-alive", "x-api-key", "Cookie", "x-forwarded-for", "Forwarded", "X-Other", "authorization"]),
    min_size=1,
    max_size=2,
).map(", ".join)


def signed(sub: str, *, valid: bool) -> str:
    claims = {"sub": sub, "exp": int(time.time()) + (600 if valid else -600)}
    return jwt.encode(claims, SECRET, algorithm="HS256")


authorization = st.one_of(
    st.builds(lambda sub: "Bearer " + signed(sub, valid=True), st.sampled_from(["alice", "bob", "x y", "caf\u00e9"])),
    st.builds(lambda sub: "Bearer " + signed(sub, valid=False), st.sampled_from(["alice", "mallory"])),
    st.sampled_from(["Bearer not.a.token", "Basic dXNlcjpwYXNz", "Bearer ", "bearer a.b.c"]),
)


def few(values: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly none or one, sometimes two: enough requests are forwarded to test the property."""
    none, one, two = st.just([]), st.lists(values, min_size=1, max_size=1), st.lists(values, min_size=2, max_size=2)
    return st.one_of(none, none, one, one, two)


@st.composite
def client_requests(draw):
    lines: list[tuple[bytes, bytes]] = []
    lines += [(b"X-Api-Key", v) for v in draw(few(value_bytes))]
    lines += [(b"Cookie", v) for v in draw(few(cookie_line))]
    lines += [(b"X-Forwarded-For", v.encode("utf-8", "surrogateescape")) for v in draw(few(xff_line))]
    lines += [(b"Authorization", v.encode("utf-8")) for v in draw(few(authorization))]
    if draw(st.integers(0, 3)) == 0:
        lines.append((b"Connection", draw(connection_tokens).encode()))
    lines = draw(st.permutations(lines))
    query = "&".join(draw(few(query_part)))
    target = "/echo" + ("?" + query if query else "")
    return draw(st.sampled_from([UNTRUSTED, TRUSTED])), target, lines


key_orders = st.permutations(SOURCES[:-1]).map(lambda order: (*order, "ip"))


# --- the identity as the upstream can compute it ------------------------------------------------


def _address(text: str) -> str | None:
    text = text.strip()
    if text.startswith("[") and "]" in text:
        text = text[1 : text.index("]")]
    elif text.count(":") == 1:
        text = text.partition(":")[0]
    try:
        address = ipaddress.ip_address(text.partition("%")[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
    return str(address)


def _trusted(address: str) -> bool:
    return any(ipaddress.ip_address(address) in network for network in TRUSTED_NETWORKS)


def upstream_identity(echo: dict, peer: str, order: tuple[str, ...] = SOURCES) -> str:
    """The rules of docs/configuration.md, applied to what the upstream received: the first source of `order`
    present, else the ip. The upstream trusts the
    gateway, so the last X-Forwarded-For entry is the peer the gateway saw; from there the
    chain is read right to left, skipping trusted proxies."""
    headers = [(name.lower(), value) for name, value in echo["headers"]]

    def single(name: str) -> str | None:
        values = [v for n, v in headers if n == name]
        assert len(values) <= 1, f"{name} forwarded {len(values)} times"
        return values[0] if values else None

    entries = [e.strip() for n, v in headers if n == "x-forwarded-for" for e in v.split(",")]
    entries = [e for e in entries if e]
    assert _address(entries[-1]) == peer, "the gateway's hop ends X-Forwarded-For"
    client = peer
    if _trusted(peer):
        for entry in reversed(entries[:-1]):
            address = _address(entry)
            if address is None:
                break
            client = address
            if not _trusted(address):
                break

    def read(source: str) -> str | None:
        """A source's value; only sources read before the identity is found must be single."""
        if source == "ip":
            return client
        if source == "jwt:sub":
            token = single("authorization")
            if token and token.lower().startswith("bearer "):
                try:
                    return jwt.decode(token[7:].strip(), SECRET, algorithms=["HS256"]).get("sub")
                except jwt.InvalidTokenError:
                    return None
            return None
        if source == "header:x-api-key":
            return single("x-api-key")
        if source == "query:key":
            query = URL(echo["path"], encoded=True).query.getall("key", [])
            assert len(query) <= 1, "key forwarded more than once"
            return query[0] if query else None
        cookies = [
            value.strip()
            for n, line in headers
            if n == "cookie"
            for name, sep, value in (pair.partition("=") for pair in line.split(";"))
            if sep and name.strip() == "sid"
        ]
        assert len(cookies) <= 1, "sid forwarded more than once"
        value = cookies[0] if cookies else ""
        return value[1:-1] if len(value) >= 2 and value[0] == value[-1] == '"' else value

    for source in order:
        value = read(source)
        if value:
            return f"{source}={value}"
    raise AssertionError("ip is always last")


def probe(identity: str) -> tuple[str, str, list[tuple[str, str]]]:
    """A request carrying `identity` and nothing else: (peer, target, header lines)."""
    source, _, value = identity.partition("=")
    if source == "jwt:sub":
        return UNTRUSTED, "/echo", [("Authorization", "Bearer " + signed(value, valid=True))]
    if source == "header:x-api-key":
        return UNTRUSTED, "/echo", [("X-Api-Key", value)]
    if source == "query:key":
        return UNTRUSTED, "/echo?key=" + urllib.parse.quote(value, safe=""), []
    if source == "cookie:sid":
        return UNTRUSTED, "/echo", [("Cookie", "sid=" + value)]
    if value in (UNTRUSTED, TRUSTED):
        return value, "/echo", []
    return TRUSTED, "/echo", [("X-Forwarded-For", value)]


def remaining(headers: dict[str, list[str]]) -> int:
    return int(re.search(r";r=(\d+)", headers["ratelimit"][0]).group(1))


# --- the properties ----------------------------------------------------------------------------


# The reported reproductions and what the fuzzing found, always tried first.
REPRODUCTIONS = [
    (UNTRUSTED, "/echo", [(b"X-Api-Key", b"throwaway-1"), (b"Connection", b"X-Api-Key")]),
    (UNTRUSTED, "/echo", [(b"X-Api-Key", b"\x80secretkey")]),
    (UNTRUSTED, "/echo", [(b"X-Api-Key", b"exhausted"), (b"X-Api-Key", b"fresh")]),
    (UNTRUSTED, "/echo?key=exhausted&key=fresh", []),
    (UNTRUSTED, "/echo", [(b"Cookie", b"sid=exhausted; sid=fresh")]),
    (UNTRUSTED, "/echo", [(b"Cookie", b"\x80sid=abc")]),  # the byte is dropped on the way out
    (TRUSTED, "/echo", [(b"X-Forwarded-For", b"\x801.2.3.4")]),  # and here turns garbage into an address
    (TRUSTED, "/echo", [(b"X-Forwarded-For", b"2001:db8::5%eth0"), (b"Connection", b"X-Forwarded-For")]),
]


def with_reproductions(test):
    for sent in REPRODUCTIONS:
        test = example(sent=sent, order=SOURCES)(test)
    return test


@pytest.mark.parametrize("forwarded_headers", ["replace", "append"])
@SETTINGS
@with_reproductions
@given(sent=client_requests(), order=key_orders)
async def test_the_limiter_charges_the_client_the_upstream_sees(upstream, forwarded_headers, sent, order):
    peer, target, lines = sent
    async with running_gateway(parsed_config(property_config(upstream, forwarded_headers, order))) as gw:
        status, headers, body = await raw_request(gw.url, request_bytes(target, lines), local_host=peer)
        assert status in (200, 400), body
        event(f"status {status}")
        if status == 400:
            # Refused by the gateway, never charged: the echo upstream only ever answers 200.
            assert "ratelimit" not in headers
            assert b"Traceback" not in body
            return
        assert remaining(headers) == BURST - 1  # a fresh bucket, charged once
        identity = upstream_identity(echoed(body), peer, order)
        event("keyed by " + identity.partition("=")[0])
        probe_peer, probe_target, probe_lines = probe(identity)
        status, headers, _ = await raw_request(gw.url, request_bytes(probe_target, probe_lines), local_host=probe_peer)
        assert status == 200
        assert remaining(headers) == BURST - 2, f"R was charged to another bucket than {identity!r}"


@SETTINGS
@given(token=st.one_of(st.text(max_size=200), st.binary(max_size=200).map(lambda b: b.decode("latin-1"))))
async def test_with_on_invalid_reject_any_authorization_value_is_401_400_or_the_fallback(upstream, token):
    config = parsed_config(
        property_config(upstream, "replace").replace("{secret_env: JWT_SECRET}", "{secret_env: JWT_SECRET, on_invalid: reject}")
    )
    value = token.encode("utf-8", "surrogateescape").replace(b"\r", b"").replace(b"\n", b"").replace(b"\x00", b"")
    async with running_gateway(config) as gw:
        status, headers, body = await raw_request(gw.url, request_bytes("/echo", [(b"Authorization", b"Bearer " + value)]))
        assert status in (200, 400, 401), body
        if status == 200:
            assert upstream_identity(echoed(body), UNTRUSTED) == "ip=" + UNTRUSTED  # only the fallback
        if status == 401:
            assert headers["www-authenticate"] == ['Bearer error="invalid_token"']


@settings(max_examples=300)
@given(identity=st.text(max_size=300), secret=st.binary(min_size=32, max_size=64))
def test_any_identity_gives_a_bucket_key_of_one_length(identity, secret):
    key = bucket_key("rl:", "per_client", identity_digest(secret, identity))
    assert len(key) == len("rl:per_client:{}") + 2 * DIGEST_BYTES
    assert re.fullmatch(r"rl:per_client:\{[0-9a-f]+\}", key)
