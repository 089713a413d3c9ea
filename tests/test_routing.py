"""Which route a request takes: the first route in file order whose path prefix
(on whole segments), methods and host fit, matched on the normalised path.

The pure tests call gateway.proxy.routing directly; the rest go through the
running gateway and tell routes apart by the limit each one applies (named in
RateLimit-Policy) or by the path the echo upstream saw."""

from __future__ import annotations

import aiohttp
import pytest
from yarl import URL

from gateway.proxy.routing import Router
from gateway.testing import config_from_yaml, running_gateway

# --- pure: Router ---------------------------------------------


@pytest.mark.parametrize(
    ("path", "prefix", "matches"),
    [
        ("/api", "/api", True),
        ("/api/", "/api", True),
        ("/api/x", "/api", True),
        ("/apix", "/api", False),
        ("/ap", "/api", False),
        ("/api-v2/x", "/api", False),
        ("/anything", "/", True),
        ("/", "/", True),
        ("/api/reports/1", "/api/reports", True),
        ("/api/reportsx", "/api/reports", False),
    ],
)
def test_a_path_prefix_matches_whole_segments_only(path, prefix, matches):
    config = config_from_yaml(f"routes:\n  - match: {{path: {prefix}}}\n    upstream: http://up.internal\n")
    assert (Router(config.routes).find("GET", "gw", path) is not None) is matches


ROUTER_CONFIG = """
routes:
  - match: {path: /api/reports, methods: [post]}
    upstream: http://reports.internal
  - match: {path: /api, host: API.example.com}
    upstream: http://api-by-host.internal
  - match: {path: /api/}
    upstream: http://api.internal
  - match: {path: /api/reports}
    upstream: http://never.internal
  - match: {path: /static, methods: [GET, HEAD]}
    upstream: http://static.internal
"""


def upstream_for(method: str, host: str, path: str) -> str | None:
    route = Router(config_from_yaml(ROUTER_CONFIG).routes).find(method, host, path)
    return route.upstream if route else None


@pytest.mark.parametrize(
    ("method", "host", "path", "upstream"),
    [
        ("POST", "gw", "/api/reports", "http://reports.internal"),
        ("POST", "gw", "/api/reports/42", "http://reports.internal"),
        # A method the first route does not list falls through to the next route that fits.
        ("GET", "gw", "/api/reports", "http://api.internal"),
        # First match in file order wins, not the longest prefix.
        ("DELETE", "gw", "/api/reports", "http://api.internal"),
        ("GET", "api.example.com", "/api/x", "http://api-by-host.internal"),
        ("GET", "other.example.com", "/api/x", "http://api.internal"),
        ("GET", "gw", "/api", "http://api.internal"),
        ("GET", "gw", "/apix", None),
        ("GET", "gw", "/static/app.js", "http://static.internal"),
        ("HEAD", "gw", "/static/app.js", "http://static.internal"),
        ("POST", "gw", "/static/app.js", None),
        ("GET", "gw", "/", None),
    ],
)
def test_router_takes_the_first_route_that_fits(method, host, path, upstream):
    assert upstream_for(method, host, path) == upstream


def test_no_route_is_ever_reached_after_a_catch_all():
    config = config_from_yaml(
        """
routes:
  - match: {path: /}
    upstream: http://first.internal
  - match: {path: /api}
    upstream: http://second.internal
"""
    )
    assert Router(config.routes).find("GET", "gw", "/api/x").upstream == "http://first.internal"


# --- through the gateway ----------------------------------------------------------------


def routed_config(upstream: str) -> str:
    """Each route applies its own limit, so RateLimit-Policy names the route taken."""
    return f"""
limits:
  reports_post: {{rate: 1/hour, burst: 1}}
  by_host: {{rate: 1000/minute}}
  api: {{rate: 1000/minute}}
  reports_get: {{rate: 1000/minute}}
  svc: {{rate: 1000/minute}}
  rest: {{rate: 1000/minute}}
routes:
  - match: {{path: /api/reports, methods: [POST]}}
    upstream: {upstream}
    limits: [reports_post]
  - match: {{path: /api, host: api.example.com}}
    upstream: {upstream}
    limits: [by_host]
  - match: {{path: /api}}
    upstream: {upstream}
    limits: [api]
  - match: {{path: /api/reports}}
    upstream: {upstream}
    limits: [reports_get]
  - match: {{path: /svc}}
    upstream: {upstream}
    strip_prefix: true
    limits: [svc]
  - match: {{path: /}}
    upstream: {upstream}
    limits: [rest]
"""


def policy_name(response: aiohttp.ClientResponse) -> str | None:
    policy = response.headers.get("RateLimit-Policy")
    return policy.split(";")[0].strip('"') if policy else None


@pytest.fixture
async def gw(upstream):
    async with running_gateway(routed_config(upstream)) as gateway:
        yield gateway



async def route_taken(client: aiohttp.ClientSession, method: str, url: str, **kwargs) -> str | None:
    async with client.request(method, URL(url, encoded=True), **kwargs) as response:
        assert response.status in (200, 429)
        return policy_name(response)


async def test_first_match_in_file_order_wins_with_methods_and_host(gw, client):
    assert await route_taken(client, "POST", gw.url + "/api/reports") == "reports_post"
    assert await route_taken(client, "GET", gw.url + "/api/reports") == "api"
    assert await route_taken(client, "GET", gw.url + "/api/users") == "api"
    assert await route_taken(client, "GET", gw.url + "/api/users", headers={"Host": "api.example.com"}) == "by_host"
    assert await route_taken(client, "GET", gw.url + "/api/users", headers={"Host": "API.Example.com:8080"}) == "by_host"
    assert await route_taken(client, "GET", gw.url + "/api/users", headers={"Host": "other.example.com"}) == "api"


@pytest.mark.parametrize("host", ["api.example.com", "API.EXAMPLE.COM", "api.example.com:443", "api.example.com."])
async def test_host_matching_ignores_case_port_and_a_trailing_dot(gw, client, host):
    assert await route_taken(client, "GET", gw.url + "/api/users", headers={"Host": host}) == "by_host"


async def test_the_upstream_url_path_is_prefixed_to_the_request_path(upstream, client):
    config = f"""
routes:
  - match: {{path: /}}
    upstream: {upstream}/echo/base/
"""
    async with running_gateway(config) as gw:
        async with client.get(gw.url + "/x/y?z=1") as response:
            assert (await response.json())["path"] == "/echo/base/x/y?z=1"


async def test_a_prefix_matches_whole_segments_through_the_gateway(gw, client):
    assert await route_taken(client, "GET", gw.url + "/api") == "api"
    assert await route_taken(client, "GET", gw.url + "/apix") == "rest"
    assert await route_taken(client, "GET", gw.url + "/api-v2/x") == "rest"


@pytest.mark.parametrize(
    "disguise",
    ["/x/../api/reports", "//api//reports", "/api/./reports", "/api/x/%2e%2e/reports", "/%61pi/reports"],
)
async def test_a_disguised_path_still_gets_the_limits_of_its_route(gw, client, disguise):
    async with client.post(gw.url + "/api/reports") as response:
        assert response.status == 200
        assert policy_name(response) == "reports_post"
    async with client.post(URL(gw.url + disguise, encoded=True)) as response:
        assert policy_name(response) == "reports_post"
        assert response.status == 429


async def test_strip_prefix_removes_the_matched_prefix_before_forwarding(gw, client):
    cases = {
        "/svc/echo/a?x=1&y=2": "/echo/a?x=1&y=2",
        "/svc": "/",
        "/svc/": "/",
        "/svc/echo/with%20space": "/echo/with%20space",
        "/svc/x/../echo/b": "/echo/b",
        "/x/../svc/echo/c": "/echo/c",
    }
    for sent, seen in cases.items():
        async with client.get(URL(gw.url + sent, encoded=True)) as response:
            assert response.status == 200
            assert policy_name(response) == "svc"
            assert (await response.json())["path"] == seen


async def test_strip_prefix_keeps_an_encoded_slash_in_the_rest_of_the_path(gw, client):
    # An ID such as "group%2Fproject" must reach the upstream as one segment.
    async with client.get(URL(gw.url + "/svc/echo/projects/group%2Fproject", encoded=True)) as response:
        assert response.status == 200
        assert (await response.json())["path"] == "/echo/projects/group%2Fproject"


async def test_without_strip_prefix_the_path_is_forwarded_as_sent(gw, client):
    async with client.get(URL(gw.url + "/api/echo/a%2Fb?q=%20", encoded=True)) as response:
        assert policy_name(response) == "api"
        assert (await response.json())["path"] == "/api/echo/a%2Fb?q=%20"
