"""The decision listener (`decision_listen`), with real parts only.

- Behind two real nginx processes (auth_request, the snippet docs/beside-proxies.md
  gives, read from that page), each asking its own gateway process on one private
  Redis, with wrk's 50 connections on one API key: exactly the burst reaches the
  aiohttp upstream behind nginx, wrk sees exactly that many 2xx, no check failed open
  at the default store timeout, and the next request gets nginx's 429 with Retry-After
  and the RateLimit fields, mapped back from the gateway's 403.
- Traefik's and Envoy's contracts, with the requests they document sending: allow, deny
  (429 with the fields), a fail-closed limit on a dead store (503), an untrusted peer
  (400, charged nothing) and malformed original-request headers (400).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import socket
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.processes import GatewayProcess, RedisServer, free_port, wait_until
from tests.scrape import settled_decisions
from tests.upstream import RecordingUpstream, serving

pytestmark = pytest.mark.timing  # measures exactness under load: one such module runs at a time

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "beside-proxies.md"
BURST = 200
WRK_SECONDS = 3
WRK_CONNECTIONS = 25  # per nginx: 50 in all
KEY = "wrk-key"

CONFIG = """
decision_listen: 127.0.0.1:{decision_port}
trusted_proxies: [127.0.0.1/32]
store: {{url: "{url}"}}
limits:
  per_key: {{rate: 1/hour, burst: {burst}, key: header:X-API-Key, on_store_error: {policy}}}
routes:
  - match: {{path: /api}}
    upstream: http://127.0.0.1:9
    limits: [per_key]
"""


def gateway_config(url: str, *, burst: int = BURST, policy: str = "open") -> tuple[str, int]:
    port = free_port()
    return CONFIG.format(decision_port=port, url=url, burst=burst, policy=policy), port


def nginx_snippet() -> str:
    """The docs page's one nginx block, as a reader copies it."""
    blocks = re.findall(r"```nginx\n(.*?)```", DOC.read_text(encoding="utf-8"), re.DOTALL)
    assert len(blocks) == 1
    return blocks[0]


@contextlib.contextmanager
def running_nginx(*, decision_port: int, upstream_port: int) -> Iterator[str]:
    """nginx with the docs' snippet on a free port, the gateway's decision listener and
    the upstream put where the snippet names 8081 and 3000; yields its URL."""
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    port = free_port()
    snippet = (
        nginx_snippet()
        .replace("127.0.0.1:8081", f"127.0.0.1:{decision_port}")
        .replace("127.0.0.1:3000", f"127.0.0.1:{upstream_port}")
        .replace("listen 127.0.0.1:8080", f"listen 127.0.0.1:{port}")
    )
    with tempfile.TemporaryDirectory(prefix="nginx-test-") as directory:
        root = Path(directory)
        for temp in ("body", "proxy"):
            (root / temp).mkdir()
        (root / "nginx.conf").write_text(
            f"""worker_processes 1;
pid {root}/nginx.pid;
error_log {root}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {root}/body;
    proxy_temp_path {root}/proxy;
{snippet}
}}
""",
            encoding="utf-8",
        )
        process = subprocess.Popen(
            [nginx, "-p", str(root), "-e", str(root / "error.log"), "-c", "nginx.conf", "-g", "daemon off;"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            wait_until(lambda: _answers(port) or process.poll() is not None, what="nginx to listen")
            if process.poll() is not None:
                raise AssertionError("nginx did not start: " + (root / "error.log").read_text())
            yield f"http://127.0.0.1:{port}"
        finally:
            process.terminate()
            process.wait(10)


def _answers(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


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
    with RedisServer() as redis_server, contextlib.ExitStack() as stack:
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
    text, port = gateway_config(url, burst=burst, policy=policy)
    with GatewayProcess(text):
        yield f"http://127.0.0.1:{port}"


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
async def test_allow_then_deny_with_the_fields(style: str) -> None:
    with RedisServer() as redis_server:
        async with decision_gateway(redis_server.url) as url, aiohttp.ClientSession() as client:
            answers = [await ask(client, url, style, "k1") for _ in range(3)]
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
    assert answer.status == 503
    assert answer.headers["Retry-After"] == "1"
    assert body["status"] == 503


async def test_an_untrusted_peer_gets_400_and_is_charged_nothing() -> None:
    with RedisServer() as redis_server:
        async with decision_gateway(redis_server.url) as url:
            # 127.0.0.2 is loopback too, but not in trusted_proxies (127.0.0.1/32).
            untrusted = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
            async with aiohttp.ClientSession(connector=untrusted) as client:
                refused = [await ask(client, url, "traefik", "k1") for _ in range(3)]
                refused_envoy = await ask(client, url, "envoy", "k1")
            async with aiohttp.ClientSession() as client:
                trusted = [await ask(client, url, "traefik", "k1") for _ in range(3)]
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
async def test_malformed_original_headers_get_400(path: str, headers: dict[str, str]) -> None:
    with RedisServer() as redis_server:
        async with decision_gateway(redis_server.url) as url, aiohttp.ClientSession() as client:
            async with client.get(url + path, headers=headers) as answer:
                status, content_type = answer.status, answer.headers.get("Content-Type")
            # Charged nothing: the key's whole burst is left.
            allowed = [(await ask(client, url, "traefik", "k1")).status for _ in range(3)]
    assert status == 400  # from nginx too: a snippet that sets no X-Original-URI is nginx's 500
    assert content_type is not None and content_type.startswith("application/problem+json")
    assert allowed == [200, 200, 429]
