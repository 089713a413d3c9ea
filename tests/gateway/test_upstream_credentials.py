"""An upstream URL with user information (`http://user:pass@host`) is the gateway's own
login to that upstream: its Basic credentials replace any Authorization a request carries,
for HTTP requests and WebSocket handshakes alike, and the upstream sees exactly one.

The gateway runs as users run it (`gateway run`), so its stderr can be searched for a
traceback; the upstream is a real aiohttp server that reports what it received."""

from __future__ import annotations

import base64

import aiohttp
import pytest
from aiohttp import web

from tests.processes import GatewayProcess, free_port
from tests.raw_client import RAW_TIMEOUT
from tests.upstream import serving

GATEWAYS_LOGIN = "Basic " + base64.b64encode(b"svc:s3cr3t").decode()
CLIENTS = ["Bearer client-token", "Basic " + base64.b64encode(b"mallory:guess").decode()]


async def reporting(request: web.BaseRequest) -> web.StreamResponse:
    """Every Authorization line the upstream got: in a JSON body, or as a WebSocket's first message."""
    seen = request.headers.getall("Authorization", [])
    if request.headers.get("Upgrade", "").lower() != "websocket":
        return web.json_response(seen)
    ws = web.WebSocketResponse()
    await ws.prepare(request)
    await ws.send_json(seen)
    await ws.close()
    return ws


def config(upstream: str) -> str:
    with_login = upstream.replace("http://", "http://svc:s3cr3t@")
    return f"listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\nroutes:\n  - match: {{path: /}}\n    upstream: {with_login}\n"


@pytest.mark.parametrize("authorization", [None, *CLIENTS])
async def test_the_upstream_urls_credentials_replace_the_clients_authorization(authorization):
    headers = {"Authorization": authorization} if authorization else {}
    async with serving(reporting) as upstream, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=RAW_TIMEOUT)) as http:
        with GatewayProcess(config(upstream)) as gw:
            async with http.get(gw.url + "/items", headers=headers) as response:
                assert response.status == 200
                assert await response.json() == [GATEWAYS_LOGIN]
            async with http.ws_connect(gw.url + "/ws", headers=headers) as ws:
                assert await ws.receive_json(timeout=RAW_TIMEOUT) == [GATEWAYS_LOGIN]
    assert "Traceback" not in "".join(gw.stderr_lines)


async def test_the_log_names_an_upstream_with_credentials_without_its_password():
    """A request and a WebSocket handshake to an upstream nothing listens on: each 502 is
    logged with the upstream's URL, its password as ***."""
    dead = f"http://127.0.0.1:{free_port()}"
    with GatewayProcess(config(dead)) as gateway:
        async with aiohttp.ClientSession() as http:
            async with http.get(gateway.url + "/a") as response:
                assert response.status == 502
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await http.ws_connect(gateway.url.replace("http", "ws", 1) + "/ws")
            assert refused.value.status == 502
        gateway.stop()
        logged = "".join(gateway.stderr_lines)
    assert "cannot connect to upstream http://svc:***@127.0.0.1" in logged
    assert "cannot open a WebSocket to upstream http://svc:***@127.0.0.1" in logged
    assert "s3cr3t" not in logged
