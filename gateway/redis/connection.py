"""One pipelined connection to one Redis node: commands in, futures out.

Every check of a gateway process goes through one connection per Redis node.
Commands issued in one event-loop iteration are packed by hiredis and sent in
one write; Redis answers strictly in order, so replies are matched to a FIFO
of futures. There is no task and no stream reader per command: the cost of a
command is one `pack_command`, one future, and its share of a write. A caller
that gathers many checks into one command (`gateway.redis.check_batches`)
reserves a place per check as it takes it, and is called back at the start of
the write (`before_write`) to queue that command into it; `max_pending` counts
checks, so a command carrying many weighs as many.

Timeouts measure Redis, never this process's own event loop. A command's
deadline starts when its batch is written, not when it was queued. When the
deadline passes with a reply missing, the command is failed only after one
more poll of the socket (`RECHECK_DELAY` later): a reply that reached the
socket in time but waited for a busy loop is an answer, not a timeout. A timed
out command stays in the FIFO, so its late reply is read and dropped in order
and the connection stays usable.

Trusts Redis to answer in order (RESP guarantees it) and correctly, not
promptly. Every failure becomes `StoreError` at this boundary: a Redis error
reply becomes `RedisReplyError`, and a reset, EOF or protocol error fails
every command waiting on the connection, which then reconnects with backoff.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import hiredis

from gateway.config.store_url import REDIS_PORT, SingleTarget, parse_store_url
from gateway.limiter.store import StoreError, StoreNotConnected

log = logging.getLogger(__name__)

# One loop iteration's worth of checks under heavy load, in a write of ~100 KB:
# larger batches only delay the first command's reply.
DEFAULT_MAX_BATCH = 512
# Checks queued or awaiting a reply. At 10k checks/s and a 10 ms timeout, ~100 are
# in flight; the cap only matters when Redis stops answering, and then it turns
# every further check into an immediate store error instead of a growing backlog.
DEFAULT_MAX_PENDING = 4096
# A deadline's re-check comes this much later, so one poll of the socket runs between
# the deadline and the verdict. Zero is not enough: libuv runs a timer that is due
# now in the same timer phase, before polling.
RECHECK_DELAY = 0.001
# Reconnect attempts back off from the first to the last, doubling.
RECONNECT_BACKOFF_FIRST = 0.02
RECONNECT_BACKOFF_MAX = 0.5
# A reply this overdue means the peer is gone without a reset (a vanished host):
# drop the connection and reconnect rather than wait forever in order.
STALE_REPLY_SECONDS = 3.0


class RedisReplyError(StoreError):
    """Redis answered with an error reply (NOSCRIPT, WRONGPASS, OOM, ...)."""

    def __init__(self, address: RedisAddress, reply: str) -> None:
        super().__init__(f"redis {address}: {reply}")
        self.reply = reply


@dataclass(frozen=True, kw_only=True)
class RedisAddress:
    """Where a Redis node is and how to log in, as a connection dials it."""

    host: str = ""
    port: int = REDIS_PORT
    unix_path: str = ""
    tls: ssl.SSLContext | None = None
    username: str | None = None
    password: str | None = field(default=None, repr=False)  # never in a log line
    db: int = 0

    def __str__(self) -> str:
        return self.unix_path if self.unix_path else f"{self.host}:{self.port}"


def address_of(target: SingleTarget, *, tls_ca_file: str | None = None) -> RedisAddress:
    """The address of a one-node store target; `rediss://` verifies the server against
    `tls_ca_file`, or the system's CAs."""
    tls = ssl.create_default_context(cafile=tls_ca_file) if target.tls else None
    return RedisAddress(
        host=target.host,
        port=target.port,
        unix_path=target.unix_path,
        tls=tls,
        username=target.username,
        password=target.password,
        db=target.db,
    )


def address_of_url(url: str, *, tls_ca_file: str | None = None) -> RedisAddress:
    """The address a `redis://`, `rediss://` or `unix://` URL names, for code holding a URL
    and no config (tests, benchmarks); raises ValueError as the config loader would."""
    target = parse_store_url(url)
    if not isinstance(target, SingleTarget):
        raise ValueError(f"expected the URL of one Redis node, got {target}")
    return address_of(target, tls_ca_file=tls_ca_file)


class Waiter(Protocol):
    """What a command's reply is given to: a future, or an object that answers in the
    read that brings the reply (`gateway.redis.check_batches`), as a future's own
    callbacks would only in the next loop iteration."""

    def done(self) -> bool: ...
    def set_result(self, result: Any, /) -> None: ...
    def set_exception(self, exception: BaseException, /) -> None: ...


class _Command:
    """One command in the FIFO. `deadline` is set when its batch is written."""

    __slots__ = ("deadline", "future", "timeout", "weight", "written_at")

    def __init__(self, future: Waiter, timeout: float, weight: int) -> None:
        self.future = future
        self.timeout = timeout
        self.deadline = 0.0
        self.written_at = 0.0
        self.weight = weight  # the checks it carries, for max_pending


class RedisConnection:
    """A pipelined, self-healing connection to one Redis node.

    `execute` never blocks: it queues the command and returns a future, or
    raises `StoreError` at once when the connection is down or the queue is
    full, so the caller's failure policy decides without waiting."""

    def __init__(
        self,
        address: RedisAddress,
        *,
        timeout: float,
        connect_timeout: float,
        max_pending: int = DEFAULT_MAX_PENDING,
        max_batch: int = DEFAULT_MAX_BATCH,
        resolve: Callable[[], Awaitable[RedisAddress]] | None = None,
    ) -> None:
        """`resolve`, when given, names the node afresh before each connect (Sentinel)."""
        self.address = address
        self._resolve = resolve
        self.timeout = timeout
        self._connect_timeout = connect_timeout
        self._max_pending = max_pending
        self._max_batch = max_batch
        self._transport: asyncio.Transport | None = None
        self._reader: Any = None
        self._unsent: list[bytes] = []
        self._unsent_commands: list[_Command] = []
        self._waiting: collections.deque[_Command] = collections.deque()
        self._weight = 0  # the checks of the commands queued or awaiting a reply
        self._reserved = 0  # checks taken by callers that queue their command in the next write
        self._before_write: list[Callable[[], None]] = []
        # Deadlines of commands awaiting replies, earliest first; answered ones are
        # dropped lazily when they reach the top.
        self._deadlines: list[tuple[float, int, _Command]] = []
        self._sequence = itertools.count()
        self._flush_handle: asyncio.Handle | None = None
        self._deadline_handle: asyncio.TimerHandle | None = None
        self._armed_for: float | None = None  # the deadline the timer waits for; None while re-checking
        self._reconnecting: asyncio.Task[None] | None = None
        self._last_error = "not connected yet"
        self._opening: asyncio.Future[None] | None = None  # the attempt to connect under way
        self._closed = False
        self.ever_connected = False  # False until the first connect succeeds

    @property
    def connected(self) -> bool:
        return self._transport is not None

    @property
    def pending(self) -> int:
        """Checks queued, reserved or awaiting a reply, timed-out ones included."""
        return self._weight + self._reserved

    async def connect(self) -> None:
        """Connect now. On failure raise StoreError, and keep reconnecting in the background."""
        if self._transport is not None:
            return
        if self._opening is not None:  # an attempt is under way: its outcome is ours
            await asyncio.shield(self._opening)
            if self._transport is None:
                raise StoreError(f"redis {self.address}: {self._last_error}")
            return
        try:
            await self._open()
        except StoreError:
            self._reconnect_soon()
            raise

    def connect_soon(self) -> None:
        """Connect in the background, as after a lost connection."""
        if self._transport is None:
            self._reconnect_soon()

    def execute(self, *args: Any, timeout: float | None = None, weight: int = 1, waiter: Waiter | None = None) -> Any:
        """Queue one command, carrying `weight` checks; the future returned (or `waiter`)
        is given its reply or a StoreError."""
        self._refuse_unless_room()
        loop = asyncio.get_running_loop()
        command = _Command(waiter or loop.create_future(), self.timeout if timeout is None else timeout, weight)
        self._unsent.append(hiredis.pack_command(args))
        self._unsent_commands.append(command)
        self._weight += weight
        if self._flush_handle is None:
            self._flush_handle = loop.call_soon(self._flush)
        return command.future

    def reserve(self) -> None:
        """Take a place for one check that a `before_write` callback will send, or raise
        StoreError at once, as `execute` would. The callback gives it back (`release`)
        right before it executes the command that carries it."""
        self._refuse_unless_room()
        self._reserved += 1

    def release(self, checks: int) -> None:
        self._reserved -= checks

    def before_write(self, callback: Callable[[], None]) -> None:
        """Call `callback` at the start of the next write: the commands it executes go out in it."""
        self._before_write.append(callback)
        if self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_soon(self._flush)

    def _refuse_unless_room(self) -> None:
        if self._transport is None:
            self._reconnect_soon()
            raise StoreNotConnected(f"redis {self.address}: {self._last_error}")
        pending = self._weight + self._reserved
        if pending >= self._max_pending:
            error = StoreError(f"redis {self.address}: {pending} commands already waiting for Redis")
            self._drop_if_stale()
            raise error

    async def close(self) -> None:
        self._closed = True
        if self._reconnecting is not None:
            self._reconnecting.cancel()
        transport, self._transport = self._transport, None
        if transport is not None:
            transport.close()
        self._fail_all(StoreError(f"redis {self.address}: connection closed"))

    # -- writing ---------------------------------------------------------------

    def _flush(self) -> None:
        callbacks = self._before_write
        if callbacks:
            self._before_write = []
            for callback in callbacks:  # with the handle still set, what they execute goes out here
                callback()
        self._flush_handle = None
        transport = self._transport
        if transport is None or not self._unsent:
            return
        batch, commands = self._unsent[: self._max_batch], self._unsent_commands[: self._max_batch]
        del self._unsent[: self._max_batch], self._unsent_commands[: self._max_batch]
        loop = asyncio.get_running_loop()
        if self._unsent:  # the rest goes in the next iteration
            self._flush_handle = loop.call_soon(self._flush)
        transport.write(b"".join(batch))
        # The real time, not loop.time(): uvloop's is cached at the start of the
        # iteration, and a long iteration would count against Redis.
        now = time.monotonic()
        for command in commands:
            command.written_at = now
            command.deadline = now + command.timeout
            heapq.heappush(self._deadlines, (command.deadline, next(self._sequence), command))
        self._waiting.extend(commands)
        if self._deadline_handle is None:
            self._arm_deadline()
        elif self._armed_for is not None and self._deadlines[0][0] < self._armed_for:
            # A short check behind a long command (the handshake's PING, SCRIPT LOAD)
            # keeps its own deadline.
            self._deadline_handle.cancel()
            self._arm_deadline()

    # -- reading ---------------------------------------------------------------

    def _data_received(self, data: bytes) -> None:
        reader = self._reader
        reader.feed(data)
        waiting = self._waiting
        try:
            while True:
                reply = reader.gets()
                if reply is False:
                    return
                if not waiting:
                    raise hiredis.ProtocolError("a reply arrived for no command")
                command = waiting.popleft()
                self._weight -= command.weight
                if command.future.done():
                    continue  # timed out or cancelled: read and dropped, in order
                if isinstance(reply, hiredis.ReplyError):
                    command.future.set_exception(RedisReplyError(self.address, str(reply)))
                    if str(reply).startswith("READONLY") and self._resolve is not None:
                        # A failover demoted this node: find the master again.
                        self._lose("the node is a replica now")
                        return
                else:
                    command.future.set_result(reply)
        except hiredis.ProtocolError as exc:
            self._lose(f"protocol error: {exc}")

    # -- deadlines -------------------------------------------------------------

    def _arm_deadline(self) -> None:
        """Time the earliest deadline among commands still unanswered."""
        deadlines = self._deadlines
        while deadlines and deadlines[0][2].future.done():
            heapq.heappop(deadlines)
        if deadlines:
            self._armed_for = deadlines[0][0]
            delay = max(0.0, self._armed_for - time.monotonic())
            self._deadline_handle = asyncio.get_running_loop().call_later(delay, self._deadline_passed)
        else:
            self._deadline_handle = self._armed_for = None

    def _deadline_passed(self) -> None:
        now = time.monotonic()
        deadlines = self._deadlines
        if deadlines and deadlines[0][0] > now:  # the loop's timer ran early
            self._arm_deadline()
            return
        self._armed_for = None
        self._deadline_handle = asyncio.get_running_loop().call_later(RECHECK_DELAY, self._expire, now)

    def _expire(self, cutoff: float) -> None:
        """Fail what is still unanswered after the poll that followed its deadline."""
        deadlines = self._deadlines
        error = None
        while deadlines and deadlines[0][0] <= cutoff:
            _, _, command = heapq.heappop(deadlines)
            if not command.future.done():
                error = error or StoreError(f"redis {self.address}: no answer within {command.timeout * 1000:g} ms")
                command.future.set_exception(error)
        self._drop_if_stale()
        self._arm_deadline()

    def _drop_if_stale(self) -> None:
        if self._waiting and self._transport is not None:
            oldest = self._waiting[0]
            if time.monotonic() - oldest.written_at > STALE_REPLY_SECONDS:
                self._lose(f"no reply for {STALE_REPLY_SECONDS:g} s")

    # -- connection lifecycle --------------------------------------------------

    async def _open(self) -> None:
        self._opening = asyncio.get_running_loop().create_future()
        try:
            await self._open_once()
        finally:
            self._opening.set_result(None)
            self._opening = None

    async def _open_once(self) -> None:
        loop = asyncio.get_running_loop()
        address = self.address
        self._reader = hiredis.Reader()
        try:
            async with asyncio.timeout(self._connect_timeout):
                if self._resolve is not None:
                    address = self.address = await self._resolve()
                if address.unix_path:
                    transport, _ = await loop.create_unix_connection(lambda: _Protocol(self), address.unix_path)
                else:
                    transport, _ = await loop.create_connection(
                        lambda: _Protocol(self),
                        address.host,
                        address.port,
                        ssl=address.tls,
                        server_hostname=address.host if address.tls else None,
                    )
                self._transport = transport  # type: ignore[assignment]
                await self._handshake()
        except TimeoutError:
            self._abort()
            self._last_error = f"cannot connect within {self._connect_timeout:g} s"
            raise StoreError(f"redis {address}: {self._last_error}") from None
        except StoreError as exc:
            self._abort()
            self._last_error = str(exc).removeprefix(f"redis {address}: ")
            raise
        except (OSError, ssl.SSLError) as exc:
            self._abort()
            self._last_error = f"cannot connect: {exc.strerror or exc}" if isinstance(exc, OSError) else str(exc)
            raise StoreError(f"redis {address}: {self._last_error}") from None
        self.ever_connected = True
        log.info("connected to redis %s", address)

    async def _handshake(self) -> None:
        """Log in and pick the database; PING proves a responsive Redis is there."""
        address = self.address
        replies = []
        if address.password is not None:
            credentials = (address.username, address.password) if address.username else (address.password,)
            replies.append(self.execute("AUTH", *credentials, timeout=self._connect_timeout))
        if address.db:
            replies.append(self.execute("SELECT", address.db, timeout=self._connect_timeout))
        replies.append(self.execute("PING", timeout=self._connect_timeout))
        if self._resolve is not None:  # a sentinel's answer may be stale: the node must be the master
            replies.append(self.execute("ROLE", timeout=self._connect_timeout))
        # Every reply is awaited, so a failed AUTH leaves no unread NOAUTH behind it.
        answers = await asyncio.gather(*replies, return_exceptions=True)
        for reply in answers:
            if isinstance(reply, BaseException):
                raise reply
        if self._resolve is not None:
            role = answers[-1]
            assert not isinstance(role, BaseException)  # raised above
            if role[0] != b"master":
                raise StoreError(f"redis {address}: named as the master, but its role is {role[0].decode()}")

    def _abort(self) -> None:
        transport, self._transport = self._transport, None
        if transport is not None:
            transport.abort()
        self._fail_all(StoreError(f"redis {self.address}: connection lost"))

    def _lose(self, reason: str) -> None:
        """The connection is unusable: fail every command on it and reconnect."""
        if self._transport is None:
            return
        self._last_error = reason
        log.warning("redis %s: %s; reconnecting", self.address, reason)
        self._abort()
        self._reconnect_soon()

    def _connection_lost(self, transport: asyncio.BaseTransport, exc: Exception | None) -> None:
        if transport is not self._transport:
            return  # one we dropped ourselves
        reason = f"connection lost: {exc}" if exc else "connection closed by Redis"
        self._lose(reason)

    def _fail_all(self, error: StoreError) -> None:
        commands = [*self._waiting, *self._unsent_commands]
        self._waiting.clear()
        self._unsent.clear()
        self._unsent_commands.clear()
        self._weight = 0
        self._deadlines.clear()
        if self._deadline_handle is not None:
            self._deadline_handle.cancel()
            self._deadline_handle = self._armed_for = None
        for command in commands:
            if not command.future.done():
                command.future.set_exception(error)

    def _reconnect_soon(self) -> None:
        if self._closed or (self._reconnecting is not None and not self._reconnecting.done()):
            return
        self._reconnecting = asyncio.get_running_loop().create_task(self._reconnect())

    async def _reconnect(self) -> None:
        delay = RECONNECT_BACKOFF_FIRST
        while not self._closed and self._transport is None:
            try:
                if self._opening is None:  # else `connect` is trying right now
                    await self._open()
            except StoreError as exc:
                log.debug("reconnect failed: %s", exc)
            if self._transport is None:
                await asyncio.sleep(delay)
                delay = min(delay * 2, RECONNECT_BACKOFF_MAX)


class _Protocol(asyncio.Protocol):
    """Hands the transport's events to its connection; nothing else."""

    def __init__(self, connection: RedisConnection) -> None:
        self._connection = connection
        self._transport: asyncio.BaseTransport | None = None
        self.data_received = connection._data_received  # type: ignore[method-assign]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        assert self._transport is not None
        self._connection._connection_lost(self._transport, exc)
