"""Identities of the size real tokens have.

Measured before: a limit keyed `[header:Authorization, ip]` answered a 1,845-byte bearer
JWT (the size Azure AD and Okta issue) with 431, and `cookie:session` the same value too;
beside nginx that became a 403, and the snippet's 429. The cap is now `identity_max_length`
(8 KiB by default, any value one header line carries); what the gateway remembers per
identity stays a 16-byte digest (tests/gateway/test_identity_memory.py). Here, on the public
listener and through the real nginx with the snippet docs/beside-proxies.md gives: tokens
and cookies of 1,845 bytes and 7 KiB are identities, each its own bucket; past the cap the
answer is 431 problem+json naming the cap, charging nothing, which /decide/nginx says as
403 with X-Gateway-Status: 431.
"""

from __future__ import annotations

import base64
import json

import aiohttp
import pytest

from gateway.testing import running_gateway
from tests.beside_proxies import running_nginx
from tests.processes import GatewayProcess, free_port
from tests.upstream import RecordingUpstream, serving

JWT_SIZE = 1_845  # the header value measured: "Bearer " and a token
LARGE_SIZE = 7 * 1024  # a token with many group claims, still under nginx's 8k header buffer

LIMITS = """
limits:
  bearer: {{rate: 1/hour, burst: 2, key: [header:Authorization, ip]}}
  session: {{rate: 1/hour, burst: 2, key: cookie:session}}
  both: {{rate: 1/hour, burst: 2, key: [[header:Authorization, cookie:session]]}}
routes:
  - match: {{path: /api}}
    upstream: {upstream}
    limits: [bearer]
  - match: {{path: /web}}
    upstream: {upstream}
    limits: [session]
  - match: {{path: /both}}
    upstream: {upstream}
    limits: [both]
"""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def token(size: int, client: int) -> str:
    """A JWT-shaped value of exactly `size` characters: a header, claims with group ids,
    a signature. `client` makes it one client's."""
    head = _b64(json.dumps({"alg": "RS256", "typ": "JWT", "kid": "key-1"}).encode())
    signature = _b64(bytes(range(256)))
    claims = {"sub": f"user-{client}", "groups": []}
    while True:
        body = _b64(json.dumps(claims).encode())
        if len(head) + len(body) + len(signature) + 2 >= size:
            break
        claims["groups"].append(f"{len(claims['groups']):08x}-5b8e-4c2a-9d7f-{client:012d}")
    value = f"{head}.{body}.{signature}"[:size]
    assert len(value) == size
    return value


def bearer(size: int, client: int) -> str:
    return "Bearer " + token(size - len("Bearer "), client)


async def _statuses(client: aiohttp.ClientSession, url: str, headers: dict[str, str], times: int = 3) -> list[int]:
    statuses = []
    for _ in range(times):
        async with client.get(url, headers=headers) as response:
            await response.read()
            statuses.append(response.status)
    return statuses


@pytest.mark.parametrize("size", [JWT_SIZE, LARGE_SIZE])
async def test_real_size_tokens_and_cookies_are_identities(size: int) -> None:
    upstream = RecordingUpstream()
    async with serving(upstream.handle) as upstream_url, running_gateway(LIMITS.format(upstream=upstream_url)) as gw:
        async with aiohttp.ClientSession() as client:
            by_token = await _statuses(client, gw.url + "/api/a", {"Authorization": bearer(size, 1)})
            other_token = await _statuses(client, gw.url + "/api/a", {"Authorization": bearer(size, 2)}, times=1)
            by_cookie = await _statuses(client, gw.url + "/web/a", {"Cookie": f"theme=dark; session={token(size, 1)}"})
            other_cookie = await _statuses(client, gw.url + "/web/a", {"Cookie": f"session={token(size, 2)}"}, times=1)
    assert by_token == [200, 200, 429]  # the token's own bucket, not the address's
    assert other_token == [200]
    assert by_cookie == [200, 200, 429]
    assert other_cookie == [200]
    assert upstream.requests == 6


async def test_past_the_cap_is_431_naming_it_and_charges_nothing() -> None:
    """At the default cap, a composite of a 5 KiB token and a 5 KiB cookie is past it; a
    lower `identity_max_length` refuses a 7 KiB token and takes a 1,845-byte one."""
    upstream = RecordingUpstream()
    async with serving(upstream.handle) as upstream_url:
        async with running_gateway(LIMITS.format(upstream=upstream_url)) as gw, aiohttp.ClientSession() as client:
            both = {"Authorization": bearer(5 * 1024, 1), "Cookie": f"session={token(5 * 1024, 1)}"}
            async with client.get(gw.url + "/both/a", headers=both) as response:
                composite = response.status, response.headers["Content-Type"], await response.json(content_type=None)
        lowered = "identity_max_length: 4KiB\n" + LIMITS.format(upstream=upstream_url)
        async with running_gateway(lowered) as gw, aiohttp.ClientSession() as client:
            async with client.get(gw.url + "/api/a", headers={"Authorization": bearer(LARGE_SIZE, 1)}) as response:
                large = response.status, await response.json(content_type=None)
            small = await _statuses(client, gw.url + "/api/a", {"Authorization": bearer(JWT_SIZE, 1)})
    assert composite[0] == 431 and composite[1].startswith("application/problem+json")
    assert "longer than 8192 characters" in composite[2]["detail"]
    assert large[0] == 431 and "longer than 4096 characters" in large[1]["detail"]
    assert small == [200, 200, 429]  # the refused token charged nothing, and neither did the address
    assert upstream.requests == 2


NGINX_CONFIG = "decision_listen: 127.0.0.1:{decision_port}\ntrusted_proxies: [127.0.0.1/32]\n{extra}" + LIMITS


async def test_through_nginx_real_size_tokens_pass_and_past_the_cap_is_431_to_nginx() -> None:
    upstream = RecordingUpstream()
    async with serving(upstream.handle) as upstream_url:
        upstream_port = int(upstream_url.rsplit(":", 1)[1])
        answers: dict[str, list[int]] = {}
        for extra in ("", "identity_max_length: 4KiB\n"):
            port = free_port()
            config = NGINX_CONFIG.format(decision_port=port, extra=extra, upstream="http://127.0.0.1:9")
            with GatewayProcess(config), running_nginx(decision_port=port, upstream_port=upstream_port) as nginx:
                async with aiohttp.ClientSession() as client:
                    for size in (JWT_SIZE, LARGE_SIZE):
                        name = f"{extra or 'default'} {size}"
                        answers[name + " token"] = await _statuses(client, nginx + "/api/a", {"Authorization": bearer(size, size)})
                        answers[name + " cookie"] = await _statuses(client, nginx + "/web/a", {"Cookie": f"session={token(size, size)}"})
                    async with client.get(f"http://127.0.0.1:{port}/decide/nginx", headers={
                        "X-Original-Method": "GET", "X-Original-URI": "/api/a", "Authorization": bearer(LARGE_SIZE, 9),
                    }) as direct:
                        answers[extra or "default"] = [direct.status, int(direct.headers.get("X-Gateway-Status", 0))]
    print(f"\nthrough nginx: {answers}")
    for size in (JWT_SIZE, LARGE_SIZE):
        assert answers[f"default {size} token"] == [200, 200, 429]
        assert answers[f"default {size} cookie"] == [200, 200, 429]
    assert answers["default"] == [200, 0]
    lowered = "identity_max_length: 4KiB\n"
    assert answers[f"{lowered} {JWT_SIZE} token"] == [200, 200, 429]
    # Past the cap: nginx is told 403 with the gateway's 431, and the client never passes.
    assert answers[lowered] == [403, 431]
    for kind in ("token", "cookie"):
        # The snippet passes the gateway's 431 on, not a rate limit's 429.
        assert answers[f"{lowered} {LARGE_SIZE} {kind}"] == [431, 431, 431]
    assert upstream.requests == 4 * 2 + 2 * 2  # two of each default case, two of each 1,845-byte one
