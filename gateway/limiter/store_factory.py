"""Pick the store for a config: a table keyed by URL scheme, never an import path from YAML."""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import urlsplit

from gateway.config.model import StoreConfig
from gateway.limiter.memory_store import DEFAULT_MAX_BYTES, MemoryStore
from gateway.limiter.redis_store import RedisStore
from gateway.limiter.store import Store

STORES_BY_SCHEME: dict[str, Callable[[StoreConfig], Store]] = {
    "redis": RedisStore,
    "rediss": RedisStore,
    "unix": RedisStore,
    "redis+sentinel": RedisStore,  # finds the master through Sentinel
    "redis+cluster": RedisStore,  # one connection per master, commands routed by hash slot
}


def make_store(
    config: StoreConfig | None, *, local_memory: int = DEFAULT_MAX_BYTES, on_evict: Callable[[], None] | None = None
) -> Store:
    """The in-process store, of `local_memory` bytes, when no store is configured; otherwise
    the store for the URL's scheme."""
    if config is None:
        return MemoryStore(max_bytes=local_memory, on_evict=on_evict)
    return STORES_BY_SCHEME[urlsplit(config.url).scheme](config)
