"""The checks of one event-loop iteration, per Redis node and slot, as one script call.

`lua/token_bucket.lua` takes any number of checks in one call and runs them one
after another in one atomic step, each all-or-nothing across its own limits, as
that many calls in that order would. So the checks taken in one iteration for
one slot (on one Redis, for the node) go out as one EVALSHA at the start of the
connection's next write, instead of one command each: Redis runs one script
call, and this process packs one command and times one deadline per batch.

A batch shares one fate on the wire: its deadline starts when its command is
written, and a timeout, a lost connection or an error reply for the call fails
every check in it, each then decided by its limit's failure policy. A check
whose waiter was cancelled still runs in Redis, as a cancelled command does.

Trusts its sender to answer a batch with five values per check, in order, or to
raise StoreError for the whole call; what a check's five values mean is the
store's to read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from gateway.limiter.store import StoreError
from gateway.redis.connection import RedisConnection

# Redis runs a call's checks back to back, a few µs each, and serves no other client
# meanwhile: 64 keep a call well under half a millisecond, and already bring the
# per-call overhead (dispatch, TIME, the reply's framing) to a few percent of a check.
CHECKS_PER_CALL = 64
# The five values the script answers per check.
REPLY_VALUES = 5

# (slot, keys, args, batch) -> the batch itself, when the connection answers it (one node),
# or an awaitable of the call's reply (a Cluster's redirects); may raise StoreError at once.
Send = Callable[[int, list[Any], list[Any], "Batch"], object]
# (the call's error, slot, keys, args, checks) -> a second try's reply (EVAL after NOSCRIPT),
# or None when the error stands.
Recover = Callable[[StoreError, int, list[Any], list[Any], int], Awaitable[Any] | None]


class Batch:
    """One script call's checks, and the connection's waiter for its reply: answered in the
    read that brings it, so each check's waiter wakes as a command's own future would."""

    __slots__ = ("answered", "args", "connection", "futures", "keys", "on_error", "slot")

    def __init__(self, slot: int, connection: RedisConnection | None, on_error: Callable[[Batch, BaseException], None]) -> None:
        self.slot = slot
        self.keys: list[Any] = []
        self.args: list[Any] = []
        self.futures: list[asyncio.Future[Any]] = []
        self.connection = connection  # where its checks hold places (`reserve`), if anywhere
        self.answered = False
        self.on_error = on_error

    def __len__(self) -> int:
        return len(self.futures)

    def done(self) -> bool:
        return self.answered

    def set_result(self, reply: Any) -> None:
        self.answered = True
        _answer(self.futures, reply)

    def set_exception(self, error: BaseException) -> None:
        self.answered = True
        self.on_error(self, error)


class CheckBatches:
    """`send` runs one script call; `connection_for(slot)` names the connection it will
    queue that call on at once, if one is known (else the batch goes at the next iteration);
    `recover` may try a failed call once more."""

    def __init__(
        self, send: Send, connection_for: Callable[[int], RedisConnection | None], recover: Recover
    ) -> None:
        self._send = send
        self._connection_for = connection_for
        self._recover = recover
        self._open: dict[int, Batch] = {}

    def add(self, slot: int, keys: Sequence[Any], args: Sequence[Any]) -> asyncio.Future[Any]:
        """Queue one check (its keys, and its ARGV as the script reads one check's); the
        future resolves to its five reply values. Raises StoreError at once when its
        connection is down or full."""
        batch = self._open.get(slot)
        if batch is None:
            connection = self._connection_for(slot)
            batch = self._open[slot] = Batch(slot, connection, self._failed)
            if connection is not None:
                connection.before_write(lambda: self._go(batch))
            else:
                asyncio.get_running_loop().call_soon(self._go, batch)
        if batch.connection is not None:
            batch.connection.reserve()
        future = asyncio.get_running_loop().create_future()
        batch.keys += keys
        batch.args += args
        batch.futures.append(future)
        if len(batch.futures) >= CHECKS_PER_CALL:
            del self._open[slot]  # still sent by its callback; the next check opens another
        return future

    def _go(self, batch: Batch) -> None:
        if self._open.get(batch.slot) is batch:
            del self._open[batch.slot]
        futures = batch.futures
        if not futures:  # its only check was refused by `reserve`
            return
        if batch.connection is not None:
            batch.connection.release(len(futures))
        try:
            reply = self._send(batch.slot, batch.keys, batch.args, batch)
        except StoreError as exc:
            _fail(futures, exc)
            return
        if reply is not batch:
            assert isinstance(reply, Awaitable)  # a Cluster's, following redirects
            asyncio.ensure_future(reply).add_done_callback(lambda done: _settle(batch, done))

    def _failed(self, batch: Batch, error: BaseException) -> None:
        """The call failed: NOSCRIPT is tried once more (EVAL), anything else fails every check."""
        retry = self._recover(error, batch.slot, batch.keys, batch.args, len(batch)) if isinstance(error, StoreError) else None
        if retry is None:
            _fail(batch.futures, error)
            return
        batch.on_error = lambda _, again: _fail(batch.futures, again)
        asyncio.ensure_future(retry).add_done_callback(lambda done: _settle(batch, done))


def _settle(batch: Batch, done: asyncio.Future[Any]) -> None:
    """A batch answered through an awaitable (a retry, a Cluster's redirects)."""
    if done.cancelled():
        _fail(batch.futures, StoreError("the store was closed"))
    elif done.exception() is not None:
        batch.set_exception(done.exception())  # type: ignore[arg-type]
    else:
        batch.set_result(done.result())


def _answer(futures: list[asyncio.Future[Any]], reply: Any) -> None:
    if not isinstance(reply, list) or len(reply) != REPLY_VALUES * len(futures):
        _fail(futures, StoreError(f"unexpected script reply {reply!r}"))
        return
    for i, future in enumerate(futures):
        if not future.done():  # else its waiter was cancelled: read and dropped
            start = REPLY_VALUES * i
            future.set_result(reply[start : start + REPLY_VALUES])


def _fail(futures: list[asyncio.Future[Any]], error: BaseException) -> None:
    for future in futures:
        if not future.done():
            future.set_exception(error)
