"""Small helpers more than one test module uses: reading config errors and Redis's script
calls, opening a store, flooding a gateway with clients and refused WebSocket handshakes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable

import aiohttp
import pytest
import redis

from gateway.config import ConfigError, parse_config
from gateway.config.model import StoreConfig
from gateway.limiter.memory_store import MemoryStore
from gateway.limiter.store import Store
from gateway.redis.store import RedisStore

SOURCE = "gw.yaml"  # the file name a parsed text is given, and every error it raises starts with


def error_of(text: str, environ: dict[str, str] | None = None, *, source: str = SOURCE) -> str:
    """The ConfigError parsing `text` raises, as one line that starts with the file's name."""
    with pytest.raises(ConfigError) as info:
        parse_config(text, source=source, environ=environ or {})
    message = str(info.value)
    assert "\n" not in message, message
    assert message.startswith(f"{source}: "), message
    return message


def script_calls(client: redis.Redis) -> int:
    """How many EVALSHA calls the Redis behind `client` has answered since it started."""
    return client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)


def store_config(
    url: str, *, timeout: float = 1.0, max_pending: int = 4096, key_secret: str | None = "s" * 32
) -> StoreConfig:
    """A Redis store's settings as the tests use them: prefix rl:, the whole limit on every gateway."""
    return StoreConfig(url=url, timeout=timeout, prefix="rl:", local_divisor=1, max_pending=max_pending, key_secret=key_secret)


@contextlib.asynccontextmanager
async def redis_store(url: str, **settings) -> AsyncIterator[RedisStore]:
    """A started RedisStore on `url` with `store_config`'s `settings`, closed on the way out."""
    store = RedisStore(store_config(url, **settings))
    await store.start()
    try:
        yield store
    finally:
        await store.close()


@contextlib.asynccontextmanager
async def open_store(url: str | None, **settings) -> AsyncIterator[Store]:
    """The in-process store when `url` is None, else `redis_store(url, **settings)`."""
    if url is not None:
        async with redis_store(url, **settings) as store:
            yield store
        return
    memory = MemoryStore()
    try:
        yield memory
    finally:
        await memory.close()


async def flood(http: aiohttp.ClientSession, url: str, keys: Iterable[str], *, at_once: int = 64) -> dict[int, int]:
    """GET `url` once with each of `keys` as its X-API-Key, `at_once` requests at a time;
    how many answers came with each status."""
    statuses: dict[int, int] = {}

    async def send(key: str) -> None:
        async with http.get(url, headers={"X-API-Key": key}) as response:
            await response.read()
            statuses[response.status] = statuses.get(response.status, 0) + 1

    pending = iter(keys)

    async def sender() -> None:
        # Each sender takes the next key as soon as its own answer is in: `at_once` in
        # flight throughout, with no batch waiting for its slowest request.
        for key in pending:
            await send(key)

    await asyncio.gather(*(sender() for _ in range(at_once)))
    return statuses


async def refused_handshake(client: aiohttp.ClientSession, url: str, **options) -> int:
    """The status a WebSocket handshake to `url` is refused with; fails if it is accepted."""
    try:
        ws = await client.ws_connect(url, **options)
    except aiohttp.WSServerHandshakeError as exc:
        return exc.status
    await ws.close()
    raise AssertionError(f"a WebSocket handshake to {url} was accepted")
