"""The shared store: token buckets in Redis, checked and charged by one Lua script.

Every gateway process runs `lua/token_bucket.lua` against the same Redis, so
no interleaving of requests lets a client exceed its limit. All buckets of a
request go into one script call: one round trip, all-or-nothing.

Trusts Redis to answer correctly, not promptly: each check is bounded by
`store.timeout`, including the wait for a pooled connection, and never
retried, since a retried EVALSHA could charge a client twice. Every redis-py
exception becomes `StoreError` here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from importlib import resources
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError

from gateway.config.model import StoreConfig
from gateway.limiter.keys import bucket_key, identity_digest
from gateway.limiter.store import LimitCheck, StoreDecision, StoreError

log = logging.getLogger(__name__)

SCRIPT_NAME = "token_bucket.lua"
# Gateways sharing a Redis share this identity-hashing secret unless key_secret is set.
SECRET_KEY_SUFFIX = "identity-secret"
# How often a gateway re-reads that secret, so a fleet agrees again within this
# long after a Redis that keeps no data restarts (set store.key_secret to avoid it).
SECRET_REREAD_SECONDS = 10.0


def load_script(name: str = SCRIPT_NAME) -> str:
    """A Lua script shipped inside the package (the top-level `lua/` folder)."""
    return resources.files("gateway.lua").joinpath(name).read_text(encoding="utf-8")


def redacted(url: str) -> str:
    """The URL without its password, for logs and /readyz."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


class RedisStore:
    def __init__(self, config: StoreConfig) -> None:
        self._config = config
        self.description = f"redis {redacted(config.url)}"
        self._script = load_script()
        self._sha: str | None = None
        self._secret: bytes | None = config.key_secret.encode() if config.key_secret else None
        self._secret_read_at = 0.0
        self._args_cache: dict[tuple[str, int], tuple[str, str, str]] = {}
        self._secret_task: asyncio.Future[None] | None = None
        tls = {"ssl_ca_certs": config.tls_ca_file} if config.tls_ca_file else {}
        pool = redis.BlockingConnectionPool.from_url(
            config.url,
            **tls,
            max_connections=config.max_connections,
            # The whole check, pool wait included, is bounded by asyncio.timeout(store.timeout).
            timeout=None,
            # No socket_timeout: redis-py then sends through asyncio.wait_for, which on
            # Python 3.11 swallows a cancellation that lands as the send completes, so
            # a check outlived store.timeout and waited out the socket timeout instead.
            socket_timeout=None,
            socket_connect_timeout=max(config.timeout * 10, 1.0),
            # redis-py retries 3 times with backoff by default: a SIGSTOPped Redis
            # then held each request for ~5 s. One attempt, bounded by our timeout.
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            retry_on_error=[],
            health_check_interval=0,
        )
        self._client = redis.Redis.from_pool(pool)  # closing the client closes the pool

    async def start(self) -> None:
        await self._with_timeout(self._prepare(), timeout=max(self._config.timeout, 1.0))

    async def ping(self) -> None:
        await self._with_timeout(self._client.ping(), timeout=max(self._config.timeout, 0.25))

    async def close(self) -> None:
        if self._secret_task is not None:
            self._secret_task.cancel()
        await self._client.aclose()

    async def check(self, checks: Sequence[LimitCheck]) -> StoreDecision:
        return await self._with_timeout(self._check(checks), timeout=self._config.timeout)

    async def _prepare(self) -> None:
        if not self._config.key_secret:
            await self._share_secret()
        self._sha = await self._client.script_load(self._script)

    async def _share_secret(self) -> None:
        """Agree with the fleet on the identity secret kept in Redis.

        The first gateway to start picks it and the rest read it. A Redis that
        restarted empty has lost it: the secret this gateway already hashes with is
        offered again, so gateways started before and after the restart agree."""
        name = f"{self._config.prefix}{SECRET_KEY_SUFFIX}"
        offer = self._secret.decode() if self._secret is not None else os.urandom(32).hex()
        await self._client.set(name, offer, nx=True)
        value = await self._client.get(name)
        if value is None:
            raise StoreError(f"the identity secret {name!r} vanished from Redis")
        self._secret = value
        self._secret_read_at = time.monotonic()

    async def _check(self, checks: Sequence[LimitCheck]) -> StoreDecision:
        if self._secret is None or self._sha is None:
            await self._prepare()
        assert self._secret is not None and self._sha is not None
        args: list[str] = []
        for c in checks:
            args += self._script_args(c)
        try:
            reply = await self._client.evalsha(self._sha, len(checks), *self._keys(checks), *args)
        except NoScriptError:
            # The script cache is empty after a restart, a failover or SCRIPT FLUSH, and
            # a restart also lost the identity secret: offer ours again before another
            # gateway picks a new one. NOSCRIPT means nothing ran, so sending the
            # script itself is safe.
            if not self._config.key_secret:
                await self._share_secret()
            reply = await self._client.eval(self._script, len(checks), *self._keys(checks), *args)
        self._maybe_reread_secret()
        allowed, remaining, retry_ms = reply
        retry_ms = int(retry_ms)
        return StoreDecision(
            allowed=bool(int(allowed)),
            remaining=tuple(float(r) for r in remaining),
            retry_after=float("inf") if retry_ms < 0 else retry_ms / 1000,
        )

    def _maybe_reread_secret(self) -> None:
        """Every SECRET_REREAD_SECONDS, in the background, adopt the secret Redis holds now.

        A Redis that restarted empty may have been given a new secret by a gateway
        that started since; without this, older gateways would keep hashing with
        the old one and every client would get one bucket per secret."""
        if self._config.key_secret or self._secret_task is not None:
            return
        now = time.monotonic()
        if now - self._secret_read_at < SECRET_REREAD_SECONDS:
            return
        self._secret_read_at = now
        self._secret_task = asyncio.ensure_future(self._reread_secret())

    async def _reread_secret(self) -> None:
        try:
            await self._with_timeout(self._share_secret(), timeout=max(self._config.timeout, 1.0))
        except StoreError as exc:
            log.debug("could not re-read the identity secret: %s", exc)
        finally:
            self._secret_task = None

    def _script_args(self, check: LimitCheck) -> tuple[str, str, str]:
        """ARGV for one bucket (capacity, rate per second, cost), formatted once per limit and cost."""
        key = (check.limit.name, check.cost)
        args = self._args_cache.get(key)
        if args is None:
            limit = check.limit
            args = self._args_cache[key] = (repr(float(limit.burst)), repr(limit.rate.per_second), str(check.cost))
        return args

    def _keys(self, checks: Sequence[LimitCheck]) -> list[str]:
        assert self._secret is not None
        return [bucket_key(self._config.prefix, c.limit.name, identity_digest(self._secret, c.identity)) for c in checks]

    async def _with_timeout(self, work, *, timeout: float):
        try:
            async with asyncio.timeout(timeout):
                return await work
        except TimeoutError:
            raise StoreError(f"{self.description}: no answer within {timeout * 1000:g} ms") from None
        except RedisError as exc:
            raise StoreError(f"{self.description}: {exc}") from None
        except OSError as exc:
            raise StoreError(f"{self.description}: {exc.strerror or exc}") from None
