"""Pick the store for a config: the in-process store, or Redis when `store` is set.

It sits above both `gateway.limiter` and `gateway.redis`, so the limiter core never
imports the Redis client. The store URL was parsed once, by the config loader
(`gateway.config.store_url`); the Redis store connects by that target. Trusts the
config it is given; nothing from YAML becomes an import path.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.config.model import StoreConfig
from gateway.limiter.memory_store import DEFAULT_MAX_BYTES, MemoryStore
from gateway.limiter.store import Store
from gateway.redis.store import RedisStore


def make_store(
    config: StoreConfig | None, *, local_memory: int = DEFAULT_MAX_BYTES, on_evict: Callable[[], None] | None = None
) -> Store:
    """The in-process store, of `local_memory` bytes, when no store is configured; otherwise
    the Redis store (one node, Sentinel or Cluster, as its target says)."""
    if config is None:
        return MemoryStore(max_bytes=local_memory, on_evict=on_evict)
    return RedisStore(config)
