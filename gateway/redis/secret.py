"""The identity-hashing secret a fleet of gateways agrees on through Redis.

Bucket and lease keys hash the client's identity with a secret, so gateways
sharing a Redis must hash with the same one. Unless `store.key_secret` sets it,
the first gateway to start picks one and stores it under `<prefix>identity-secret`
(SET NX), and the rest read it. A Redis that restarted empty has lost it: the
secret this gateway already hashes with is offered again, so gateways started
before and after the restart agree, and each gateway re-reads it every
SECRET_REREAD_SECONDS in case another one picked a new secret meanwhile.

Trusts Redis to keep the value it was given; a key that vanished between SET
and GET is a StoreError like any other failure.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from gateway.limiter.store import StoreError
from gateway.redis.cluster import key_slot

log = logging.getLogger(__name__)

# Gateways sharing a Redis share this identity-hashing secret unless key_secret is set.
SECRET_KEY_SUFFIX = "identity-secret"
# How often a gateway re-reads that secret, so a fleet agrees again within this
# long after a Redis that keeps no data restarts (set store.key_secret to avoid it).
SECRET_REREAD_SECONDS = 10.0

T = TypeVar("T")


class SecretChanged(StoreError):
    """Redis holds another identity secret than the one a command's keys were hashed with."""


class _Nodes(Protocol):
    def execute(self, slot: int, *args: Any, timeout: float | None = None) -> Awaitable[Any]: ...


class FleetSecret:
    """The secret this gateway hashes identities with: `key_secret`, or the fleet's."""

    def __init__(self, nodes: _Nodes, *, key_secret: str | None, prefix: str, timeout: float, description: str) -> None:
        self._nodes = nodes
        self.fixed = bool(key_secret)  # set in the config: nothing to agree on
        self.value: bytes | None = key_secret.encode() if key_secret else None
        self._name = f"{prefix}{SECRET_KEY_SUFFIX}"
        self._timeout = timeout
        self._description = description
        self._read_at = 0.0
        self._sharing: asyncio.Future[None] | None = None
        self._rereading: asyncio.Future[None] | None = None

    async def ensure(self) -> bytes:
        """The secret, agreed on with the fleet first if this gateway has none yet."""
        if self.value is None:
            await self.share()
        assert self.value is not None
        return self.value

    async def run(self, call: Callable[[bytes], Awaitable[T]]) -> T:
        """`call(secret)` once the secret is known; once more with the new secret when Redis
        lost the old one in an empty restart (`SecretChanged`), since the first call's keys
        were hashed with it. Then, now and again, the secret is re-read in the background."""
        for attempt in range(2):
            secret = await self.ensure()
            try:
                result = await call(secret)
                break
            except SecretChanged:
                if attempt:
                    raise
        self._maybe_reread()
        return result

    async def after_noscript(self) -> None:
        """An emptied script cache may mean a restart that also lost the secret: offer ours
        again before another gateway picks a new one, and raise SecretChanged if one did."""
        if self.fixed:
            return
        secret = self.value
        await self.share()
        if self.value != secret:
            raise SecretChanged(f"{self._description}: the identity secret changed")

    async def share(self) -> None:
        """Agree with the fleet on the secret kept in Redis, one exchange at a time."""
        if self._sharing is None or self._sharing.done():
            self._sharing = asyncio.ensure_future(self._exchange())
        sharing = self._sharing
        try:
            await asyncio.shield(sharing)
        finally:
            if sharing.done() and self._sharing is sharing:
                self._sharing = None

    def close(self) -> None:
        if self._rereading is not None:
            self._rereading.cancel()

    async def _exchange(self) -> None:
        offer = self.value if self.value is not None else os.urandom(32).hex().encode()
        execute, slot = self._nodes.execute, key_slot(self._name)
        replies = await asyncio.gather(
            execute(slot, "SET", self._name, offer, "NX", timeout=self._timeout),
            execute(slot, "GET", self._name, timeout=self._timeout),
            return_exceptions=True,
        )
        for reply in replies:
            if isinstance(reply, BaseException):
                raise reply
        value = replies[1]
        assert not isinstance(value, BaseException)  # raised above
        if value is None:
            raise StoreError(f"{self._description}: the identity secret {self._name!r} vanished from Redis")
        self.value = value
        self._read_at = time.monotonic()

    def _maybe_reread(self) -> None:
        """Every SECRET_REREAD_SECONDS, in the background, adopt the secret Redis holds now:
        without it, gateways started before an empty restart would keep hashing with the old
        secret, and every client would get one bucket per secret."""
        if self.fixed or (self._sharing is not None and not self._sharing.done()):
            return
        now = time.monotonic()
        if now - self._read_at < SECRET_REREAD_SECONDS:
            return
        self._read_at = now
        # Kept: the event loop holds tasks only weakly.
        self._rereading = asyncio.ensure_future(self._reread())

    async def _reread(self) -> None:
        try:
            await self.share()
        except StoreError as exc:
            log.debug("could not re-read the identity secret: %s", exc)
