"""The decision listener (`decision_listen`), with real parts only.

- Behind two real nginx processes (auth_request, the snippet docs/beside-proxies.md
  gives, read from that page), each asking its own gateway process on one private
  Redis, with wrk's 50 connections on one API key: exactly the burst reaches the
  aiohttp upstream behind nginx, wrk sees exactly that many 2xx, no check failed open
  at the default store timeout, and the next request gets nginx's 429 with Retry-After
  and the RateLimit fields, mapped back from the gateway's 403.
- Traefik's and Envoy's contracts, with the requests they document sending: allow, deny
  (429 with the fields), a fail-closed limit on a dead store (503), an untrusted peer
  (400, charged nothing) and missing original-request headers (400); what the original
  request holds is refused as the client's doing (tests/gateway/test_decision_targets.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import socket
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.beside_proxies import running_nginx
from tests.processes import GatewayProcess, RedisServer, free_port, run_cli
from tests.scrape import scrape, settled_decisions, value
from tests.upstream import RecordingUpstream, serving

pytestmark = pytest.mark.timing  # measures exactness under load: one such module runs at a time

BURST = 200
WRK_SECONDS = 3
WRK_CONNECTIONS = 25  # per nginx: 50 in all
KEY = "wrk-key"

CONFIG = """
decision_listen: 127.0.0.1:{decision_port}
trusted_proxies: [127.0.0.1/32]
store: {{url: "{url}"{timeout}}}
limits:
  per_key: {{rate: 1/hour, burst: {burst}, key: header:X-API-Key, on_store_error: {policy}}}
routes:
  - match: {{path: /api}}
    upstream: http://127.0.0.1:9
    limits: [per_key]
"""


def gateway_config(url: str, *, burst: int = BURST, policy: str = "open", timeout: str | None = None) -> tuple[str, int]:
    """The gateway's config, and its decision listener's port. `timeout`: the store's, when
    not its default (10 ms)."""
    port = free_port()
    store_timeout = f", timeout: {timeout}" if timeout else ""
    return CONFIG.format(decision_port=port, url=url, burst=burst, policy=policy, timeout=store_timeout), port


def wrk_counts(output: str) -> tuple[int, int]:
    """(requests, non-2xx/3xx answers) from wrk's summary."""
    total = int(re.search(r"(\d+) requests in", output).group(1))
    refused = re.search(r"Non-2xx or 3xx responses: (\d+)", output)
    return total, int(refused.group(1)) if refused else 0


async def run_wrk(url: str, script: Path) -> str:
    process = await asyncio.create_subprocess_exec(
        "wrk", "-t1", f"-c{WRK_CONNECTIONS}", f"-d{WRK_SECONDS}s", "-s", str(script), url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await process.communicate()
    assert process.returncode == 0, output.decode()
    return output.decode()


async def test_nginx_fleet_admits_exactly_the_burst(tmp_path: Path) -> None:
    upstream = RecordingUpstream()
    script = tmp_path / "key.lua"
    script.write_text(f'wrk.headers["X-API-Key"] = "{KEY}"\n', encoding="utf-8")
    with RedisServer(dedicated=True) as redis_server, contextlib.ExitStack() as stack:
        async with serving(upstream.handle) as upstream_url:
            upstream_port = int(upstream_url.rsplit(":", 1)[1])
            gateways, proxies = [], []
            for _ in range(2):
                text, port = gateway_config(redis_server.url)
                gateways.append(stack.enter_context(GatewayProcess(text)))
                proxies.append(stack.enter_context(running_nginx(decision_port=port, upstream_port=upstream_port)))
            outputs = await asyncio.gather(*(run_wrk(url + "/api/items", script) for url in proxies))
            counts = [wrk_counts(output) for output in outputs]
            passed = sum(total - refused for total, refused in counts)
            async with aiohttp.ClientSession() as client:
                decided = [await settled_decisions(client, g.admin_url) for g in gateways]
                async with client.get(proxies[0] + "/api/items", headers={"X-API-Key": KEY}) as response:
                    after = response.status, dict(response.headers), await response.text()
                async with client.get(proxies[1] + "/api/items", headers={"X-API-Key": "another-key"}) as response:
                    fresh = response.status, dict(response.headers)
            allowed = sum(d["per_key", "allow"] for d in decided)
            fail_open = sum(d["per_key", "fail_open"] for d in decided)
            print(
                f"\nnginx x2, gateways x2, wrk {2 * WRK_CONNECTIONS} connections {WRK_SECONDS}s: "
                f"requests {[c[0] for c in counts]}, 2xx {passed}, upstream {upstream.requests}, "
                f"allowed {allowed}, fail_open {fail_open}, burst {BURST}"
            )
    assert upstream.requests == BURST + 1  # the burst, and the fresh key's one request
    assert passed == BURST
    assert allowed == BURST  # scraped before the fresh key asked
    assert fail_open == 0
    status, headers, body = after
    assert status == 429, body
    assert int(headers["Retry-After"]) >= 1
    assert "RateLimit" in headers and "RateLimit-Policy" in headers
    assert headers["Content-Type"] == "application/problem+json"
    assert fresh[0] == 200
    assert "RateLimit" in fresh[1] and "RateLimit-Policy" in fresh[1]


@contextlib.asynccontextmanager
async def decision_gateway(url: str, *, burst: int = 2, policy: str = "open") -> AsyncIterator[str]:
    # At the default store timeout, as users run it; the callers' Redis runs at real-time
    # priority, so a busy machine does not make a check fail open (which allows without the fields).
    text, port = gateway_config(url, burst=burst, policy=policy)
    with GatewayProcess(text):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def shared_decisions() -> Iterator[str]:
    """One decision gateway (burst 2, failing open) on a real-time-priority Redis, for the tests
    that only ask it questions: each asks with API keys of its own, so each finds a fresh burst."""
    with RedisServer(dedicated=True) as redis_server:
        text, port = gateway_config(redis_server.url, burst=2)
        with GatewayProcess(text):
            yield f"http://127.0.0.1:{port}"


_keys = itertools.count()


def fresh_key() -> str:
    """An API key no other test of the module has charged."""
    return f"key-{next(_keys)}"


TRAEFIK = "/decide/traefik"


def traefik_headers(key: str, uri: str = "/api/items?page=2", method: str = "GET") -> dict[str, str]:
    """What Traefik's forwardAuth sends: the original headers and its X-Forwarded-*."""
    return {
        "X-API-Key": key,
        "X-Forwarded-Method": method,
        "X-Forwarded-Proto": "https",
        "X-Forwarded-Host": "shop.example",
        "X-Forwarded-Uri": uri,
        "X-Forwarded-For": "203.0.113.7",
    }


def envoy_request(key: str, path: str = "/api/items?page=2") -> tuple[str, dict[str, str]]:
    """What Envoy's ext_authz HTTP service sends: the original method, Host and headers,
    and the original path after its path_prefix."""
    return "/decide/envoy" + path, {"Host": "shop.example", "X-API-Key": key, "X-Forwarded-For": "203.0.113.7"}


async def ask(client: aiohttp.ClientSession, url: str, style: str, key: str) -> aiohttp.ClientResponse:
    if style == "traefik":
        response = await client.get(url + TRAEFIK, headers=traefik_headers(key))
    else:
        path, headers = envoy_request(key)
        response = await client.post(url + path, headers=headers)
    await response.read()
    return response


@pytest.mark.parametrize("style", ["traefik", "envoy"])
async def test_allow_then_deny_with_the_fields(style: str, shared_decisions: str) -> None:
    key = fresh_key()
    async with aiohttp.ClientSession() as client:
        answers = [await ask(client, shared_decisions, style, key) for _ in range(3)]
    assert [a.status for a in answers] == [200, 200, 429]
    for answer in answers:
        assert "RateLimit" in answer.headers and "RateLimit-Policy" in answer.headers
    assert await answers[0].read() == b""
    denied = answers[2]
    assert int(denied.headers["Retry-After"]) >= 1
    assert denied.headers["Content-Type"].startswith("application/problem+json")
    assert (await denied.json())["status"] == 429


@pytest.mark.parametrize("style", ["traefik", "envoy"])
async def test_fail_closed_on_a_dead_store(style: str) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    async with decision_gateway(dead, policy="closed") as url, aiohttp.ClientSession() as client:
        answer = await ask(client, url, style, "k1")
        body = await answer.json(content_type=None)
    # Envoy takes any 5xx from its authorization service as the service failing, which
    # failure_mode_allow lets through: its refusal is a 429 that says what happened.
    expected = 503 if style == "traefik" else 429
    assert answer.status == expected
    assert answer.headers["Retry-After"] == "1"
    assert body["status"] == expected
    assert body["type"].endswith("#temporary-reduced-capacity")
    assert answer.headers.get("X-Gateway-Status") == (None if style == "traefik" else "503")
    assert int(answer.headers["Content-Length"]) == len(json.dumps(body).encode())


async def test_an_untrusted_peer_gets_400_and_is_charged_nothing(shared_decisions: str) -> None:
    url, key = shared_decisions, fresh_key()
    # 127.0.0.2 is loopback too, but not in trusted_proxies (127.0.0.1/32).
    untrusted = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
    async with aiohttp.ClientSession(connector=untrusted) as client:
        refused = [await ask(client, url, "traefik", key) for _ in range(3)]
        refused_envoy = await ask(client, url, "envoy", key)
    async with aiohttp.ClientSession() as client:
        trusted = [await ask(client, url, "traefik", key) for _ in range(3)]
    assert [r.status for r in refused] == [400, 400, 400]
    assert refused_envoy.status == 400
    assert refused[0].headers["Content-Type"].startswith("application/problem+json")
    assert "RateLimit" not in refused[0].headers
    assert [t.status for t in trusted] == [200, 200, 429]  # the burst of 2 was all still there


@pytest.mark.parametrize(
    ("path", "headers"),
    [
        (TRAEFIK, {"X-Forwarded-Host": "shop.example", "X-Forwarded-Uri": "/api"}),  # no method
        (TRAEFIK, {**traefik_headers("k1"), "X-Forwarded-Uri": "api/items"}),  # not origin-form
        (TRAEFIK, {**traefik_headers("k1"), "X-Forwarded-Method": "GE T"}),
        (TRAEFIK, {**traefik_headers("k1"), "X-Forwarded-Host": "shop.example/@evil"}),
        ("/decide/nginx", {"X-Original-Method": "GET"}),  # no X-Original-URI
    ],
)
async def test_malformed_original_headers_get_400(path: str, headers: dict[str, str], shared_decisions: str) -> None:
    url, key = shared_decisions, fresh_key()
    headers = {name: value.replace("k1", key) for name, value in headers.items()}
    async with aiohttp.ClientSession() as client:
        async with client.get(url + path, headers=headers) as answer:
            status, content_type = answer.status, answer.headers.get("Content-Type")
        # Charged nothing: the key's whole burst is left.
        allowed = [(await ask(client, url, "traefik", key)).status for _ in range(3)]
    assert status == 400  # from nginx too: a snippet that sets no X-Original-URI is nginx's 500
    assert content_type is not None and content_type.startswith("application/problem+json")
    assert allowed == [200, 200, 429]


CONCURRENCY_CONFIG = """
listen: 127.0.0.1:{listen_port}
admin_listen: 127.0.0.1:{admin_port}
decision_listen: 127.0.0.1:{decision_port}
trusted_proxies: [127.0.0.1/32]
workers: {workers}
store: {{url: "{url}"}}
limits:
  per_key: {{rate: 1/hour, burst: 2, key: header:X-API-Key, on_store_error: closed}}
  conns: {{concurrency: 1, key: header:X-API-Key}}
routes:
  - match: {{path: /api}}
    upstream: http://127.0.0.1:9
    limits: [per_key, conns]
"""


@pytest.mark.parametrize("workers", [1, 2])
async def test_concurrency_limits_are_skipped_and_counted(workers: int) -> None:
    """A lease would outlive nothing the decision listener sees: the route's concurrency
    limit is not taken, its rate limit is, and each skip is counted. With two workers the
    decision listener is shared like the others (SO_REUSEPORT) and the counts add up."""
    port = free_port()
    with RedisServer(dedicated=True) as redis_server:
        text = CONCURRENCY_CONFIG.format(
            listen_port=free_port(), admin_port=free_port(), decision_port=port, url=redis_server.url, workers=workers
        )
        with GatewayProcess(text) as gateway:
            url = f"http://127.0.0.1:{port}"
            async with aiohttp.ClientSession() as client:
                _, before = await scrape(client, gateway.admin_url)
                statuses = [(await ask(client, url, "envoy", "k1")).status for _ in range(3)]
                _, samples = await scrape(client, gateway.admin_url)
    # Exported from the start, so that an alert on its rate sees the first skip.
    assert value(before, "gateway_decision_concurrency_skipped_total", route="/api", limit="conns") == 0
    assert statuses == [200, 200, 429]  # a held lease of 1 would have refused the second
    assert value(samples, "gateway_decision_concurrency_skipped_total", route="/api", limit="conns") == 2
    assert value(samples, "gateway_decision_requests_total", mode="envoy", status="200") == 2
    assert value(samples, "gateway_decision_requests_total", mode="envoy", status="429") == 1
    assert value(samples, "gateway_limiter_decisions_total", route="/api", limit="per_key", decision="allow") == 2


async def test_nginx_store_failure_is_503_through_the_snippet() -> None:
    """/decide/nginx answers a fail-closed store failure with 401, which the snippet maps
    back to 503 with Retry-After; a denial's 403 is the 429 of the load test above."""
    dead = f"redis://127.0.0.1:{free_port()}/0"
    text, port = gateway_config(dead, policy="closed")
    upstream = RecordingUpstream()
    async with serving(upstream.handle) as upstream_url:
        upstream_port = int(upstream_url.rsplit(":", 1)[1])
        with GatewayProcess(text), running_nginx(decision_port=port, upstream_port=upstream_port) as proxy:
            async with aiohttp.ClientSession() as client:
                async with client.get(proxy + "/api/items", headers={"X-API-Key": "k1"}) as response:
                    status, headers = response.status, response.headers
                async with client.get(f"http://127.0.0.1:{port}/decide/nginx", headers={
                    "X-Original-Method": "GET", "X-Original-URI": "/api/items", "X-API-Key": "k1",
                }) as direct:
                    direct_status, gateway_status = direct.status, direct.headers.get("X-Gateway-Status")
    assert status == 503
    assert headers["Retry-After"] == "1"
    assert (direct_status, gateway_status) == (401, "503")
    assert upstream.requests == 0


def test_a_decision_port_taken_is_one_startup_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = Path(tempfile.mkdtemp(prefix="gateway-test-")) / "gateway.yaml"
        config.write_text(
            "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\n"
            f"decision_listen: 127.0.0.1:{port}\ntrusted_proxies: [127.0.0.1/32]\n"
            "routes: [{match: {path: /}, upstream: 'http://127.0.0.1:9'}]\n",
            encoding="utf-8",
        )
        result = run_cli("run", "-c", str(config))
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert errors == [f"gateway: cannot listen on 127.0.0.1:{port}: Address already in use"], result.stderr


MATCHING_CONFIG = """
decision_listen: 127.0.0.1:{decision_port}
trusted_proxies: [127.0.0.1/32]
limits:
  writes: {{rate: 1/hour, burst: 1, key: ip}}
  reads: {{rate: 1/hour, burst: 3, key: ip}}
routes:
  - match: {{path: /api, methods: [POST], host: shop.example, query: {{v: "2"}}}}
    upstream: http://127.0.0.1:9
    limits: [writes]
  - match: {{path: /api}}
    upstream: http://127.0.0.1:9
    limits: [reads]
"""


async def test_routes_and_the_client_address_are_the_original_requests() -> None:
    """The original method, host and query pick the route, and the client is read from
    the X-Forwarded-For the trusted proxy sends, as on the public listener (here with the
    in-process store: no `store:`)."""
    port = free_port()
    with GatewayProcess(MATCHING_CONFIG.format(decision_port=port)):
        url = f"http://127.0.0.1:{port}"

        async def traefik(method: str, uri: str, client_ip: str) -> tuple[int, str]:
            headers = {**traefik_headers("unused", uri, method), "X-Forwarded-For": client_ip}
            async with aiohttp.ClientSession() as client, client.get(url + TRAEFIK, headers=headers) as answer:
                return answer.status, answer.headers.get("RateLimit-Policy", "")

        writes = [await traefik("POST", "/api/items?v=2", "203.0.113.7") for _ in range(2)]
        other_client = await traefik("POST", "/api/items?v=2", "203.0.113.8")
        reads = [await traefik("GET", "/api/items?v=2", "203.0.113.7") for _ in range(4)]
    assert [s for s, _ in writes] == [200, 429]
    assert other_client[0] == 200  # an address of its own, its own bucket
    assert "writes" in writes[0][1]
    assert [s for s, _ in reads] == [200, 200, 200, 429]  # another route, another limit
    assert "reads" in reads[0][1]


@pytest.mark.parametrize(
    ("method", "uri", "answer"),
    [
        ("GET", "/api/%00", (403, "400")),  # a path the path rule refuses
        ("GE T", "/api/items", (403, "400")),  # a method the public listener refuses
        ("GET", "api/items", (403, "400")),  # a target that is not origin-form
        ("GET", "", (400, None)),  # an empty X-Original-URI: the snippet's doing
    ],
)
async def test_nginx_hears_a_refused_original_request_as_a_denial(method: str, uri: str, answer: tuple, shared_decisions: str) -> None:
    """What the original request holds is the client's doing: refused, nginx is told 403
    (its 500 would page someone), the gateway's 400 in X-Gateway-Status. A question that
    is not one (an X-Original-URI missing or empty) stays 400: that is the snippet's fault."""
    async with aiohttp.ClientSession() as client:
        base = {"X-Original-Method": method, "Host": "shop.example", "X-API-Key": fresh_key()}
        async with client.get(shared_decisions + "/decide/nginx", headers={**base, "X-Original-URI": uri}) as refused:
            status, gateway_status = refused.status, refused.headers.get("X-Gateway-Status")
    assert (status, gateway_status) == answer
