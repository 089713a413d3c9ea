"""Fixtures every test module may use: a real aiohttp upstream, a private redis-server, an HTTP client."""

import aiohttp
import pytest

from tests.processes import RedisServer
from tests.upstream import running_upstream


@pytest.fixture
async def upstream():
    """The URL of a real aiohttp upstream running in the test's event loop."""
    async with running_upstream() as url:
        yield url


@pytest.fixture
def redis_server():
    with RedisServer() as server:
        yield server


@pytest.fixture
def dedicated_redis():
    """A private redis-server at real-time CPU priority: a Redis with a host of its own."""
    with RedisServer(dedicated=True) as server:
        yield server


@pytest.fixture
async def client():
    """An HTTP client that shows bodies as sent (no automatic decompression) and sends
    Cookie headers as set (with a cookie jar, aiohttp re-parses and rewrites them)."""
    async with aiohttp.ClientSession(auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar()) as session:
        yield session
