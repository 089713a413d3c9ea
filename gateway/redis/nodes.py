"""The Redis nodes a store talks to, built from the parsed store URL.

One node (`redis://`, `rediss://`, `unix://`, or the master Sentinel names) is a
`OneNode`; a Cluster is a `RedisCluster`. Both have one face: every command
names the hash slot of its keys, which one node ignores, so the store above
never asks which topology it runs on.

Trusts the target the config loader validated; every failure below is `StoreError`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from gateway.config.model import StoreConfig
from gateway.config.store_url import ClusterTarget, SentinelTarget, SingleTarget, StoreTarget
from gateway.redis import sentinel
from gateway.redis.cluster import RedisCluster
from gateway.redis.connection import RedisAddress, RedisConnection, Waiter, address_of


def nodes_for(config: StoreConfig, *, connect_timeout: float) -> OneNode | RedisCluster:
    target: StoreTarget | None = config.target  # type: ignore[attr-defined]  # an InitVar that __post_init__ sets
    if isinstance(target, ClusterTarget):
        return RedisCluster(target, timeout=config.timeout, connect_timeout=connect_timeout, max_pending=config.max_pending)
    assert target is not None  # StoreConfig parses its url when it is not given the target
    return OneNode(target, config, connect_timeout=connect_timeout)


class OneNode:
    """A single Redis (or the master Sentinel names) over one pipelined connection,
    with the same face as `RedisCluster`: the slot of a command is ignored."""

    def __init__(self, target: SingleTarget | SentinelTarget, config: StoreConfig, *, connect_timeout: float) -> None:
        if isinstance(target, SentinelTarget):
            service = target
            address = RedisAddress(host=service.sentinels[0][0], port=service.sentinels[0][1])

            async def master() -> RedisAddress:
                return await sentinel.master_address(service, timeout=connect_timeout / len(service.sentinels))

            resolve: Callable[[], Awaitable[RedisAddress]] | None = master
        else:
            address, resolve = address_of(target, tls_ca_file=config.tls_ca_file), None
        self.connection = RedisConnection(
            address,
            timeout=config.timeout,
            connect_timeout=connect_timeout,
            max_pending=config.max_pending,
            resolve=resolve,
        )

    async def connect(self) -> None:
        await self.connection.connect()

    async def ping(self) -> None:
        # The readiness probe connects at once, without waiting for the reconnect backoff.
        await self.connection.connect()
        await self.connection.execute("PING", timeout=max(self.connection.timeout, 0.25))

    def connection_for(self, slot: int) -> RedisConnection:
        return self.connection

    def execute(
        self, slot: int, *args: object, timeout: float | None = None, weight: int = 1, waiter: Waiter | None = None
    ) -> Awaitable[Any]:
        return self.connection.execute(*args, timeout=timeout, weight=weight, waiter=waiter)

    async def on_every_master(self, *args: object, timeout: float) -> None:
        await self.connection.execute(*args, timeout=timeout)

    async def close(self) -> None:
        await self.connection.close()
