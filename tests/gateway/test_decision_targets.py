"""The decision listener decides only on the request the proxy will forward.

Beside a proxy, the proxy forwards the client's target as sent. Measured before: with
the strict `POST /api/reports` token spent, `POST /api/reports//..` passed through the
documented nginx snippet (the path rule read it as `/api/`, the lenient route), and so
did `/api/reports/..` and the `%2e%2e` forms; `?x=1#&expensive=1` passed the lenient
route, though Go and PHP upstreams read `expensive=1`; Traefik's `X-Forwarded-Method: post`
skipped a POST route; `//a:99999/x` was a 500 with a traceback; `/nolimit/café` was a 400
that nginx turned into a 500. Here:

- the public listener and the decision listener (as Traefik and as Envoy ask) are sent
  the same bytes, case by case:
  what the public listener refuses, the decision listener refuses with the same words;
  what it would forward changed, the decision listener refuses; the rest is decided;
- each case through the real nginx with the snippet docs/beside-proxies.md gives: never
  a 2xx or a 5xx, nothing reaches the upstream, and /decide/nginx says 403 with the
  gateway's 400 in X-Gateway-Status;
- the Traefik and Envoy paths with their own headers, on the measured scenario.
"""

from __future__ import annotations

import json

import aiohttp
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gateway.config.model import DotSegments, EscapedSlashes, PathNormalization
from gateway.proxy.forwarded_target import FRAGMENT, NORMALISED, NOT_ORIGIN_FORM, TargetRefused, forwarded_target
from gateway.proxy.paths import normalize_path
from gateway.testing import running_gateway
from tests.beside_proxies import running_nginx
from tests.processes import GatewayProcess, free_port
from tests.raw_client import raw_exchange
from tests.upstream import RecordingUpstream, echo, serving

LIMITS = """
limits:
  strict: {{rate: 1/hour, burst: 1, key: header:X-API-Key}}
  expensive: {{rate: 1/hour, burst: 1, key: header:X-API-Key}}
  cheap: {{rate: 1/hour, burst: 100, key: header:X-API-Key}}
routes:
  - match: {{path: /api/reports, methods: [POST]}}
    upstream: {upstream}
    limits: [strict]
  - match: {{path: /api/cheap, query: {{expensive: "1"}}}}
    upstream: {upstream}
    limits: [expensive]
  - match: {{path: /api}}
    upstream: {upstream}
    limits: [cheap]
  - match: {{path: /}}
    upstream: {upstream}
"""
CONFIG = "decision_listen: 127.0.0.1:{decision_port}\ntrusted_proxies: [127.0.0.1/32]\n" + LIMITS

DECIDED, CHANGED, REFUSED = "decided", "changed", "refused"
# (method, target as sent, what the public listener does with it).
CASES = [
    ("GET", "/api/items?page=2", DECIDED),
    ("GET", "/api/items?q={}|^`<>", DECIDED),  # llhttp takes these in a query, and forwards them
    ("GET", "/api/%C3%A9t%C3%A9", DECIDED),
    ("GET", "/api/group%2Fproject", DECIDED),  # escaped_slashes: keep forwards %2F as it is
    ("PROPFIND", "/api/items", DECIDED),
    ("M-SEARCH", "/api/items", DECIDED),
    ("POST", "/api/reports//..", CHANGED),
    ("POST", "/api/reports/..", CHANGED),
    ("POST", "/api/reports/%2e%2e", CHANGED),
    ("POST", "/api/reports/%2E%2E/", CHANGED),
    ("GET", "/api/./items", CHANGED),
    ("GET", "/api//items", CHANGED),
    ("GET", "/%61pi/items", CHANGED),
    ("GET", "/api/%c3%a9", CHANGED),
    ("GET", "//a:99999/x", CHANGED),
    ("GET", "/api/cheap?x=1#&expensive=1", CHANGED),
    ("post", "/api/reports", REFUSED),
    ("FOO", "/api/items", REFUSED),
    ("DESCRIBE", "/api/items", REFUSED),
    ("CONNECT", "/api/items", REFUSED),
    ("GET", "/nolimit/café", REFUSED),
    ("GET", "/nolimit/{x}", REFUSED),
    ("GET", '/nolimit/a"b', REFUSED),
    ("GET", "/api/items#top", REFUSED),
    ("GET", "/api;v=1/items", REFUSED),  # `;` parameters, on a route that does not allow them
    ("GET", "/api/%00", REFUSED),
]


def _head(method: str, target: str, headers: list[tuple[str, str]], path: str | None = None) -> bytes:
    """A request's head with these exact bytes (UTF-8 where not ASCII), ending the connection."""
    line = f"{method} {target if path is None else path} HTTP/1.1\r\n"
    fields = "".join(f"{name}: {value}\r\n" for name, value in headers)
    return (line + fields + "Content-Length: 0\r\nConnection: close\r\n\r\n").encode("utf-8")


def _detail(body: bytes) -> str:
    return json.loads(body)["detail"]


async def test_the_decision_listener_takes_what_the_public_listener_forwards_unchanged() -> None:
    async with serving(echo) as upstream:
        config = CONFIG.format(decision_port=0, upstream=upstream)
        async with running_gateway(config) as gw:
            assert gw.decision_url is not None
            for method, target, public in CASES:
                key = f"k-{method}-{target}"  # each case a bucket of its own
                sent = await raw_exchange(gw.url, _head(method, target, [("Host", "shop.example"), ("X-API-Key", key)]))
                asked = await raw_exchange(
                    gw.decision_url,
                    _head("GET", "", [
                        ("Host", "gateway"), ("X-Forwarded-Method", method), ("X-Forwarded-Uri", target),
                        ("X-Forwarded-Host", "shop.example"), ("X-API-Key", key),
                    ], path="/decide/traefik"),
                )
                # Envoy's ext_authz: the original method, and its target after path_prefix.
                envoy = await raw_exchange(
                    gw.decision_url,
                    _head(method, "/decide/envoy" + target, [("Host", "shop.example"), ("X-API-Key", key + "-envoy")]),
                )
                case = (method, target)
                if public == REFUSED:
                    assert sent[0] == 400, case
                    assert asked[0] == envoy[0] == 400, case
                    assert _detail(asked[2]) == _detail(sent[2]), case
                    continue
                # The public listener forwards it: unchanged, or read as another target.
                assert sent[0] == 200, (case, sent)
                forwarded = json.loads(sent[2])["path"]
                assert (forwarded == target) == (public == DECIDED), (case, forwarded)
                if public == DECIDED:
                    assert asked[0] == envoy[0] == 200, (case, asked, envoy)
                else:
                    assert asked[0] == envoy[0] == 400, (case, asked, envoy)
                    assert _detail(asked[2]) == _detail(envoy[2]) and _detail(asked[2]) in (NORMALISED, FRAGMENT), case


NGINX_CASES = [
    ("POST", "/api/reports//.."),
    ("POST", "/api/reports/.."),
    ("POST", "/api/reports/%2e%2e"),
    ("POST", "/api/reports/%2E%2E/"),
    ("GET", "/api/cheap?x=1#&expensive=1"),
    ("FOO", "/api/items"),
    ("GET", "//a:99999/x"),
    ("GET", "/nolimit/café"),
    ("GET", "/nolimit/{x}"),
    ('GET', '/nolimit/a"b'),
]


async def test_through_nginx_a_target_forwarded_otherwise_is_refused_not_decided() -> None:
    """The measured bypass, through the snippet: the strict token spent, the forms the path
    rule would read as the lenient route are refused, as is the rest, and none reaches the
    upstream; a request the path rule leaves alone is still decided."""
    upstream = RecordingUpstream()
    async with serving(upstream.handle) as upstream_url:
        decision_port = free_port()
        config = CONFIG.format(decision_port=decision_port, upstream="http://127.0.0.1:9")
        upstream_port = int(upstream_url.rsplit(":", 1)[1])
        with GatewayProcess(config) as gateway, running_nginx(decision_port=decision_port, upstream_port=upstream_port) as nginx:
            key = [("Host", "shop.example"), ("X-API-Key", "k1")]
            spent = [(await raw_exchange(nginx, _head("POST", "/api/reports", key)))[0] for _ in range(2)]
            cheap = [(await raw_exchange(nginx, _head("GET", "/api/cheap?expensive=1", key)))[0] for _ in range(2)]
            reached = upstream.requests
            answers = {case: (await raw_exchange(nginx, _head(*case, key)))[0] for case in NGINX_CASES}
            asked = {}
            for method, target in NGINX_CASES:
                status, headers, body = await raw_exchange(
                    f"http://127.0.0.1:{decision_port}",
                    _head("GET", "", [*key, ("X-Original-Method", method), ("X-Original-URI", target)], path="/decide/nginx"),
                )
                asked[method, target] = status, dict(headers).get("X-Gateway-Status"), _detail(body)
            after = upstream.requests
            lenient = (await raw_exchange(nginx, _head("GET", "/api/items", key)))[0]
        errors = [line for line in gateway.stderr_lines if "ERROR" in line or "Traceback" in line]
    print(f"\nnginx answered {answers}")
    assert spent == [200, 429] and cheap == [200, 429]
    assert after == reached == 2  # the two allowed requests only
    for case, status in answers.items():
        assert status == 400, (case, status)  # the gateway's refusal, said as such: never passed, never nginx's 500
    for case, (status, gateway_status, _) in asked.items():
        assert (status, gateway_status) == (403, "400"), (case, status, gateway_status)
    assert asked["POST", "/api/reports//.."][2] == NORMALISED
    assert asked["GET", "/api/cheap?x=1#&expensive=1"][2] == FRAGMENT
    assert lenient == 200
    assert errors == []


def traefik(method: str, uri: str, key: str = "k1") -> dict[str, str]:
    return {
        "X-Forwarded-Method": method, "X-Forwarded-Uri": uri, "X-Forwarded-Host": "shop.example",
        "X-Forwarded-For": "203.0.113.7", "X-API-Key": key,
    }


@pytest.mark.parametrize(
    ("method", "target"),
    [("POST", "/api/reports//.."), ("POST", "/api/reports/.."), ("POST", "/api/reports/%2e%2e"), ("GET", "/api/cheap?x=1#&expensive=1")],
)
async def test_traefik_and_envoy_are_refused_what_the_path_rule_would_change(method: str, target: str) -> None:
    async with running_gateway(CONFIG.format(decision_port=0, upstream="http://127.0.0.1:9")) as gw:
        url = gw.decision_url
        async with aiohttp.ClientSession() as client:
            spend = ("POST", "/api/reports") if method == "POST" else ("GET", "/api/cheap?expensive=1")
            for _ in range(2):
                async with client.get(url + "/decide/traefik", headers=traefik(*spend)) as answer:
                    spent = answer.status
            async with client.get(url + "/decide/traefik", headers=traefik(method, target)) as answer:
                by_traefik = answer.status, answer.headers["Content-Type"], await answer.json(content_type=None)
        # Envoy sends the original method and target after its path_prefix; never a
        # fragment, which its client does not send.
        envoy = (
            await raw_exchange(url, _head(method, "/decide/envoy" + target, [("Host", "shop.example"), ("X-API-Key", "k1")]))
            if "#" not in target
            else None
        )
    assert spent == 429
    assert by_traefik[0] == 400 and by_traefik[1].startswith("application/problem+json")
    assert by_traefik[2]["detail"] in (NORMALISED, FRAGMENT)
    if envoy is not None:
        assert envoy[0] == 400 and _detail(envoy[2]) == NORMALISED


@pytest.mark.parametrize("method", ["post", "Post", "CONNECT", "FOO", "GE T", "GET\tX"])
async def test_a_method_the_public_listener_refuses_is_refused_and_charged_nothing(method: str) -> None:
    """`post` used to skip a `methods: [POST]` route, three times; CONNECT was routed and charged."""
    async with running_gateway(CONFIG.format(decision_port=0, upstream="http://127.0.0.1:9")) as gw:
        async with aiohttp.ClientSession() as client:
            refused = []
            for _ in range(3):
                async with client.get(gw.decision_url + "/decide/traefik", headers=traefik(method, "/api/reports")) as answer:
                    refused.append((answer.status, (await answer.json(content_type=None))["detail"]))
            async with client.get(gw.decision_url + "/decide/traefik", headers=traefik("POST", "/api/reports")) as answer:
                then = answer.status
    expected = NOT_ORIGIN_FORM if method == "CONNECT" else "The request method is not one this gateway accepts"
    assert all(status == 400 and detail.startswith(expected) for status, detail in refused), refused
    assert then == 200  # the strict token was never spent


async def test_a_target_yarl_cannot_parse_is_decided_when_the_path_rule_keeps_it() -> None:
    """`//a:99999/x` made a 500 and a traceback on every question. With merge_slashes off,
    the path rule forwards it as it is: it is decided, on no route but `/`."""
    config = "path_normalization: {merge_slashes: false}\n" + CONFIG.format(decision_port=0, upstream="http://127.0.0.1:9")
    async with running_gateway(config) as gw, aiohttp.ClientSession() as client:
        async with client.get(gw.decision_url + "/decide/traefik", headers=traefik("GET", "//a:99999/x")) as answer:
            kept = answer.status
    async with running_gateway(CONFIG.format(decision_port=0, upstream="http://127.0.0.1:9")) as gw:
        async with aiohttp.ClientSession() as client:
            async with client.get(gw.decision_url + "/decide/traefik", headers=traefik("GET", "//a:99999/x")) as answer:
                merged = answer.status, (await answer.json(content_type=None))["detail"]
    assert kept == 200
    assert merged == (400, NORMALISED)


# Targets built from the pieces that matter to the path rule and the parser.
_PIECES = st.sampled_from(
    ["/", "//", "/.", "/..", "%2e", "%2E", "%2f", "%2F", "%5C", "%00", "%c3%a9", "%C3%A9", "%61", ";x", "?", "#", "&", "=",
     "a", "api", "reports", " ", "\t", "{", '"', "é", "\udcc3", ":99999", "*", "http://h"]
)
_RULES = st.builds(
    PathNormalization,
    dot_segments=st.sampled_from(list(DotSegments)),
    merge_slashes=st.booleans(),
    escaped_slashes=st.sampled_from(list(EscapedSlashes)),
)


@settings(max_examples=3000, deadline=None)
# A trailing space ends the request line's target: read as `/?`, forwarded with the space.
@example(method="GET", target="/? ", rule=PathNormalization(dot_segments=DotSegments.RESOLVE, merge_slashes=False, escaped_slashes=EscapedSlashes.KEEP))
@given(method=st.sampled_from(["GET", "POST", "post", "CONNECT", "FOO", "M-SEARCH", "G T", ""]),
       target=st.lists(_PIECES, max_size=12).map("".join), rule=_RULES)
def test_a_target_is_refused_or_forwarded_exactly_as_decided(method: str, target: str, rule: PathNormalization) -> None:
    """Whatever the method and target: a refusal, never another error; and a target taken
    is one whose path the rule forwards as it is, with no fragment."""
    try:
        taken = forwarded_target(method, target, rule)
    except TargetRefused as exc:
        assert exc.detail.endswith(".")  # one of the fixed sentences
        return
    raw_path, _, query = target.partition("?")
    assert normalize_path(raw_path, rule).forward == raw_path == taken.path.forward
    assert "#" not in target and taken.url.raw_query_string == query
