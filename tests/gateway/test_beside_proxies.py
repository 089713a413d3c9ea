"""docs/beside-proxies.md as a reader uses it: its snippets, taken from the page as written,
run behind real proxies in front of a gateway started with `gateway run`, with a real
aiohttp upstream as the application.

- The page's gateway YAML starts beside its nginx and Caddy snippets, every port it names moved
  to a free one by one map (tests.beside_proxies.on_ports); without its `listen`, the
  gateway would take the port nginx holds.
- nginx (auth_request), failing open and failing closed when the gateway cannot be asked:
  with the gateway running, exactly the burst passes through each and the 429 reaches the
  client with Retry-After and the RateLimit fields; with it stopped, the fail-open snippet
  hands every request to the application marked X-RateLimit-Unchecked (and the limits
  hold again once it is back), the fail-closed one answers a 503 problem+json. Only no
  answer fails open: the gateway's 400 (nginx not trusted) stays nginx's 500, and a
  fail-closed limit's 503 stays a 503.
- Caddy (forward_auth, asking on /decide/traefik), the same two ways, and the
  application's own 502 is not taken for the gateway's.
- Through both, a client's own X-Forwarded-For does not change the address it is limited by.
- Traefik's and Envoy's snippets (no binary here): they parse, and name only the keys
  those proxies read.

The tests that never stop the gateway share one per config, each limited by a key or a
client address of its own; those that stop it, or run the page's YAML, start their own.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import re
import socket
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import aiohttp
import pytest
import yaml
from multidict import CIMultiDict

from tests.beside_proxies import (
    ADMIN,
    APPLICATION,
    DECISIONS,
    PROXY,
    PUBLIC,
    Caddy,
    Nginx,
    doc_snippet,
    free_ports,
    nginx_snippet,
    on_ports,
    running_caddy,
    running_nginx,
)
from tests.processes import GatewayProcess, RedisServer, free_port, run_cli
from tests.upstream import RecordingUpstream, echo, serving

BURST = 3
KEY = {"X-API-Key": "k1"}
CHOICES = ["open", "closed"]

# The in-process store unless `store` is given: a proxy's test counts exactly, with no Redis
# to time out.
LIMITED = """
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
decision_listen: 127.0.0.1:{decision_port}
trusted_proxies: [{trusted}]
{store}
limits:
  per_key: {{rate: 1/hour, burst: {burst}, key: "{key}", on_store_error: {policy}}}
routes:
  - match: {{path: /api}}
    upstream: http://127.0.0.1:9
    limits: [per_key]
"""


def limited(
    decision_port: int, *, trusted: str = "127.0.0.1/32", key: str = "header:X-API-Key", store: str = "",
    policy: str = "open",
) -> GatewayProcess:
    return GatewayProcess(
        LIMITED.format(decision_port=decision_port, trusted=trusted, burst=BURST, key=key, store=store, policy=policy)
    )


@pytest.fixture(scope="module")
def shared_limited():
    """`shared_limited(**options)`: the decision port of a gateway started as `limited(port,
    **options)` at the first test that asks for those options, and shared by every test that
    does: each such test is limited by a key or client address of its own."""
    started: dict[tuple[tuple[str, str], ...], int] = {}
    with contextlib.ExitStack() as stack:

        def decision_port(**options: str) -> int:
            key = tuple(sorted(options.items()))
            if key not in started:
                port = free_port()
                stack.enter_context(limited(port, **options))
                started[key] = port
            return started[key]

        yield decision_port


@pytest.fixture(scope="module")
def dead_store() -> str:
    """A store block naming a port nothing listens on."""
    return f"store: {{url: 'redis://127.0.0.1:{free_port()}/0'}}"


@contextlib.asynccontextmanager
async def application() -> AsyncIterator[tuple[RecordingUpstream, int]]:
    """The application behind the proxy: it records each request and echoes it (method,
    path, headers, body) as JSON."""
    upstream = RecordingUpstream(echo)
    async with serving(upstream.handle) as url:
        yield upstream, int(url.rsplit(":", 1)[1])


async def send(client: aiohttp.ClientSession, url: str, *, method: str = "GET", body: bytes | None = None,
               headers: dict[str, str] | None = None) -> tuple[int, CIMultiDict[str], bytes]:
    async with client.request(method, url, data=body, headers={**KEY, **(headers or {})}) as response:
        return response.status, CIMultiDict(response.headers), await response.read()


def echoed_headers(body: bytes) -> dict[str, str]:
    return {name.lower(): value for name, value in json.loads(body)["headers"]}


PROXIES: dict[str, Callable[..., contextlib.AbstractContextManager[str]]] = {
    "nginx": running_nginx,
    "caddy": running_caddy,
}


def assert_limited(answers: list[tuple[int, CIMultiDict[str], bytes]]) -> None:
    """Exactly the burst passed, then the gateway's 429 reached the client with its fields."""
    assert [status for status, _, _ in answers] == [200] * BURST + [429]
    _, headers, body = answers[-1]
    assert int(headers["Retry-After"]) >= 1
    assert "RateLimit" in headers and "RateLimit-Policy" in headers
    assert headers["Content-Type"].startswith("application/problem+json")
    assert json.loads(body)["status"] == 429
    for _, _, passed in answers[:-1]:
        assert "x-ratelimit-unchecked" not in echoed_headers(passed)  # a client's own is dropped


@pytest.mark.parametrize("choice", CHOICES)
@pytest.mark.parametrize("proxy", sorted(PROXIES))
async def test_the_burst_passes_and_the_429_reaches_the_client(shared_limited, proxy: str, choice: str) -> None:
    decision_port = shared_limited()
    async with application() as (upstream, app_port):
        with PROXIES[proxy](decision_port=decision_port, upstream_port=app_port, choice=choice) as url:
            async with aiohttp.ClientSession() as client:
                headers = {"X-RateLimit-Unchecked": "forged", "X-API-Key": f"burst-{proxy}-{choice}"}
                answers = [await send(client, url + "/api/items", headers=headers) for _ in range(BURST + 1)]
    assert_limited(answers)
    assert upstream.requests == BURST


@pytest.mark.parametrize("proxy", sorted(PROXIES))
async def test_fail_open_while_the_gateway_is_stopped(proxy: str) -> None:
    """Asked while the gateway runs, then stopped: every request reaches the application,
    unlimited and marked, a POST with its body; started again, the limits hold again."""
    decision_port = free_port()
    async with application() as (upstream, app_port), aiohttp.ClientSession() as client:
        with PROXIES[proxy](decision_port=decision_port, upstream_port=app_port) as url:
            with limited(decision_port):
                first = await send(client, url + "/api/items")
            unchecked = [await send(client, url + "/api/items") for _ in range(BURST + 2)]
            posted = await send(client, url + "/api/items", method="POST", body=b'{"order": 7}')
            reached_while_down = upstream.requests
            with limited(decision_port):
                back = [await send(client, url + "/api/items") for _ in range(BURST + 1)]
    assert first[0] == 200
    assert [status for status, _, _ in unchecked] == [200] * (BURST + 2)
    for _, _, body in unchecked:
        # nginx's $upstream_status lists each try: a kept-alive connection to the stopped
        # gateway that nginx tried first adds one.
        assert re.fullmatch(r"(502, )?502", echoed_headers(body)["x-ratelimit-unchecked"])
    status, _, body = posted
    assert status == 200
    seen = json.loads(body)
    assert (seen["method"], seen["path"], seen["body"]) == ("POST", "/api/items", '{"order": 7}')
    assert reached_while_down == 1 + BURST + 2 + 1
    assert_limited(back)  # a fresh in-process store: the whole burst again


@pytest.mark.parametrize("choice", CHOICES)
@pytest.mark.parametrize("proxy", sorted(PROXIES))
async def test_a_fail_closed_limit_stays_closed(shared_limited, dead_store, proxy: str, choice: str) -> None:
    """The gateway answers, refusing: a fail-closed limit whose store is down. That is not
    the gateway down, so not even the fail-open snippets let the request through."""
    decision_port = shared_limited(store=dead_store, policy="closed")
    async with application() as (upstream, app_port):
        with PROXIES[proxy](decision_port=decision_port, upstream_port=app_port, choice=choice) as url:
            async with aiohttp.ClientSession() as client:
                status, headers, body = await send(client, url + "/api/items", headers={"X-API-Key": f"closed-{proxy}-{choice}"})
    assert status == 503
    assert headers["Retry-After"] == "1"  # the gateway's, not the snippets' 5
    assert json.loads(body)["status"] == 503
    assert upstream.requests == 0


@pytest.mark.parametrize(("proxy", "client_address"), [("caddy", "127.0.0.3"), ("nginx", "127.0.0.2")])
async def test_a_client_cannot_name_its_own_address(shared_limited, proxy: str, client_address: str) -> None:
    """Limited by `ip`: a client that sends X-Forwarded-For of its own is still known by the
    address the proxy saw (nginx appends it, Caddy replaces the header). The client is
    127.0.0.2 or, behind Caddy, 127.0.0.3 (the two share a gateway): loopback, but not a
    trusted proxy as 127.0.0.1 is."""
    decision_port = shared_limited(key="ip")
    async with application() as (upstream, app_port):
        with PROXIES[proxy](decision_port=decision_port, upstream_port=app_port) as url:
            connector = aiohttp.TCPConnector(local_addr=(client_address, 0))
            async with aiohttp.ClientSession(connector=connector) as client:
                answers = [
                    await send(client, url + "/api/items", headers={"X-Forwarded-For": f"203.0.113.{n}"})
                    for n in range(BURST + 1)
                ]
    assert_limited(answers)
    assert upstream.requests == BURST


@pytest.mark.parametrize("choice", CHOICES)
async def test_caddy_leaves_the_applications_own_errors_alone(shared_limited, choice: str) -> None:
    """The gateway allows, the application is down: Caddy's own empty 502, neither sent to
    the application again nor told as the rate limiter's failure."""
    decision_port, app_port = shared_limited(), free_port()  # nothing listens on app_port
    with running_caddy(decision_port=decision_port, upstream_port=app_port, choice=choice) as url:
        async with aiohttp.ClientSession() as client:
            status, headers, body = await send(client, url + "/api/items", headers={"X-API-Key": f"down-app-{choice}"})
    assert status == 502
    assert body == b""
    assert "Retry-After" not in headers


async def test_nginx_logs_each_request_it_let_through_unchecked() -> None:
    ports = {PROXY: free_port(), DECISIONS: free_port()}
    async with application() as (upstream, app_port):
        ports[APPLICATION] = app_port
        with Nginx(on_ports(nginx_snippet(), ports), ports[PROXY]) as nginx:
            async with aiohttp.ClientSession() as client:
                statuses = [(await send(client, nginx.url + "/api/items"))[0] for _ in range(2)]
            log = nginx.error_log()
    assert statuses == [200, 200]
    assert upstream.requests == 2
    assert len(re.findall(r"auth request unexpected status: 502", log)) == 2


@pytest.mark.parametrize("proxy", sorted(PROXIES))
async def test_fail_closed_while_the_gateway_is_stopped(proxy: str) -> None:
    decision_port = free_port()  # nothing listens there
    async with application() as (upstream, app_port), aiohttp.ClientSession() as client:
        with PROXIES[proxy](decision_port=decision_port, upstream_port=app_port, choice="closed") as url:
            answers = [await send(client, url + "/api/items") for _ in range(2)]
            posted = await send(client, url + "/api/items", method="POST", body=b"x")
    for status, headers, body in [*answers, posted]:
        assert status == 503
        assert headers["Retry-After"] == "5"
        assert headers["Content-Type"].startswith("application/problem+json")
        assert json.loads(body)["status"] == 503
    assert upstream.requests == 0


async def test_nginx_fails_open_only_when_the_gateway_cannot_be_asked(shared_limited) -> None:
    """A gateway that answers 400 (nginx is not in its trusted_proxies: a setup mistake) is
    not a gateway that is down: the request gets nginx's 500, never the application."""
    decision_port = shared_limited(trusted="10.0.0.0/8")
    async with application() as (upstream, app_port):
        with running_nginx(decision_port=decision_port, upstream_port=app_port) as url:
            async with aiohttp.ClientSession() as client:
                status, _, _ = await send(client, url + "/api/items")
    assert status == 500
    assert upstream.requests == 0


# The page's gateway YAML, beside the page's nginx.

def gateway_yaml(ports: dict[int, int], store_url: str) -> str:
    """The page's gateway YAML with its ports moved by `ports` and its store pointed at a
    private redis-server: the two changes made to it, both explicit here."""
    text = on_ports(doc_snippet("gateway"), ports)
    written = 'store: {url: "redis://127.0.0.1:6379/0"}'
    assert written in text
    return text.replace(written, f'store: {{url: "{store_url}"}}')


def test_the_pages_ports_fit_together() -> None:
    """As written: the gateway names its own three ports, none the proxy's or the
    application's; nginx and Caddy ask where decision_listen listens, and the proxy's
    address is in trusted_proxies."""
    config = yaml.safe_load(doc_snippet("gateway"))
    gateway_ports = {key: int(config[key].rsplit(":", 1)[1]) for key in ("listen", "admin_listen", "decision_listen")}
    assert gateway_ports == {"listen": PUBLIC, "admin_listen": ADMIN, "decision_listen": DECISIONS}
    nginx = nginx_snippet()
    assert f"listen 127.0.0.1:{PROXY};" in nginx
    assert re.search(r"upstream gateway_decisions \{\s*server (\S+);", nginx).group(1) == config["decision_listen"]
    assert f"proxy_pass http://127.0.0.1:{APPLICATION};" in nginx
    caddy = doc_snippet("caddy")
    assert caddy.startswith(f":{PROXY} {{")
    assert re.search(r"forward_auth (\S+) \{", caddy).group(1) == config["decision_listen"]
    trusted = [ipaddress.ip_network(network) for network in config["trusted_proxies"]]
    assert any(ipaddress.ip_address("127.0.0.1") in network for network in trusted)
    assert len({PROXY, APPLICATION, *gateway_ports.values()}) == 5


def test_the_pages_yaml_passes_gateway_check() -> None:
    with tempfile.TemporaryDirectory(prefix="gateway-test-") as directory:
        path = Path(directory) / "gateway.yaml"
        path.write_text(doc_snippet("gateway"), encoding="utf-8")
        result = run_cli("check", "-c", str(path))
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("proxy", ["nginx", "caddy"])
async def test_the_pages_yaml_starts_beside_the_pages_proxy(proxy: str) -> None:
    ports = free_ports()
    with RedisServer(dedicated=True) as redis_server:
        async with application() as (upstream, app_port):
            ports[APPLICATION] = app_port
            server = Nginx(on_ports(nginx_snippet(), ports), ports[PROXY]) if proxy == "nginx" else Caddy(
                on_ports(doc_snippet("caddy"), ports), ports[PROXY]
            )
            with GatewayProcess(gateway_yaml(ports, redis_server.url)) as gateway, server:
                async with aiohttp.ClientSession() as client:
                    async with client.get(gateway.admin_url + "/healthz") as health:
                        healthy = health.status
                    # per_key: 100/minute, burst 100. Tokens refill during the run (one per
                    # 0.6 s), so the first denial may come after a few more than the burst.
                    answers = []
                    while not answers or answers[-1][0] == 200:
                        answers.append(await send(client, server.url + "/api/items"))
                        assert len(answers) <= 1000, "no request was ever denied"
    assert gateway.url == f"http://127.0.0.1:{ports[PUBLIC]}"
    assert gateway.admin_url == f"http://127.0.0.1:{ports[ADMIN]}"
    assert healthy == 200
    passed = len(answers) - 1
    assert passed >= 100
    assert upstream.requests == passed
    status, headers, body = answers[-1]
    assert status == 429, body
    assert int(headers["Retry-After"]) >= 1
    assert "RateLimit" in headers and "RateLimit-Policy" in headers


@contextlib.contextmanager
def holding(host: str, port: int) -> Iterator[None]:
    """`host:port` taken for the block: bound here, or already bound by another process."""
    with socket.socket() as sock:
        with contextlib.suppress(OSError):
            sock.bind((host, port))
            sock.listen()
        yield


def test_without_its_listen_the_yaml_would_take_the_proxys_port() -> None:
    """Why the page's YAML sets `listen`: its default is the port the proxy holds."""
    ports = free_ports()
    text = gateway_yaml(ports, "redis://127.0.0.1:9/0")
    without_listen = "\n".join(line for line in text.splitlines() if not line.startswith("listen:"))
    with holding("0.0.0.0", PROXY), tempfile.TemporaryDirectory(prefix="gateway-test-") as directory:
        path = Path(directory) / "gateway.yaml"
        path.write_text(without_listen, encoding="utf-8")
        result = run_cli("run", "-c", str(path))
    assert result.returncode != 0
    # (Its store here is unreachable, which it only warns about: the port is what stops it.)
    assert result.stderr.splitlines()[-1] == f"gateway: cannot listen on 0.0.0.0:{PROXY}: Address already in use"
    assert "Traceback" not in result.stderr


# Traefik and Envoy: no binary here, so their snippets are held to the keys they read.

TRAEFIK_KEYS = {
    # Traefik's dynamic configuration (doc.traefik.io, routing-configuration/http):
    # routers, middlewares (forwardAuth, errors) and load-balanced services.
    "http": {"routers", "middlewares", "services"},
    "router": {"rule", "service", "middlewares", "entryPoints", "priority", "tls"},
    "forwardAuth": {"address", "trustForwardHeader", "authResponseHeaders", "authRequestHeaders",
                    "authResponseHeadersRegex", "tls"},
    "errors": {"status", "statusRewrites", "service", "query"},
    "loadBalancer": {"servers", "healthCheck", "passHostHeader"},
}


def check_traefik(config: dict) -> None:
    assert set(config) == {"http"}
    http = config["http"]
    assert set(http) <= TRAEFIK_KEYS["http"]
    for router in http.get("routers", {}).values():
        assert set(router) <= TRAEFIK_KEYS["router"]
        for name in router.get("middlewares", []):
            assert name in http["middlewares"] or name == "ratelimit", name
    for middleware in http["middlewares"].values():
        ((kind, options),) = middleware.items()
        assert set(options) <= TRAEFIK_KEYS[kind], (kind, options)
    for service in http.get("services", {}).values():
        assert set(service["loadBalancer"]) <= TRAEFIK_KEYS["loadBalancer"]


def test_traefik_snippets_name_the_keys_traefik_reads() -> None:
    plain = yaml.safe_load(doc_snippet("traefik"))
    check_traefik(plain)
    assert plain["http"]["middlewares"]["ratelimit"]["forwardAuth"]["address"].endswith(
        f":{DECISIONS}/decide/traefik"
    )
    closed = yaml.safe_load(doc_snippet("traefik-fail-closed"))
    check_traefik(closed)
    # errors before forwardAuth in the chain, so it sees forwardAuth's 500.
    assert closed["http"]["routers"]["app"]["middlewares"] == ["ratelimiter-down", "ratelimit"]
    assert closed["http"]["middlewares"]["ratelimiter-down"]["errors"]["status"] == ["500"]


# Fields of the messages the snippets fill, from Envoy's v3 protos:
# api/envoy/extensions/filters/http/ext_authz/v3/ext_authz.proto,
# api/envoy/extensions/filters/http/ratelimit/v3/rate_limit.proto,
# api/envoy/config/core/v3/http_uri.proto, grpc_service.proto and type/v3/http_status.proto.
ENVOY_FIELDS = {
    "ExtAuthz": {"grpc_service", "http_service", "transport_api_version", "failure_mode_allow",
                 "failure_mode_allow_header_add", "with_request_body", "clear_route_cache", "status_on_error",
                 "metadata_context_namespaces", "filter_enabled", "deny_at_disable", "include_peer_certificate",
                 "stat_prefix", "allowed_headers", "disallowed_headers"},
    "HttpService": {"server_uri", "path_prefix", "authorization_request", "authorization_response", "retry_policy"},
    "HttpUri": {"uri", "cluster", "timeout"},
    "AuthorizationRequest": {"allowed_headers", "headers_to_add"},
    "AuthorizationResponse": {"allowed_upstream_headers", "allowed_upstream_headers_to_append",
                              "allowed_client_headers", "allowed_client_headers_on_success",
                              "dynamic_metadata_from_headers"},
    "RateLimit": {"domain", "stage", "request_type", "timeout", "failure_mode_deny",
                  "rate_limited_as_resource_exhausted", "rate_limit_service", "enable_x_ratelimit_headers",
                  "disable_x_envoy_ratelimited_header", "rate_limited_status", "response_headers_to_add",
                  "status_on_error", "stat_prefix"},
    "RateLimitServiceConfig": {"grpc_service", "transport_api_version"},
    "HttpStatus": {"code"},
}
HTTP_STATUS_CODES = {"ServiceUnavailable", "Forbidden", "InternalServerError", "TooManyRequests"}


def check_fields(message: str, value: dict) -> None:
    assert set(value) <= ENVOY_FIELDS[message], (message, set(value) - ENVOY_FIELDS[message])


def test_envoy_snippets_name_fields_of_envoys_messages() -> None:
    (ext_authz, router) = yaml.safe_load(doc_snippet("envoy"))["http_filters"]
    assert ext_authz["name"] == "envoy.filters.http.ext_authz"
    config = {k: v for k, v in ext_authz["typed_config"].items() if k != "@type"}
    check_fields("ExtAuthz", config)
    assert config["failure_mode_allow"] is False
    check_fields("HttpStatus", config["status_on_error"])
    assert config["status_on_error"]["code"] in HTTP_STATUS_CODES
    service = config["http_service"]
    check_fields("HttpService", service)
    check_fields("HttpUri", service["server_uri"])
    check_fields("AuthorizationRequest", service["authorization_request"])
    check_fields("AuthorizationResponse", service["authorization_response"])
    assert service["path_prefix"] == "/decide/envoy"
    assert router["name"] == "envoy.filters.http.router"

    fail_open = yaml.safe_load(doc_snippet("envoy-fail-open"))
    check_fields("ExtAuthz", fail_open)
    assert fail_open == {"failure_mode_allow": True, "failure_mode_allow_header_add": True}

    (ratelimit,) = yaml.safe_load(doc_snippet("envoy-ratelimit"))["http_filters"]
    assert ratelimit["name"] == "envoy.filters.http.ratelimit"
    config = {k: v for k, v in ratelimit["typed_config"].items() if k != "@type"}
    check_fields("RateLimit", config)
    assert config["failure_mode_deny"] is True
    check_fields("HttpStatus", config["status_on_error"])
    check_fields("RateLimitServiceConfig", config["rate_limit_service"])


def test_every_fenced_block_on_the_page_is_named_and_tested() -> None:
    """A block added to the page without a `<!-- snippet: NAME -->` line would be run by no test."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "beside-proxies.md").read_text(encoding="utf-8")
    names = re.findall(r"^<!-- snippet: (\S+) -->\n```", text, re.M)
    assert len(re.findall(r"^```[a-z]+\n", text, re.M)) == len(names)
    assert sorted(names) == sorted([
        "gateway", "nginx", "nginx-fail-closed", "traefik", "traefik-fail-closed",
        "envoy", "envoy-fail-open", "envoy-ratelimit", "caddy", "caddy-fail-closed",
    ])

