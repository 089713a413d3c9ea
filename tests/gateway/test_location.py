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
    ("route_host", "forwarded", "location"),
    [
        ("api.example.com", {"X-Forwarded-Proto": "https", "X-Forwarded-Host": "api.example.com"}, "https://api.example.com/x"),
        ("gw", {"X-Forwarded-Proto": "http", "X-Forwarded-Host": "gw:8080"}, "http://gw:8080/x"),
        ("*.example", {"X-Forwarded-Proto": "https", "X-Forwarded-Host": "a.example, b.example"}, "https://a.example/x"),
        ("*.example", {"X-Forwarded-Proto": "https", "X-Forwarded-Host": "A.B.Example."}, "https://A.B.Example./x"),
        # No host to name, or one that is no host: the path alone (RFC 9110 §10.2.2).
        ("gw", {"X-Forwarded-Proto": "http", "X-Forwarded-Host": ""}, "/x"),
        ("gw", {"X-Forwarded-Proto": "http", "X-Forwarded-Host": "evil.example/phish?"}, "/x"),
        ("gw", {"X-Forwarded-Proto": "javascript", "X-Forwarded-Host": "gw"}, "/x"),
        # A host the route does not name is never reflected; nor any, by a route that names none.
        ("gw", {"X-Forwarded-Proto": "https", "X-Forwarded-Host": "evil.example"}, "/x"),
        ("*.example", {"X-Forwarded-Proto": "https", "X-Forwarded-Host": "example"}, "/x"),
        ("*.example", {"X-Forwarded-Proto": "https", "X-Forwarded-Host": "a.example.evil"}, "/x"),
        (None, {"X-Forwarded-Proto": "https", "X-Forwarded-Host": "api.example.com"}, "/x"),
    ],
)
def test_the_public_origin_is_what_the_gateway_sent_upstream_for_a_host_the_route_names(route_host, forwarded, location):
    headers = CIMultiDict({"Location": "http://up:1/x", "Content-Location": "http://up:1/x", "X-Other": "http://up:1/x"})
    LocationRewrite.of(["http://up:1"], None, route_host).apply(headers, CIMultiDict(forwarded))
    assert headers["Location"] == headers["Content-Location"] == location
    assert headers["X-Other"] == "http://up:1/x"


@pytest.mark.parametrize(
    ("strip", "value", "rewritten"),
    [
        (None, "http://up:1//evil.example/phish", "/%2Fevil.example/phish"),
        (None, "http://up:1/\\evil.example/phish", "/%5Cevil.example/phish"),
        (None, "http://up:1///evil.example", "/%2F/evil.example"),
        (None, "http://up:1/\t/evil.example", "/%09/evil.example"),  # a browser drops the tab: "//evil.example"
        (None, "http://up:1/\r\n/\\evil.example", "/%0D%0A/\\evil.example"),
        (None, "http://up:1?//x", "/?//x"),
        (None, "http://up:1/a//b", "/a//b"),
        ("/svc", "http://up:1//evil.example/phish", "/svc//evil.example/phish"),  # under /svc: no other host
    ],
)
def test_a_path_alone_never_names_another_host(strip, value, rewritten):
    result = LocationRewrite.of(["http://up:1"], strip).rewritten(value, "")
    assert result == rewritten
    assert not result.replace("\t", "").replace("\n", "").replace("\r", "").startswith(("//", "/\\"))


# --- through the gateway ----------------------------------------------------------------------


def redirecting_config(upstream: str, *, trusted: str = "[]", host: str | None = None) -> str:
    named = f", host: '{host}'" if host else ""
    return f"""
trusted_proxies: {trusted}
routes:
  - match: {{path: /svc{named}}}
    upstream: {upstream}
    strip_prefix: true
  - match: {{path: /{named}}}
    upstream: {upstream}
"""


def with_host(request: bytes, host: bytes | None) -> bytes:
    """`request` (from request_bytes) with another Host line, or with none, as HTTP/1.0."""
    if host is None:
        return request.replace(b"Host: gateway.test\r\n", b"").replace(b" HTTP/1.1\r\n", b" HTTP/1.0\r\n", 1)
    return request.replace(b"Host: gateway.test", b"Host: " + host)


async def redirect_of(
    gw_url: str, target: str, headers: list[tuple[str, str]] | None = None, *, host: bytes | None = b"gateway.test"
) -> tuple[str, str]:
    status, lines, _ = await raw_exchange(gw_url, with_host(request_bytes(target, headers or []), host))
    assert status == 302
    return values(lines, "Location")[0], values(lines, "Content-Location")[0]


def asking(value: str) -> str:
    return "/location?value=" + quote(value, safe="")


async def test_a_redirect_to_the_upstream_itself_names_the_gateway_by_a_path(upstream):
    async with running_gateway(redirecting_config(upstream)) as gw:
        location, content_location = await redirect_of(gw.url, asking("{self}/login?next=/a"))
    # The upstream's address is nowhere; the client resolves the path against the URL it asked for.
    assert location == content_location == "/login?next=/a"


async def test_a_route_that_names_its_host_redirects_to_that_host(upstream):
    async with running_gateway(redirecting_config(upstream, host="*.gateway.test")) as gw:
        location, content_location = await redirect_of(gw.url, asking("{self}/login"), host=b"api.gateway.test:8443")
    assert location == content_location == "http://api.gateway.test:8443/login"


@pytest.mark.parametrize("host", [b"evil.example", b"gateway.test", None])
async def test_a_client_host_no_route_names_is_never_reflected(upstream, host):
    async with running_gateway(redirecting_config(upstream)) as gw:
        location, content_location = await redirect_of(gw.url, asking("{self}/login"), host=host)
    assert location == content_location == "/login"


@pytest.mark.parametrize(
    ("sent", "received"),
    [
        ("{self}//evil.example/phish", "/%2Fevil.example/phish"),
        ("{self}/\\evil.example/phish", "/%5Cevil.example/phish"),
        ("{self}/\t/evil.example/phish", "/%09/evil.example/phish"),
    ],
)
@pytest.mark.parametrize("host", [None, b"evil.example"])
async def test_a_rewritten_redirect_never_names_another_host(upstream, sent, received, host):
    async with running_gateway(redirecting_config(upstream)) as gw:
        location, content_location = await redirect_of(gw.url, asking(sent), host=host)
    assert location == content_location == received


async def test_with_strip_prefix_the_prefix_is_put_back(upstream):
    async with running_gateway(redirecting_config(upstream)) as gw:
        location, _ = await redirect_of(gw.url, "/svc" + asking("{self}/login"))
    assert location == "/svc/login"


async def test_other_hosts_and_relative_locations_are_untouched(upstream):
    port = URL(upstream).port
    async with running_gateway(redirecting_config(upstream)) as gw:
        for value in ("https://login.example.com/x", f"http://127.0.0.1:{port + 1}/x", "/relative", "next/page"):
            location, content_location = await redirect_of(gw.url, asking(value))
            assert location == content_location == value


async def test_a_trusted_proxys_scheme_and_host_name_the_public_address(upstream):
    forwarded = [("X-Forwarded-For", "203.0.113.9"), ("X-Forwarded-Proto", "https"), ("X-Forwarded-Host", "api.example.com")]
    config = redirecting_config(upstream, trusted="[127.0.0.1]", host="*.example.com")
    async with running_gateway(config) as gw:
        location, _ = await redirect_of(gw.url, asking("{self}/x"), forwarded, host=b"gw.example.com")
    assert location == "https://api.example.com/x"
    # The same headers from an untrusted client: its own Host, which the route names.
    async with running_gateway(config.replace("[127.0.0.1]", "[]")) as gw:
        location, _ = await redirect_of(gw.url, asking("{self}/x"), forwarded, host=b"gw.example.com")
    assert location == "http://gw.example.com/x"
    # A trusted proxy's host that the route does not name is not reflected either.
    forwarded[2] = ("X-Forwarded-Host", "evil.example")
    async with running_gateway(config) as gw:
        location, _ = await redirect_of(gw.url, asking("{self}/x"), forwarded, host=b"gw.example.com")
    assert location == "/x"
