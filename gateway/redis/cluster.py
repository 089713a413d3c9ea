"""Redis Cluster: the slot map, and one pipelined connection per master.

`redis+cluster://[user:password@]host:7000,host:7001` names seed nodes. At start
the store asks a seed for the slot map (CLUSTER SLOTS) and connects to every
master before the gateway takes its first request, so no request races the
discovery. Each command names the slot of its keys and goes to that slot's
master over the master's `RedisConnection`: checks keep the single-node
client's batching and its store-measured timeouts.

Redirections are followed, never guessed. MOVED (a failover or a finished
migration moved the slot) records the slot's new owner and sends the command
there; ASK (the slot is migrating and this key has moved already) sends it once
to the target, after ASKING. Both replies mean the command did not run, so
sending it again cannot charge twice. A MOVED, a CLUSTERDOWN or a failed
command also has the slot map read afresh, at most every MIN_REFRESH_INTERVAL.
TRYAGAIN (a script whose keys a migration has split) is a store error like any
other: the failure policy decides that request.

Trusts the cluster's nodes to name the owners of slots. Every failure becomes
`StoreError`.
"""

from __future__ import annotations

import asyncio
import binascii
import logging
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.config.store_url import ClusterTarget, Node
from gateway.limiter.store import StoreError
from gateway.redis.connection import RedisAddress, RedisConnection, RedisReplyError

log = logging.getLogger(__name__)

SLOT_COUNT = 16384
# MOVED then ASK is the most a migration should need; more means a confused cluster.
MAX_REDIRECTS = 3
# The slot map is read again at most this often, however many commands fail.
MIN_REFRESH_INTERVAL = 0.1


def key_slot(key: bytes | str) -> int:
    """The hash slot of a key: CRC16 (XMODEM) of its hash tag, or of the whole key, mod 16384."""
    data = key.encode() if isinstance(key, str) else key
    start = data.find(b"{")
    if start >= 0:
        end = data.find(b"}", start + 1)
        if end > start + 1:
            data = data[start + 1 : end]
    return binascii.crc_hqx(data, 0) % SLOT_COUNT


@dataclass(frozen=True)
class SlotMap:
    owners: tuple[Node | None, ...]  # per slot, its master
    nodes: tuple[Node, ...]  # every node named, masters first, to ask next time


def parse_cluster_slots(reply: Sequence[Any], asked: Node) -> SlotMap:
    """A CLUSTER SLOTS reply as a slot map. A node named with an empty host (or "?")
    is on the host that was asked."""
    owners: list[Node | None] = [None] * SLOT_COUNT
    masters: list[Node] = []
    replicas: list[Node] = []
    for entry in reply:
        first, last = int(entry[0]), int(entry[1])
        nodes = []
        for node in entry[2:]:
            host = node[0].decode() if isinstance(node[0], bytes) else str(node[0])
            nodes.append((asked[0] if host in ("", "?") else host, int(node[1])))
        if not nodes:
            continue
        owners[first : last + 1] = [nodes[0]] * (last - first + 1)
        masters.append(nodes[0])
        replicas += nodes[1:]
    return SlotMap(owners=tuple(owners), nodes=tuple(dict.fromkeys(masters + replicas)))


def parse_redirect(reply: str, default_host: str) -> tuple[int, Node]:
    """`MOVED 3999 127.0.0.1:6381` or `ASK 3999 [::1]:6381` as (slot, node)."""
    _, slot, address = reply.split(" ", 2)
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    return int(slot), (host or default_host, int(port))


class RedisCluster:
    """The masters of a Redis Cluster, one pipelined connection each, and the slot map."""

    def __init__(self, seeds: ClusterTarget, *, timeout: float, connect_timeout: float, max_pending: int) -> None:
        self.seeds = seeds
        self.timeout = timeout
        self._connect_timeout = connect_timeout
        self._max_pending = max_pending
        self._owners: list[RedisConnection | None] = [None] * SLOT_COUNT
        self._connections: dict[Node, RedisConnection] = {}
        self._known_nodes: tuple[Node, ...] = seeds.nodes
        self._refreshing: asyncio.Task[None] | None = None
        self._refreshed_at = -MIN_REFRESH_INTERVAL
        self._closed = False
        self._closing: set[asyncio.Future[None]] = set()  # connections of demoted masters, closing

    def __str__(self) -> str:
        return str(self.seeds)

    @property
    def masters(self) -> list[RedisConnection]:
        return list(dict.fromkeys(c for c in self._owners if c is not None))

    async def connect(self) -> None:
        """Read the slot map and connect to every master; raise StoreError unless all answer."""
        await self._refresh()
        await self._on_every_master(lambda connection: connection.connect())

    async def ping(self) -> None:
        """Raise StoreError unless every slot has a master and every master answers PING now."""
        if any(owner is None for owner in self._owners):
            self._refresh_soon()
            raise StoreError(f"redis {self}: some hash slots have no known master")
        timeout = max(self.timeout, 0.25)

        async def ping(connection: RedisConnection) -> None:
            await connection.connect()
            await connection.execute("PING", timeout=timeout)

        await self._on_every_master(ping)

    async def on_every_master(self, *args: Any, timeout: float) -> None:
        """Run one command on every master (SCRIPT LOAD)."""
        await self._on_every_master(lambda connection: connection.execute(*args, timeout=timeout))

    async def close(self) -> None:
        self._closed = True
        if self._refreshing is not None:
            self._refreshing.cancel()
        await asyncio.gather(*(connection.close() for connection in self._connections.values()))

    def connection_for(self, slot: int) -> RedisConnection | None:
        """The connection `execute` queues a command of `slot` on at once, if there is one."""
        connection = self._owners[slot]
        # A master that lost its connection goes through execute, whose refusal refreshes the
        # slot map: a promoted replica is then followed at once, not at the next refresh.
        return connection if connection is not None and connection.connected else None

    def execute(
        self, slot: int, *args: Any, timeout: float | None = None, weight: int = 1, waiter: object = None
    ) -> Awaitable[Any]:
        """Run one command, carrying `weight` checks, on the master of `slot`, following MOVED
        and ASK. On a master connected before, the command is queued before this returns, so
        commands issued together share a write; StoreError may be raised at once. `waiter` is
        not used: a redirect needs the reply awaited here."""
        connection = self._owners[slot]
        if connection is None:
            self._refresh_soon()
            raise StoreError(f"redis {self}: no master known for slot {slot}")
        first = None
        if connection.ever_connected:
            try:
                first = connection.execute(*args, timeout=timeout, weight=weight)
            except StoreError:
                self._refresh_soon()  # a lost or silent master may have failed over
                raise
        return self._follow(slot, connection, first, args, timeout, weight)

    async def _follow(
        self,
        slot: int,
        connection: RedisConnection,
        first: asyncio.Future[Any] | None,
        args: tuple[Any, ...],
        timeout: float | None,
        weight: int,
    ) -> Any:
        """`execute`'s reply: `first`'s, or, after a redirect, the reply of the node it names."""
        asking = False
        for _ in range(MAX_REDIRECTS + 1):
            try:
                if first is not None:
                    reply, first = first, None
                    return await reply
                if not connection.ever_connected:
                    # A master named since the last connect (a promoted replica, a
                    # migration's target) is worth one timeout's wait. A known master
                    # that lost its connection is reconnecting with backoff: its checks
                    # fail at once rather than each trying to connect.
                    await self._connected(connection)
                if asking:
                    # ASKING lets the next command on this connection, and only it, use the
                    # importing slot; both go out in the same write.
                    ask_first = connection.execute("ASKING", timeout=timeout)
                    reply = connection.execute(*args, timeout=timeout, weight=weight)
                    await asyncio.gather(ask_first, return_exceptions=True)
                    return await reply
                return await connection.execute(*args, timeout=timeout, weight=weight)
            except RedisReplyError as exc:
                error = exc.reply
                if error.startswith("MOVED "):
                    moved_slot, node = parse_redirect(error, connection.address.host)
                    connection = self._connection(node)
                    self._owners[moved_slot] = connection
                    asking = False
                    self._refresh_soon()  # one MOVED usually means many slots moved
                elif error.startswith("ASK "):
                    connection, asking = self._connection(parse_redirect(error, connection.address.host)[1]), True
                else:
                    if error.startswith("CLUSTERDOWN"):
                        self._refresh_soon()
                    raise
            except StoreError:
                self._refresh_soon()  # a lost or silent master may have failed over
                raise
        raise StoreError(f"redis {self}: slot {slot} redirected more than {MAX_REDIRECTS} times")

    # -- the slot map ----------------------------------------------------------

    def _connection(self, node: Node) -> RedisConnection:
        connection = self._connections.get(node)
        if connection is None:
            address = RedisAddress(host=node[0], port=node[1], username=self.seeds.username, password=self.seeds.password)
            connection = RedisConnection(
                address, timeout=self.timeout, connect_timeout=self._connect_timeout, max_pending=self._max_pending
            )
            self._connections[node] = connection
        return connection

    async def _connected(self, connection: RedisConnection) -> None:
        """Connect a master named since the last connect, within one command's timeout."""
        try:
            async with asyncio.timeout(self.timeout):
                await connection.connect()
        except TimeoutError:
            raise StoreError(f"redis {connection.address}: cannot connect within {self.timeout * 1000:g} ms") from None

    async def _on_every_master(self, action: Any) -> None:
        results = await asyncio.gather(*(action(c) for c in self.masters), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    def _refresh_soon(self) -> None:
        """Read the slot map again in the background, no sooner than MIN_REFRESH_INTERVAL after the last read."""
        if self._closed or (self._refreshing is not None and not self._refreshing.done()):
            return
        delay = max(0.0, self._refreshed_at + MIN_REFRESH_INTERVAL - time.monotonic())
        self._refreshing = asyncio.get_running_loop().create_task(self._refresh_later(delay))

    async def _refresh_later(self, delay: float) -> None:
        await asyncio.sleep(delay)
        try:
            await self._refresh()
        except StoreError as exc:
            log.warning("redis %s: cannot read the slot map: %s", self, exc)

    async def _refresh(self) -> None:
        """Ask the known nodes in turn for the slot map; the first answer wins."""
        self._refreshed_at = time.monotonic()
        reasons = []
        for node in dict.fromkeys(self._known_nodes + self.seeds.nodes):
            try:
                reply = await self._ask(node, "CLUSTER", "SLOTS")
            except StoreError as exc:
                reasons.append(str(exc))
                continue
            self._adopt(parse_cluster_slots(reply, node))
            return
        raise StoreError(f"redis {self}: no node gave the slot map: {'; '.join(reasons)}")

    async def _ask(self, node: Node, *args: Any) -> Any:
        connection = self._connections.get(node)
        if connection is not None and connection.connected:
            return await connection.execute(*args, timeout=self._connect_timeout)
        # A node not yet connected is connected for good: it is most likely a master.
        # `_adopt` closes it if it is not.
        connection = self._connection(node)
        try:
            await connection.connect()
            return await connection.execute(*args, timeout=self._connect_timeout)
        except StoreError:
            if connection not in self._owners:
                del self._connections[node]
                await connection.close()
            raise

    def _adopt(self, slots: SlotMap) -> None:
        if slots.nodes:
            self._known_nodes = slots.nodes
        self._owners = [self._connection(node) if node is not None else None for node in slots.owners]
        owners = set(self._owners)
        for node, connection in list(self._connections.items()):
            # A demoted master's waiting commands are answered MOVED and followed;
            # its connection goes once nothing waits on it.
            if connection not in owners and connection.pending == 0:
                del self._connections[node]
                closing = asyncio.ensure_future(connection.close())
                self._closing.add(closing)  # the event loop holds tasks only weakly
                closing.add_done_callback(self._closing.discard)
        for owner in owners:
            if owner is not None and not owner.connected:
                owner.connect_soon()
