"""The pipelined Redis connection on its own, against real redis-server processes.

Replies are matched to commands in FIFO order, whether a command was answered,
refused with an error reply, timed out, or abandoned by its caller; every
failure is a StoreError; a lost, garbled or stale connection fails what waits
on it and reconnects by itself. Where Redis must stay silent it is paused
(SIGSTOP) or held by a BLPOP; where it must misbehave, a small TCP server in
the test plays it."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import hiredis
import pytest
import redis

from gateway.limiter.store import StoreError
from gateway.redis import connection as redis_connection
from gateway.redis.connection import (
    DEFAULT_MAX_BATCH,
    RedisConnection,
    RedisReplyError,
)
from gateway.redis.connection import address_of_url as parse_redis_url
from tests.processes import RedisServer, eventually

HANDSHAKE_PING = hiredis.pack_command(("PING",))


@contextlib.asynccontextmanager
async def connected(url: str, **options: Any) -> AsyncIterator[RedisConnection]:
    """A RedisConnection to `url`, connected, and always closed afterwards."""
    options = {"timeout": 5.0, "connect_timeout": 1.0, **options}
    connection = RedisConnection(parse_redis_url(url), **options)
    try:
        await connection.connect()
        yield connection
    finally:
        await connection.close()


def reason(error: BaseException) -> str:
    """A StoreError's message without the `redis host:port: ` prefix."""
    assert isinstance(error, StoreError), repr(error)
    return str(error).rpartition(": ")[2]


def clients_that_ran(server: RedisServer, command: str) -> int:
    """Clients of `server` whose last command was `command` (lowercase); the
    test's own redis-py clients never send the commands counted this way."""
    return len([c for c in server.client().client_list() if c["cmd"] == command])


class HandshakeOnlyServer:
    """A TCP server that passes the handshake (its PING gets +PONG), then answers
    everything else with `reply`, or never when `reply` is empty."""

    def __init__(self, reply: bytes = b"") -> None:
        self.reply = reply
        self.connections = 0
        self._handlers: list[asyncio.Task[None]] = []
        self._writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> HandshakeOnlyServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"redis://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/0"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        for writer in self._writers:
            writer.close()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._handlers.append(asyncio.current_task())  # type: ignore[arg-type]
        self._writers.append(writer)
        try:
            assert await reader.readexactly(len(HANDSHAKE_PING)) == HANDSHAKE_PING
            writer.write(b"+PONG\r\n")
            while await reader.read(65536):
                writer.write(self.reply)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.mark.parametrize("max_batch", [DEFAULT_MAX_BATCH, 10])
async def test_a_thousand_commands_of_one_iteration_share_one_connection_in_order(redis_server, max_batch):
    async with connected(redis_server.url, max_batch=max_batch) as connection:
        replies = [connection.execute("INCR", "k") for _ in range(1000)]
        assert connection.pending == 1000
        assert await asyncio.gather(*replies) == list(range(1, 1001))
        assert clients_that_ran(redis_server, "incr") == 1
        assert connection.pending == 0


async def test_error_replies_fail_only_their_own_command(redis_server):
    async with connected(redis_server.url) as connection:
        client_id = await connection.execute("CLIENT", "ID")
        assert await connection.execute("SET", "word", "not a number") == b"OK"
        replies = [connection.execute("INCR", "n"), connection.execute("INCR", "word"), connection.execute("INCR", "n")]
        first, refused, second = await asyncio.gather(*replies, return_exceptions=True)
        assert (first, second) == (1, 2)
        assert isinstance(refused, RedisReplyError) and isinstance(refused, StoreError)
        assert refused.reply.startswith("ERR"), refused.reply
        assert await connection.execute("GET", "word") == b"not a number"
        with pytest.raises(RedisReplyError) as caught:
            await connection.execute("EVALSHA", "0" * 40, 0)
        assert caught.value.reply.startswith("NOSCRIPT"), caught.value.reply
        assert await connection.execute("INCR", "n") == 3
        assert await connection.execute("CLIENT", "ID") == client_id


async def test_a_timed_out_command_ran_once_and_its_late_reply_is_dropped(redis_server):
    async with connected(redis_server.url, timeout=0.02) as connection:
        assert await connection.execute("INCR", "k", timeout=5) == 1
        client_id = await connection.execute("CLIENT", "ID", timeout=5)
        redis_server.pause()
        try:
            late = [connection.execute("INCR", "k") for _ in range(3)]
            answers = await asyncio.gather(*late, return_exceptions=True)
        finally:
            redis_server.resume()
        assert [reason(a) for a in answers] == ["no answer within 20 ms"] * 3
        assert not any(isinstance(a, RedisReplyError) for a in answers)
        # Redis woke and answered 2, 3 and 4; those replies are read and dropped, so
        # this INCR gets its own: each timed-out INCR ran exactly once.
        assert await connection.execute("INCR", "k", timeout=5) == 5
        assert redis_server.client().get("k") == "5"
        assert await connection.execute("CLIENT", "ID", timeout=5) == client_id
        assert connection.pending == 0


async def test_a_cancelled_command_is_abandoned_and_its_reply_dropped_in_order(redis_server):
    async with connected(redis_server.url) as connection:
        client_id = await connection.execute("CLIENT", "ID")
        sent = asyncio.Event()
        abandoned: list[asyncio.Future[Any]] = []

        async def pop() -> Any:
            abandoned.append(connection.execute("BLPOP", "queue", 0))
            sent.set()
            return await abandoned[0]

        waiter = asyncio.create_task(pop())
        await sent.wait()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert abandoned[0].cancelled()
        mine = connection.execute("ECHO", "mine")
        # The BLPOP holds the pipeline until this push; its reply comes first.
        redis_server.client().lpush("queue", "item")
        assert await mine == b"mine"
        assert redis_server.client().llen("queue") == 0, "the abandoned BLPOP did not run"
        assert await connection.execute("CLIENT", "ID") == client_id
        assert connection.pending == 0


async def test_past_max_pending_execute_itself_refuses_at_once(redis_server):
    async with connected(redis_server.url, max_pending=5) as connection:
        redis_server.pause()
        try:
            waiting = [connection.execute("INCR", "k") for _ in range(5)]
            with pytest.raises(StoreError, match=r"5 commands already waiting for Redis$"):
                connection.execute("INCR", "k")
        finally:
            redis_server.resume()
        assert await asyncio.gather(*waiting) == [1, 2, 3, 4, 5]
        assert await connection.execute("INCR", "k") == 6, "the refused command was sent"


async def test_a_killed_redis_fails_what_waits_and_the_connection_comes_back(redis_server):
    async with connected(redis_server.url) as connection:
        waiting = [connection.execute("BLPOP", "queue", 0), connection.execute("INCR", "k")]
        await eventually(lambda: redis_server.client().info("clients")["blocked_clients"] == 1, what="BLPOP to block")
        redis_server.stop()
        answers = await asyncio.gather(*waiting, return_exceptions=True)
        assert [reason(a) for a in answers] == ["connection lost"] * 2
        assert not connection.connected
        with pytest.raises(StoreError):
            connection.execute("PING")
        redis_server.start()
        await eventually(lambda: connection.connected, what="the connection to come back")
        assert await connection.execute("INCR", "k") == 1
        assert clients_that_ran(redis_server, "incr") == 1


async def test_a_protocol_error_fails_what_waits_and_the_connection_comes_back():
    async with HandshakeOnlyServer(reply=b"?garbage\r\n") as server:
        async with connected(server.url) as connection:
            waiting = [connection.execute("INCR", "k") for _ in range(3)]
            answers = await asyncio.gather(*waiting, return_exceptions=True)
            assert [reason(a) for a in answers] == ["connection lost"] * 3
            await eventually(lambda: server.connections == 2 and connection.connected, what="a reconnect")


@pytest.fixture
def password_redis(redis_server):
    """A Redis that requires the password `secret`. Set after start: RedisServer
    checks that the server answers with a client that sends no password."""
    redis_server.client().config_set("requirepass", "secret")
    return redis_server


async def test_a_wrong_password_fails_connect_with_the_reply(password_redis):
    connection = RedisConnection(
        parse_redis_url(f"redis://:wrong@127.0.0.1:{password_redis.port}/2"), timeout=5, connect_timeout=5
    )
    try:
        with pytest.raises(RedisReplyError) as caught:
            await connection.connect()
        assert caught.value.reply.startswith("WRONGPASS"), caught.value.reply
        assert not connection.connected
        with pytest.raises(StoreError, match="WRONGPASS"):
            connection.execute("PING")
    finally:
        await connection.close()


async def test_password_and_database_from_the_url(password_redis):
    async with connected(f"redis://:secret@127.0.0.1:{password_redis.port}/2") as connection:
        assert await connection.execute("SET", "where", "db2") == b"OK"
    admin = redis.Redis(port=password_redis.port, password="secret", decode_responses=True)
    assert admin.get("where") is None
    assert admin.execute_command("SELECT", 2) and admin.get("where") == "db2"


async def test_unix_socket_url_with_a_database():
    with tempfile.TemporaryDirectory(prefix="gw-redis-sock-") as directory:
        socket_path = str(Path(directory) / "redis.sock")
        with RedisServer("--unixsocket", socket_path, "--unixsocketperm", "700") as server:
            async with connected(f"unix://{socket_path}?db=1") as connection:
                assert await connection.execute("SET", "where", "db1") == b"OK"
                # 'U': a client on the unix socket; the test's own redis-py client uses TCP.
                assert [c["db"] for c in server.client().client_list() if "U" in c["flags"]] == ["1"]
            assert redis.Redis(port=server.port, db=1, decode_responses=True).get("where") == "db1"
            assert server.client().get("where") is None


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://user:p%40ss@h:6380/3", dict(host="h", port=6380, username="user", password="p@ss", db=3)),
        ("redis://h", dict(host="h", port=6379, username=None, password=None, db=0)),
        ("redis://:secret@10.0.0.1/", dict(host="10.0.0.1", port=6379, username=None, password="secret", db=0)),
        ("unix:///run/redis%20x.sock?db=4", dict(unix_path="/run/redis x.sock", host="", db=4, password=None)),
        ("unix://:pw@/run/redis.sock", dict(unix_path="/run/redis.sock", password="pw", db=0)),
    ],
)
def test_parse_redis_url(url, expected):
    address = parse_redis_url(url)
    assert {name: getattr(address, name) for name in expected} == expected
    assert address.tls is None
    assert str(address) == (address.unix_path or f"{address.host}:{address.port}")


def test_rediss_url_gives_a_verifying_tls_context():
    address = parse_redis_url("rediss://h/1")
    assert (address.host, address.port, address.db) == ("h", 6379, 1)
    assert isinstance(address.tls, ssl.SSLContext)
    assert address.tls.verify_mode == ssl.CERT_REQUIRED and address.tls.check_hostname


async def test_a_stale_connection_is_dropped_when_a_deadline_passes(monkeypatch):
    stale = 0.3
    monkeypatch.setattr(redis_connection, "STALE_REPLY_SECONDS", stale)
    async with HandshakeOnlyServer() as server, connected(server.url, timeout=0.02) as connection:
        started = time.monotonic()
        reasons = set()

        async def timed_out_until_dropped() -> bool:
            try:
                await connection.execute("PING")
            except StoreError as exc:
                reasons.add(reason(exc))
            return server.connections == 2

        await eventually(timed_out_until_dropped, what="the stale connection to be dropped")
        assert time.monotonic() - started >= stale
        assert "no answer within 20 ms" in reasons
        await eventually(lambda: connection.connected, what="a reconnect")


async def test_a_stale_connection_is_dropped_when_max_pending_refuses(monkeypatch):
    stale = 0.3
    monkeypatch.setattr(redis_connection, "STALE_REPLY_SECONDS", stale)
    # Long deadlines, so the only thing that can notice the silence is a refusal.
    async with HandshakeOnlyServer() as server, connected(
        server.url, timeout=30, connect_timeout=30, max_pending=2
    ) as connection:
        started = time.monotonic()
        waiting = [connection.execute("PING") for _ in range(2)]

        def refused_until_dropped() -> bool:
            with pytest.raises(StoreError, match="already waiting"):
                connection.execute("PING")
            return not connection.connected

        await eventually(refused_until_dropped, what="the stale connection to be dropped")
        assert time.monotonic() - started >= stale
        answers = await asyncio.gather(*waiting, return_exceptions=True)
        assert [reason(a) for a in answers] == ["connection lost"] * 2
        await eventually(lambda: server.connections == 2 and connection.connected, what="a reconnect")


async def test_a_command_written_right_after_connecting_times_out_at_its_own_deadline(redis_server):
    async with connected(redis_server.url, timeout=0.02, connect_timeout=30) as connection:
        redis_server.pause()
        try:
            command = connection.execute("PING")
            # 50 times the timeout, far short of the handshake PING's connect_timeout before it.
            done, _ = await asyncio.wait({command}, timeout=1.0)
        finally:
            redis_server.resume()
    error = command.exception()  # if not by its deadline, failed by closing the connection
    assert command in done
    assert reason(error) == "no answer within 20 ms"


async def busy_loop_then_collect(url: str, blocked_seconds: float) -> list[Any]:
    """Write 100 commands, then hold the event loop for `blocked_seconds`, as a gateway
    busy with other requests does, while Redis answers them within microseconds."""
    async with connected(url, timeout=0.01) as connection:
        replies = [connection.execute("INCR", "busy") for _ in range(100)]
        await asyncio.sleep(0)  # the batch is written
        asyncio.get_running_loop().call_soon(time.sleep, blocked_seconds)
        return await asyncio.gather(*replies, return_exceptions=True)


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
def test_a_reply_that_waited_for_a_busy_event_loop_is_an_answer_not_a_timeout(redis_server, loop_name):
    """The loop is blocked for five times the 10 ms timeout after the batch is written:
    the replies sit in the socket, and the first poll afterwards reads them before
    any deadline is judged. `asyncio.timeout` around each await, given the same
    block, timed out all 100 on both event loops."""
    import uvloop

    new_loop = uvloop.new_event_loop if loop_name == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=new_loop) as runner:
        answers = runner.run(busy_loop_then_collect(redis_server.url, 0.05))
    assert answers == list(range(1, 101))
