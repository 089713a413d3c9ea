"""What the proxy holds for each upstream base URL: its connection slots, its keep-alive
HTTP/1.1 client and its WebSocket sessions. The proxy handler makes one per URL and keeps
it across reloads while any config names it; the route plans hold the ones their targets
send to, so a request reaches its upstream without a lookup. Trusts the config's URLs.
"""

from __future__ import annotations

import ssl

import aiohttp
from yarl import URL

from gateway.upstream.client import UpstreamClient
from gateway.upstream.connection import DEFAULT_BOUNDS, HeadBounds
from gateway.upstream.slots import UpstreamSlots


class Upstream:
    """What one upstream base URL has in this process: its slots, its keep-alive HTTP/1.1
    connections, and the aiohttp sessions its WebSocket handshakes go out on."""

    def __init__(self, url: str, connections: int, tls: ssl.SSLContext | None, bounds: HeadBounds = DEFAULT_BOUNDS) -> None:
        """`tls`: the context of an https `url` (None for http); `bounds`: its response heads'."""
        self.url = url
        self.slots = UpstreamSlots(connections)
        self.client = UpstreamClient(url, tls, bounds)
        # aiohttp's ws_connect refuses an Authorization header beside credentials in its URL
        # (a ValueError, so a 500): handshakes go to the URL without them, and the URL's
        # credentials as the header, replacing the client's as they do for HTTP requests.
        self.ws_base = str(URL(url).with_user(None))
        self.ws_authorization = self.client.endpoint.authorization
        # By (connect timeout, read timeout): ws_connect takes no ClientTimeout, so each
        # route's timeouts need a session of their own to bound the handshake.
        self._ws_sessions: dict[tuple[float, float], aiohttp.ClientSession] = {}

    def ws_session(self, connect_timeout: float, read_timeout: float) -> aiohttp.ClientSession:
        key = (connect_timeout, read_timeout)
        session = self._ws_sessions.get(key)
        if session is None:
            session = self._ws_sessions[key] = aiohttp.ClientSession(
                # Slots bound the connections; aiohttp lifts the read timeout once upgraded.
                connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=60),
                auto_decompress=False,
                cookie_jar=aiohttp.DummyCookieJar(),
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
                trust_env=False,
                # `connect` bounds the host name's lookup too, as timeout.connect does for HTTP.
                timeout=aiohttp.ClientTimeout(total=None, connect=key[0], sock_connect=key[0], sock_read=key[1]),
            )
        return session

    async def close(self) -> None:
        self.client.close()
        sessions = list(self._ws_sessions.values())
        self._ws_sessions.clear()
        for session in sessions:
            await session.close()
