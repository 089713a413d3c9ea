"""Finding the Redis master through Sentinel, for a `redis+sentinel://` store.

`redis+sentinel://[user:password@]host:26379,host:26380/mymaster?db=0` names the
sentinels and the monitored master. The password (and user) are the master's;
the sentinels are asked without one. Each time the store connects, and so after
every failover that drops or demotes its node, it asks the sentinels in turn
for the master's address and connects there.

Trusts the sentinels to name the master; a sentinel that does not answer, or
does not know the name, is skipped. Every failure becomes `StoreError`.
"""

from __future__ import annotations

import asyncio

import hiredis

from gateway.config.store_url import SentinelTarget
from gateway.limiter.store import StoreError
from gateway.redis.connection import RedisAddress


async def master_address(service: SentinelTarget, *, timeout: float) -> RedisAddress:
    """Ask each sentinel in turn where the master is; the first that knows wins."""
    reasons = []
    for host, port in service.sentinels:
        try:
            async with asyncio.timeout(timeout):
                reply = await _ask(host, port, ("SENTINEL", "get-master-addr-by-name", service.service))
        except TimeoutError:
            reasons.append(f"{host}:{port} did not answer")
            continue
        except OSError as exc:
            reasons.append(f"{host}:{port}: {exc.strerror or exc}")
            continue
        except hiredis.ProtocolError:
            reasons.append(f"{host}:{port} does not speak the Redis protocol")
            continue
        if isinstance(reply, list) and len(reply) == 2:
            master_host, master_port = reply[0].decode(), int(reply[1])
            return RedisAddress(
                host=master_host, port=master_port, username=service.username, password=service.password, db=service.db
            )
        reasons.append(f"{host}:{port} does not know {service.service!r}")
    raise StoreError(f"no sentinel named the master {service.service!r}: {'; '.join(reasons)}")


async def _ask(host: str, port: int, command: tuple[str, ...]) -> object:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(hiredis.pack_command(command))  # type: ignore[arg-type]  # hiredis's stub takes a 1-tuple
        parser = hiredis.Reader()
        while True:
            reply = parser.gets()
            if reply is not False:
                return reply
            data = await reader.read(65536)
            if not data:
                raise ConnectionResetError("the sentinel closed the connection")
            parser.feed(data)
    finally:
        writer.close()
