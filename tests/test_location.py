"""Location and Content-Location naming the upstream's own address are rewritten to the
address the client used (nginx's `proxy_redirect default`); anything else is left alone.

The pure tests call gateway.proxy.location directly; the rest run a gateway in front of the
test upstream, whose /location answers a 302 naming its own origin where asked."""

from __future__ import annotations

from urllib.parse import quote

import pytest
from multidict import CIMultiDict
from yarl import URL

from gateway.proxy.location import LocationRewrite
from gateway.testing import running_gateway
from tests.raw_client import raw_exchange, request_bytes, values

# --- pure -----------------------------------------------------------------------------------

PUBLIC = "https://api.example.com"


@pytest.mark.parametrize(
    ("upstream", "strip", "value", "rewritten"),
    [
        ("http://10.0.0.7:9000", None, "http://10.0.0.7:9000/login?next=/a#top", PUBLIC + "/login?next=/a#top"),
        ("http://10.0.0.7:9000", None, "HTTP://10.0.0.7:9000", PUBLIC + "/"),
        ("http://10.0.0.7:9000", None, "http://10.0.0.7:9000?x=1", PUBLIC + "/?x=1"),
        ("http://up.internal", None, "http://up.internal:80/x", PUBLIC + "/x"),  # the default port, spelt out
        ("http://Up.Internal:80", None, "http://up.internal/x", PUBLIC + "/x"),
        ("https://up.internal", None, "https://up.internal:443/x", PUBLIC + "/x"),
        ("http://[::1]:9000", None, "http://[::1]:9000/x", PUBLIC + "/x"),
        # strip_prefix: the prefix the gateway removed is put back.
        ("http://10.0.0.7:9000", "/svc", "http://10.0.0.7:9000/login", PUBLIC + "/svc/login"),
        ("http://10.0.0.7:9000", "/svc", "http://10.0.0.7:9000/", PUBLIC + "/svc/"),
        ("http://10.0.0.7:9000", "/my docs", "http://10.0.0.7:9000/x", PUBLIC + "/my%20docs/x"),
        # The upstream URL's own path is the root the route serves.
        ("http://10.0.0.7:9000/app", None, "http://10.0.0.7:9000/app/login", PUBLIC + "/login"),
        ("http://10.0.0.7:9000/app", "/svc", "http://10.0.0.7:9000/app", PUBLIC + "/svc/"),
        # Left alone: other addresses, and paths of the upstream this route does not serve.
        ("http://10.0.0.7:9000", None, "http://10.0.0.7:9001/x", None),
        ("http://10.0.0.7:9000", None, "https://10.0.0.7:9000/x", None),
        ("http://10.0.0.7:9000", None, "http://10.0.0.70:9000/x", None),
        ("http://10.0.0.7:9000", None, "http://10.0.0.7:90000/x", None),
        ("http://10.0.0.7:9000", None, "http://user@10.0.0.7:9000/x", None),
        ("http://10.0.0.7:9000", None, "https://login.example.com/?back=http://10.0.0.7:9000/", None),
        ("http://10.0.0.7:9000", None, "/x?back=http://10.0.0.7:9000/", None),
        ("http://10.0.0.7:9000/app", None, "http://10.0.0.7:9000/apple", None),
        ("http://10.0.0.7:9000/app", None, "http://10.0.0.7:9000/other", None),
    ],
)
def test_only_the_upstreams_own_address_is_rewritten(upstream, strip, value, rewritten):
    assert LocationRewrite.of([upstream], strip).rewritten(value, PUBLIC) == rewritten


def test_a_pool_rewrites_the_address_of_each_of_its_targets_and_no_other():
    pool = LocationRewrite.of(["http://10.0.0.5:9000", "http://10.0.0.6:9000"], None)
    assert pool.rewritten("http://10.0.0.5:9000/login", PUBLIC) == PUBLIC + "/login"
    assert pool.rewritten("http://10.0.0.6:9000/login", PUBLIC) == PUBLIC + "/login"
    assert pool.rewritten("http://10.0.0.7:9000/login", PUBLIC) is None


@pytest.mark.parametrize(
    ("forwarded", "location"),
    [
        ({"X-Forwarded-Proto": "https", "X-Forwarded-Host": "api.example.com"}, "https://api.example.com/x"),
        ({"X-Forwarded-Proto": "http", "X-Forwarded-Host": "gw:8080"}, "http://gw:8080/x"),
        ({"X-Forwarded-Proto": "https", "X-Forwarded-Host": "a.example, b.example"}, "https://a.example/x"),
        # No host to name, or one that is no host: the path alone (RFC 9110 §10.2.2).
        ({"X-Forwarded-Proto": "http", "X-Forwarded-Host": ""}, "/x"),
        ({"X-Forwarded-Proto": "http", "X-Forwarded-Host": "evil.example/phish?"}, "/x"),
        ({"X-Forwarded-Proto": "javascript", "X-Forwarded-Host": "gw"}, "/x"),
    ],
)
def test_the_public_origin_is_what_the_gateway_sent_upstream(forwarded, location):
    headers = CIMultiDict({"Location": "http://up:1/x", "Content-Location": "http://up:1/x", "X-Other": "http://up:1/x"})
    LocationRewrite.of(["http://up:1"], None).apply(headers, CIMultiDict(forwarded))
    assert headers["Location"] == headers["Content-Location"] == location
    assert headers["X-Other"] == "http://up:1/x"


# --- through the gateway ----------------------------------------------------------------------


def redirecting_config(upstream: str, *, trusted: str = "[]") -> str:
    return f"""
trusted_proxies: {trusted}
routes:
  - match: {{path: /svc}}
    upstream: {upstream}
    strip_prefix: true
  - match: {{path: /}}
    upstream: {upstream}
"""


async def redirect_of(gw_url: str, target: str, headers: list[tuple[str, str]] | None = None) -> tuple[str, str]:
    status, lines, _ = await raw_exchange(gw_url, request_bytes(target, headers or []))
    assert status == 302
    return values(lines, "Location")[0], values(lines, "Content-Location")[0]


def asking(value: str) -> str:
    return "/location?value=" + quote(value, safe="")


async def test_an_absolute_redirect_to_the_upstream_itself_names_the_gateway(upstream):
    async with running_gateway(redirecting_config(upstream)) as gw:
        location, content_location = await redirect_of(gw.url, asking("{self}/login?next=/a"))
    # request_bytes sends Host: gateway.test; the upstream's address is nowhere.
    assert location == content_location == "http://gateway.test/login?next=/a"


async def test_with_strip_prefix_the_prefix_is_put_back(upstream):
    async with running_gateway(redirecting_config(upstream)) as gw:
        location, _ = await redirect_of(gw.url, "/svc" + asking("{self}/login"))
    assert location == "http://gateway.test/svc/login"


async def test_other_hosts_and_relative_locations_are_untouched(upstream):
    port = URL(upstream).port
    async with running_gateway(redirecting_config(upstream)) as gw:
        for value in ("https://login.example.com/x", f"http://127.0.0.1:{port + 1}/x", "/relative", "next/page"):
            location, content_location = await redirect_of(gw.url, asking(value))
            assert location == content_location == value


async def test_a_trusted_proxys_scheme_and_host_name_the_public_address(upstream):
    forwarded = [("X-Forwarded-For", "203.0.113.9"), ("X-Forwarded-Proto", "https"), ("X-Forwarded-Host", "api.example.com")]
    async with running_gateway(redirecting_config(upstream, trusted="[127.0.0.1]")) as gw:
        location, _ = await redirect_of(gw.url, asking("{self}/x"), forwarded)
    assert location == "https://api.example.com/x"
    async with running_gateway(redirecting_config(upstream)) as gw:  # the same headers from an untrusted client
        location, _ = await redirect_of(gw.url, asking("{self}/x"), forwarded)
    assert location == "http://gateway.test/x"
