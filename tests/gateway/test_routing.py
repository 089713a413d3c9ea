"""Which route a request takes: the first route in file order whose path prefix
(on whole segments), methods and host fit, matched on the normalised path.

The pure tests call gateway.proxy.routing directly; the rest go through the
running gateway and tell routes apart by the limit each one applies (named in
RateLimit-Policy) or by the path the echo upstream saw."""

from __future__ import annotations

import random
import time

import aiohttp
import pytest
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from gateway.proxy.routing import Router, covers, shadowed
from gateway.testing import config_from_yaml, running_gateway
from tests.processes import GatewayProcess
from tests.raw_client import raw_exchange, request_bytes

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


def test_no_route_is_ever_reached_after_a_catch_all_and_check_names_it():
    """A shadowed route loads (first match in file order stays the rule); `shadowed` names
    it, and `gateway check` warns with that (tests/gateway/test_cli.py)."""
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
    assert shadowed(config.routes) == [(1, 0)]


# --- through the gateway ----------------------------------------------------------------


def routed_config(upstream: str) -> str:
    """Each route applies its own limit, so RateLimit-Policy names the route taken."""
    return f"""
limits:
  reports_post: {{rate: 1/hour, burst: 1}}
  by_host: {{rate: 1000/minute}}
  api: {{rate: 1000/minute}}
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


# --- exact, regex, host wildcards, header and query conditions --------------------------

FORMS_CONFIG = """
routes:
  - match: {exact: /api/health}
    upstream: http://exact.internal
  - match: {regex: "/api/v[0-9]+/users/[^/]+"}
    upstream: http://regex.internal
  - match: {regex: "/files/.*\\\\.JSON", case_sensitive: false}
    upstream: http://regex-nocase.internal
  - match: {path: /api, host: "*.example.com"}
    upstream: http://wildcard.internal
  - match: {path: /api, headers: {X-Version: "2", X-Beta: {present: true}}}
    upstream: http://v2-beta.internal
  - match: {path: /api, headers: {X-Version: {regex: "3\\\\..*"}, X-Legacy: {present: false}}}
    upstream: http://v3.internal
  - match: {path: /api, query: {debug: "1"}}
    upstream: http://debug.internal
  - match: {path: /api, query: {trace: {present: true}, mode: {regex: "a|b"}}}
    upstream: http://trace.internal
  - match: {path: /}
    upstream: http://rest.internal
"""


def found(path: str, *, host: str = "gw", headers: dict | list | None = None, target: str = "/") -> str | None:
    router = Router(config_from_yaml(FORMS_CONFIG).routes)
    route = router.find("GET", host, path, CIMultiDictProxy(CIMultiDict(headers or {})), URL(target))
    return route.upstream.removeprefix("http://").removesuffix(".internal") if route else None


@pytest.mark.parametrize(
    ("path", "upstream"),
    [
        ("/api/health", "exact"),
        ("/api/health/", "rest"),  # exact is exact: no trailing slash, no segment below
        ("/api/health/x", "rest"),
        ("/api/healthz", "rest"),
        ("/API/health", "rest"),
        ("/api/v2/users/ann", "regex"),
        ("/api/v10/users/ann", "regex"),
        ("/api/v2/users/ann/orders", "rest"),  # a regex matches the whole path, never a prefix of it
        ("/x/api/v2/users/ann", "rest"),
        ("/api/vx/users/ann", "rest"),
        ("/files/a/b.json", "regex-nocase"),
        ("/FILES/a/B.Json", "regex-nocase"),
        ("/files/a/b.jsonx", "rest"),
    ],
)
def test_exact_and_regex_paths(path, upstream):
    assert found(path) == upstream


@pytest.mark.parametrize(
    ("host", "upstream"),
    [
        ("a.example.com", "wildcard"),
        ("a.b.example.com", "wildcard"),  # one or more labels, as Envoy and nginx
        ("example.com", "rest"),  # never the bare domain
        ("aexample.com", "rest"),
        ("a.example.com.evil", "rest"),
    ],
)
def test_a_host_wildcard_takes_one_or_more_labels_under_its_domain(host, upstream):
    assert found("/api/x", host=host) == upstream


@pytest.mark.parametrize(
    ("headers", "upstream"),
    [
        ({"X-Version": "2", "X-Beta": ""}, "v2-beta"),  # present, even empty
        ({"x-version": "2", "x-beta": "yes"}, "v2-beta"),  # names ignore case
        ({"X-Version": "2"}, "rest"),  # every condition must hold
        ({"X-Version": "20", "X-Beta": "1"}, "rest"),  # exact is exact
        ({"X-Version": "3.1"}, "v3"),
        ({"X-Version": "3.1", "X-Legacy": "1"}, "rest"),  # present: false means absent
        ({"X-Version": "31"}, "rest"),
        ({"X-Version": "x3.1"}, "rest"),  # a regex matches the whole value
    ],
)
def test_header_conditions(headers, upstream):
    assert found("/api/x", headers=headers) == upstream


@pytest.mark.parametrize(
    ("target", "upstream"),
    [
        ("/api/x?debug=1", "debug"),
        ("/api/x?debug=%31", "debug"),  # values are compared decoded
        ("/api/x?debug", "rest"),
        ("/api/x?trace&mode=a", "trace"),
        ("/api/x?trace=&mode=b", "trace"),
        ("/api/x?trace&mode=ab", "rest"),
        ("/api/x?mode=a", "rest"),
    ],
)
def test_query_conditions(target, upstream):
    assert found("/api/x", target=target) == upstream


def test_a_hostile_input_to_a_backtracking_pattern_is_answered_at_once():
    """(a+)+$ takes Python's re minutes on 30 characters; RE2 is linear in the input, so
    these take milliseconds and the bound leaves a loaded machine seconds to spare."""
    config = config_from_yaml(
        """
routes:
  - match: {regex: "/(a+)+b", headers: {X-A: {regex: "(x+x+)+y"}}}
    upstream: http://regex.internal
"""
    )
    router = Router(config.routes)
    hostile_path = "/" + "a" * 20_000
    started = time.perf_counter()
    assert router.find("GET", "gw", hostile_path) is None
    assert router.find("GET", "gw", "/aab", CIMultiDictProxy(CIMultiDict({"X-A": "x" * 20_000}))) is None
    assert router.find("GET", "gw", "/aab", CIMultiDictProxy(CIMultiDict({"X-A": "xxy"}))) is not None
    assert time.perf_counter() - started < 5.0


# --- shadowing (gateway check's warning) --------------------------------------------------


def match_of(spec: str):
    return config_from_yaml(f"routes:\n  - match: {spec}\n    upstream: http://u.internal\n").routes[0].match


@pytest.mark.parametrize(
    ("earlier", "later", "shadows"),
    [
        ("{path: /}", "{regex: '/x.*', headers: {X-A: '1'}}", True),
        ("{path: /api}", "{path: /api/reports}", True),
        ("{path: /api}", "{path: /api}", True),
        ("{path: /api}", "{path: /apix}", False),
        ("{path: /api/reports}", "{path: /api}", False),
        ("{path: /api}", "{exact: /api/x}", True),
        ("{path: /api}", "{regex: '/api/.*'}", False),  # not certain, so not reported
        ("{path: /api, methods: [GET]}", "{path: /api/x}", False),
        ("{path: /api, methods: [GET, POST]}", "{path: /api/x, methods: [GET]}", True),
        ("{path: /api}", "{path: /api/x, methods: [GET], host: a.example.com}", True),
        ("{path: /api, host: a.example.com}", "{path: /api/x}", False),
        ("{path: /api, host: '*.example.com'}", "{path: /api, host: a.example.com}", True),
        ("{path: /api, host: '*.example.com'}", "{path: /api, host: '*.b.example.com'}", True),
        ("{path: /api, host: '*.example.com'}", "{path: /api, host: example.com}", False),
        ("{path: /api, headers: {X-A: '1'}}", "{path: /api}", False),
        ("{path: /api, headers: {X-A: '1'}}", "{path: /api/x, headers: {X-A: '1', X-B: '2'}}", True),
        ("{path: /api, query: {q: {present: true}}}", "{path: /api, query: {q: '1'}}", False),  # implied, but not reported
        ("{path: /api}", "{path: /API/x, case_sensitive: false}", False),
        ("{path: /API, case_sensitive: false}", "{path: /api/x}", True),
        ("{exact: /a}", "{exact: /a}", True),
        ("{exact: /a}", "{exact: /a/}", False),
        ("{regex: '/a/[0-9]+'}", "{exact: /a/42}", True),
        ("{regex: '/a/[0-9]+'}", "{exact: /a/x}", False),
        ("{regex: '/a/[0-9]+'}", "{regex: '/a/[0-9]+'}", True),
        ("{regex: '/a/[0-9]+'}", "{path: /a}", False),
    ],
)
def test_covers_reports_only_certain_shadowing(earlier, later, shadows):
    assert covers(match_of(earlier), match_of(later)) is shadows


def test_shadowed_names_each_unreachable_route_once_with_the_first_route_that_hides_it():
    routes = config_from_yaml(ROUTER_CONFIG).routes
    assert shadowed(routes) == [(3, 2)]  # /api/reports after /api/


SHADOW_SPECS = [
    "{path: /}", "{path: /api}", "{path: /api/reports}", "{path: /apix}", "{exact: /api}", "{exact: /api/x}",
    "{path: /API, case_sensitive: false}", "{path: /api/X, case_sensitive: false}", "{regex: '/api/.*'}",
    "{regex: '/a/[0-9]+'}", "{exact: /a/42}", "{path: /a}", "{path: /api, methods: [GET]}",
    "{path: /api/x, headers: {X-A: '1'}}", "{path: /api, host: '*.example.com'}", "{path: /api/x, host: a.example.com}",
    "{path: /, case_sensitive: false}", "{exact: /API/X, case_sensitive: false}",
]


def test_shadowed_finds_what_comparing_every_pair_of_routes_finds():
    """`shadowed` looks up only the routes that could cover each one; the pairs it reports
    are those a comparison of every later route with every earlier one reports."""

    def every_pair(routes):
        pairs = []
        for later in range(len(routes)):
            first = next((e for e in range(later) if covers(routes[e].match, routes[later].match)), None)
            if first is not None:
                pairs.append((later, first))
        return pairs

    class Route:
        def __init__(self, spec):
            self.match = match_of(spec)

    pool = [Route(spec) for spec in SHADOW_SPECS]
    randomness = random.Random(7)
    found = 0
    for _ in range(300):
        routes = randomness.choices(pool, k=randomness.randint(1, 12))
        assert shadowed(routes) == every_pair(routes), [r.match for r in routes]
        found += bool(every_pair(routes))
    assert found > 100  # the lists do shadow one another, often


# --- the same, through the gateway ----------------------------------------------------------


def forms_through_gateway(upstream: str) -> str:
    """Each route applies its own limit, so RateLimit-Policy names the route taken."""
    routes = [
        ("exact", "{exact: /echo/health}"),
        ("regex", "{regex: '/echo/v[0-9]+/users/[^/]+'}"),
        ("wildcard", "{path: /echo, host: '*.example.com'}"),
        ("header", "{path: /echo, headers: {X-Version: '2', X-Beta: {present: true}}}"),
        ("header_regex", "{path: /echo, headers: {X-Version: {regex: '3\\..*'}}}"),
        ("query", "{path: /echo, query: {debug: '1'}}"),
        ("absent", "{path: /echo, headers: {X-Legacy: {present: false}}}"),
        ("rest", "{path: /}"),
    ]
    limits = "".join(f"  {name}: {{rate: 1000/minute}}\n" for name, _ in routes)
    listed = "".join(f"  - match: {spec}\n    upstream: {upstream}\n    limits: [{name}]\n" for name, spec in routes)
    return f"limits:\n{limits}routes:\n{listed}"


@pytest.fixture
async def forms_gw(upstream):
    async with running_gateway(forms_through_gateway(upstream)) as gateway:
        yield gateway


@pytest.mark.parametrize(
    ("target", "headers", "route"),
    [
        ("/echo/health", {}, "exact"),
        ("/echo/health", {"X-Legacy": "1"}, "exact"),
        ("/echo/health/", {"X-Legacy": "1"}, "rest"),
        ("/echo/v2/users/ann", {"X-Legacy": "1"}, "regex"),
        ("/echo/v2/users/ann/x", {"X-Legacy": "1"}, "rest"),
        ("/echo/x", {"Host": "a.example.com", "X-Legacy": "1"}, "wildcard"),
        ("/echo/x", {"Host": "A.B.Example.com:8080", "X-Legacy": "1"}, "wildcard"),
        ("/echo/x", {"Host": "example.com", "X-Legacy": "1"}, "rest"),
        ("/echo/x", {"X-Version": "2", "X-Beta": "", "X-Legacy": "1"}, "header"),
        ("/echo/x", {"X-Version": "2", "X-Legacy": "1"}, "rest"),
        ("/echo/x", {"X-Version": "3.7", "X-Legacy": "1"}, "header_regex"),
        ("/echo/x?debug=1", {"X-Legacy": "1"}, "query"),
        ("/echo/x?debug=0", {"X-Legacy": "1"}, "rest"),
        ("/echo/x", {}, "absent"),
    ],
)
async def test_each_match_form_through_the_gateway(forms_gw, client, target, headers, route):
    async with client.get(URL(forms_gw.url + target, encoded=True), headers=headers) as response:
        assert response.status == 200
        assert policy_name(response) == route
        assert (await response.json())["path"] == target  # forwarded as sent


async def test_a_regex_route_matches_the_normalised_path(forms_gw, client):
    async with client.get(URL(forms_gw.url + "/echo/x/../v2/users/%61nn", encoded=True), headers={"X-Legacy": "1"}) as response:
        assert policy_name(response) == "regex"
        assert (await response.json())["path"] == "/echo/v2/users/ann"


async def test_hostile_input_to_backtracking_patterns_gets_its_answer_at_once(upstream):
    """A gateway process as users start it, with patterns that make Python's re backtrack
    for hours on these inputs: each request is answered in well under a second."""
    config = f"""
routes:
  - match: {{regex: "/(a+)+b", headers: {{X-A: {{regex: "(x+x+)+y"}}}}}}
    upstream: {upstream}
  - match: {{path: /}}
    upstream: {upstream}
"""
    with GatewayProcess(config) as gw:
        async with aiohttp.ClientSession() as client:
            started = time.perf_counter()
            async with client.get(gw.url + "/" + "a" * 4000, headers={"X-A": "x" * 8000}) as response:
                assert response.status == 200
                assert (await response.json())["path"] == "/" + "a" * 4000  # the catch-all took it
            assert time.perf_counter() - started < 10.0  # backtracking would take hours


@pytest.mark.parametrize(
    ("target", "value", "status"),
    [
        ("/echo/x", b"\xff\xfe 3.1", 400),  # not UTF-8
        ("/echo/x?debug=%ff%fe&debug=%zz", b"1", 400),
        # The header_regex route takes it before any route reads the query.
        ("/echo/x?debug=" + "%C3%A9" * 1000, b"3." + b"9" * 7000, 200),
        ("/echo/x?debug=" + "%C3%A9" * 1000, b"1", 400),
    ],
)
async def test_odd_bytes_in_header_and_query_conditions_are_a_400_not_a_500(forms_gw, target, value, status):
    answered, _, body = await raw_exchange(forms_gw.url, request_bytes(target, [(b"X-Version", value)]))
    assert answered == status, body


BYPASS_CONFIG = """
limits:
  by_header: {{rate: 1/hour, burst: 1}}
  by_query: {{rate: 1/hour, burst: 1}}
routes:
  - match: {{path: /echo, headers: {{X-Debug: "1"}}}}
    upstream: {upstream}
    limits: [by_header]
  - match: {{path: /echo, query: {{debug: "1"}}}}
    upstream: {upstream}
    limits: [by_query]
  - match: {{path: /}}
    upstream: {upstream}
"""


@pytest.fixture
async def bypass_gw(upstream):
    async with running_gateway(BYPASS_CONFIG.format(upstream=upstream)) as gateway:
        # Each conditional route's one request is spent, so reaching the upstream now means
        # the request took the unlimited route.
        for target, lines in (("/echo", [(b"X-Debug", b"1")]), ("/echo?debug=1", [])):
            for expected in (200, 429):
                status, _, _ = await raw_exchange(gateway.url, request_bytes(target, lines))
                assert status == expected
        yield gateway


@pytest.mark.parametrize(
    ("target", "lines"),
    [
        ("/echo", [(b"X-Debug", b"\x801")]),  # the header writer dropped \x80: the upstream got "1"
        ("/echo", [(b"X-Debug", b"\xc0\xaf1")]),
        ("/echo", [(b"X-Debug", b"1"), (b"X-Debug", b"1")]),  # matched as "1, 1"; either line reads 1
        ("/echo", [(b"X-Debug", b"0"), (b"X-Debug", b"1")]),
        ("/echo", [(b"X_Debug", b"1")]),  # HTTP_X_DEBUG to a CGI or WSGI upstream
        ("/echo?debug=0&debug=1", []),
        ("/echo?x=0;debug=1", []),  # servers that split on ";" read debug=1
        ("/echo?debug=1;x=0", []),
        ("/echo?debug=%801", []),
    ],
)
async def test_a_conditional_route_cannot_be_bypassed_by_a_value_the_upstream_reads_otherwise(
    bypass_gw, target, lines
):
    for _ in range(3):
        status, _, body = await raw_exchange(bypass_gw.url, request_bytes(target, lines))
        assert status == 400, f"reached the unlimited route: {body[:300]!r}"
        assert b"a route is chosen by it" in body


@pytest.mark.parametrize(
    ("target", "lines"),
    [
        ("/echo", []),
        ("/echo", [(b"X-Debug", b"2")]),
        ("/echo?debug=2&x=1;y=2", [(b"X-Other", b"a"), (b"X-Other", b"\xff")]),  # nothing a condition reads
        ("/other?debug=1&debug=1", [(b"X-Debug", b"\xff"), (b"X-Debug", b"1")]),  # no route with conditions fits the path
    ],
)
async def test_requests_a_condition_reads_plainly_take_the_unlimited_route(bypass_gw, target, lines):
    status, _, body = await raw_exchange(bypass_gw.url, request_bytes(target, lines))
    assert status == 200, body
