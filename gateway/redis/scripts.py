"""The Lua scripts the Redis store runs: read from `lua/` once per store, called by SHA.

Each script is a `Script`, its text and SHA1 together. A call is EVALSHA; only a
NOSCRIPT reply, which means nothing ran (a restart, a failover or SCRIPT FLUSH
emptied the script cache), is answered by sending the text itself with EVAL,
which also caches it for the next EVALSHA. No other error is retried: a retried
call could charge a client twice.

Trusts the package's own `lua/` files and Redis's error replies.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

from gateway.limiter.store import StoreError
from gateway.redis.connection import RedisReplyError, Waiter

SCRIPT_NAME = "token_bucket.lua"
REFUND_SCRIPT_NAME = "token_refund.lua"
CONCURRENCY_SCRIPT_NAME = "concurrency_lease.lua"
TOKEN_LEASE_SCRIPT_NAME = "token_lease.lua"


def load_script(name: str = SCRIPT_NAME) -> str:
    """A Lua script shipped inside the package (the top-level `lua/` folder). Run from a
    source checkout (`python -m gateway` in its root, over an install that is not
    editable), the package has no `gateway.lua`: the checkout's `lua/` is read instead."""
    try:
        scripts = resources.files("gateway.lua")
    except ModuleNotFoundError:
        scripts = Path(__file__).resolve().parents[2] / "lua"
    return scripts.joinpath(name).read_text(encoding="utf-8")


class Nodes(Protocol):
    """What a script is run on: one Redis, or a Cluster that routes by slot."""

    def execute(
        self, slot: int, *args: Any, timeout: float | None = None, weight: int = 1, waiter: Waiter | None = None
    ) -> Awaitable[Any]: ...


@dataclass(frozen=True)
class Script:
    text: bytes
    sha: bytes

    @classmethod
    def named(cls, name: str) -> Script:
        # Through the module's `load_script` at call time: tests/instrumented_gateway.py swaps it.
        text = load_script(name).encode()
        return cls(text=text, sha=hashlib.sha1(text).hexdigest().encode())

    def evalsha(
        self, nodes: Nodes, slot: int, keys: Sequence[Any], args: Sequence[Any], *, weight: int = 1, waiter: Waiter | None = None
    ) -> Awaitable[Any]:
        return nodes.execute(slot, b"EVALSHA", self.sha, len(keys), *keys, *args, weight=weight, waiter=waiter)

    async def call(
        self,
        nodes: Nodes,
        slot: int,
        keys: Sequence[Any],
        args: Sequence[Any],
        *,
        before_eval: Callable[[], Awaitable[None]] | None = None,
    ) -> Any:
        """EVALSHA, or EVAL when Redis has lost its script cache."""
        try:
            return await self.evalsha(nodes, slot, keys, args)
        except RedisReplyError as exc:
            return await self.eval_after(exc, nodes, slot, keys, args, before_eval=before_eval)

    async def eval_after(
        self,
        error: StoreError,
        nodes: Nodes,
        slot: int,
        keys: Sequence[Any],
        args: Sequence[Any],
        *,
        weight: int = 1,
        before_eval: Callable[[], Awaitable[None]] | None = None,
    ) -> Any:
        """EVAL after a NOSCRIPT reply to EVALSHA, once `before_eval` has run; any other error is raised."""
        if not is_noscript(error):
            raise error
        if before_eval is not None:
            await before_eval()
        return await nodes.execute(slot, b"EVAL", self.text, len(keys), *keys, *args, weight=weight)


def is_noscript(error: StoreError) -> bool:
    return isinstance(error, RedisReplyError) and error.reply.startswith("NOSCRIPT")


@dataclass(frozen=True)
class Scripts:
    """The four scripts of the store, loaded when it is built."""

    check: Script
    refund: Script
    concurrency: Script
    token_lease: Script

    @classmethod
    def load(cls) -> Scripts:
        return cls(
            check=Script.named(SCRIPT_NAME),
            refund=Script.named(REFUND_SCRIPT_NAME),
            concurrency=Script.named(CONCURRENCY_SCRIPT_NAME),
            token_lease=Script.named(TOKEN_LEASE_SCRIPT_NAME),
        )

    def __iter__(self) -> Iterator[Script]:
        return iter((self.check, self.refund, self.concurrency, self.token_lease))
