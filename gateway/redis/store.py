"""The shared store: token buckets in Redis, checked and charged by one Lua script.

Every gateway process runs `lua/token_bucket.lua` against the same Redis, so
no interleaving of requests lets a client exceed its limit. Concurrency leases
are taken by `lua/concurrency_lease.lua` and given up by a plain ZREM, each one
command on the master of the lease key's slot. A limit with a `lease` takes
several tokens of one bucket at once (`lua/token_lease.lua`). All buckets of a
request are one check of the script: one round trip, all-or-nothing. The
checks of one event-loop iteration for one node (on a Cluster, one slot) go
in one script call (`gateway.redis.check_batches`), over one pipelined
connection per node (`gateway.redis.connection`). A check's script arguments come with it,
formatted when the plans were compiled (`prepare`); one without is formatted for itself,
and nothing is kept by limit. The admin API reads a bucket or an
identity's leases together with Redis's TIME in one EVAL, and resets a bucket
by DEL and leases by an EVAL that counts the live ones as it deletes them, each
on the master of the key's slot.

Trusts Redis to answer correctly, not promptly: each command is bounded by
`store.timeout` from the moment it is written, and never retried, since a
retried EVALSHA could charge a client twice. Only NOSCRIPT, which means
nothing ran, is answered by sending the script itself (`gateway.redis.scripts`).
Identities are hashed with the fleet's secret (`gateway.redis.secret`). Every
failure leaves here as `StoreError`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import Awaitable, Sequence
from typing import Any

from gateway.config.model import ConcurrencyLimit, Limit, StoreConfig
from gateway.config.redaction import redacted_url
from gateway.limiter import bucket, quota
from gateway.limiter.keys import (
    COMPACT_IDENTITY,
    bucket_key,
    identity_digest,
    lease_key,
)
from gateway.limiter.leases import lease_reading
from gateway.limiter.store import (
    BucketReading,
    LeaseCheck,
    LeaseDecision,
    LeaseGrant,
    LeaseReading,
    LimitCheck,
    Prepared,
    PreparedLease,
    StoreDecision,
    StoreError,
)
from gateway.redis.check_batches import Batch, CheckBatches
from gateway.redis.cluster import RedisCluster, key_slot
from gateway.redis.nodes import nodes_for
from gateway.redis.scripts import Scripts, is_noscript
from gateway.redis.secret import FleetSecret

log = logging.getLogger(__name__)

# A bucket and Redis's clock in one atomic read, so the refill is computed as the
# token-bucket script would (it is not on the request path: sent as EVAL each time).
READ_SCRIPT = b"return {redis.call('HMGET', KEYS[1], 'tokens', 'ts'), redis.call('TIME')}"
# An identity's leases with their expiries and Redis's clock, read as one: the leases a dead
# gateway left are judged expired by the clock that scored them. The set holds at most the
# limit's concurrency beside the expired leases the next acquire drops.
LEASE_READ_SCRIPT = b"return {redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES'), redis.call('TIME')}"
# Drop them, answering how many were live: the set outlives its live leases when the one
# that set its expiry was released first. Live: expiring after now (ms), as the lease script counts.
LEASE_DELETE_SCRIPT = (
    b"local t = redis.call('TIME') "
    b"local live = redis.call('ZCOUNT', KEYS[1], '(' .. (t[1] * 1000 + math.floor(t[2] / 1000)), '+inf') "
    b"redis.call('DEL', KEYS[1]) return live"
)
# Bucket keys kept, one per (limit, identity) of at most COMPACT_IDENTITY characters (~30 MB
# at most), more clients than one process sees within a refill period on most
# deployments; past this the cache starts over.
KEYS_CACHE_ENTRIES = 65536
# Connecting, logging in and agreeing on the secret happen off the request path
# and may take longer than one check.
SETUP_TIMEOUT_FLOOR = 1.0


class RedisStore:
    def __init__(self, config: StoreConfig) -> None:
        self._config = config
        self.description = f"redis {redacted_url(config.url)}"
        self._scripts = Scripts.load()
        self._keys_cache: dict[tuple[str, str], str] = {}
        self._keys_secret: bytes | None = None  # the secret the cached keys were hashed with
        self._setup_timeout = max(config.timeout, SETUP_TIMEOUT_FLOOR)
        self._redis = nodes_for(config, connect_timeout=max(config.timeout * 10, SETUP_TIMEOUT_FLOOR))
        self._cluster = self._redis if isinstance(self._redis, RedisCluster) else None
        self.refunds = self._cluster is not None
        self._fleet_secret = FleetSecret(
            self._redis,
            key_secret=config.key_secret,
            prefix=config.prefix,
            timeout=self._setup_timeout,
            description=self.description,
        )
        self._batches = CheckBatches(self._send_checks, self._redis.connection_for, self._recover_checks)

    @property
    def _secret(self) -> bytes | None:
        # The secret hashed with now: tests/load/test_redis_failures.py compares it with Redis's.
        return self._fleet_secret.value

    def prepare(self, limit: Limit, cost: int, *, max_delay: float = 0.0, owed: bool = False) -> Prepared:
        """The check's kind and four values as the token-bucket script reads them (`script_args`)."""
        args = script_args(LimitCheck(limit=limit, identity="", cost=cost, max_delay=max_delay, owed=owed))
        return Prepared(limit=limit, cost=cost, max_delay=max_delay, owed=owed, args=args)

    def prepare_lease(self, limit: ConcurrencyLimit) -> PreparedLease:
        return PreparedLease(limit=limit, args=lease_args(limit))

    async def start(self) -> None:
        await self._redis.connect()
        await self._fleet_secret.ensure()
        for script in self._scripts:
            await self._redis.on_every_master("SCRIPT", "LOAD", script.text, timeout=self._setup_timeout)

    async def ping(self) -> None:
        await self._redis.ping()

    async def close(self) -> None:
        self._fleet_secret.close()
        await self._redis.close()  # fails an exchange in flight with StoreError

    async def check(self, checks: Sequence[LimitCheck]) -> StoreDecision:
        async def check_with(secret: bytes) -> StoreDecision:
            keys = self._keys(checks, secret)
            if self._cluster is not None:
                return await self._check_slots(checks, keys)
            # One Redis: the common case, with no slot to route by.
            return _decision(await self._batches.add(0, keys, _args(checks)))

        return await self._fleet_secret.run(check_with)

    async def acquire(self, lease: LeaseCheck) -> LeaseDecision:
        key = await self._lease_key(lease)
        prepared = lease.prepared
        limit_args = prepared.args if prepared is not None and prepared.limit is lease.limit else lease_args(lease.limit)
        args = (lease.lease.encode(), *limit_args)
        reply = await self._scripts.concurrency.call(
            self._redis, key_slot(key), (key,), args, before_eval=self._fleet_secret.after_noscript
        )
        try:
            admitted, in_flight = reply
            return LeaseDecision(admitted=bool(admitted), in_flight=int(in_flight))
        except (TypeError, ValueError) as exc:
            raise StoreError(f"unexpected lease script reply {reply!r}") from exc

    async def release(self, lease: LeaseCheck) -> None:
        key = await self._lease_key(lease)
        await self._redis.execute(key_slot(key), b"ZREM", key, lease.lease.encode())

    async def read_leases(self, limit: ConcurrencyLimit, identity: str) -> LeaseReading:
        key = await self._lease_key(LeaseCheck(limit=limit, identity=identity, lease=""))
        reply = await self._redis.execute(key_slot(key), b"EVAL", LEASE_READ_SCRIPT, 1, key, timeout=self._setup_timeout)
        try:
            scored, (seconds, micros) = reply
            now_ms = int(seconds) * 1000 + int(micros) // 1000  # as lua/concurrency_lease.lua reads it
            held = {scored[i]: float(scored[i + 1]) / 1000 for i in range(0, len(scored), 2)}
        except (TypeError, ValueError) as exc:
            raise StoreError(f"unexpected lease read reply {reply!r}") from exc
        return lease_reading(key, held, now_ms / 1000)

    async def delete_leases(self, limit: ConcurrencyLimit, identity: str) -> bool:
        key = await self._lease_key(LeaseCheck(limit=limit, identity=identity, lease=""))
        live = await self._redis.execute(key_slot(key), b"EVAL", LEASE_DELETE_SCRIPT, 1, key, timeout=self._setup_timeout)
        return bool(live)

    async def _lease_key(self, lease: LeaseCheck) -> str:
        secret = await self._fleet_secret.ensure()
        return lease_key(self._config.prefix, lease.limit.name, identity_digest(secret, lease.identity))

    async def lease(self, check: LimitCheck, want: int) -> LeaseGrant:
        """One bucket, so one slot: on a Cluster too, one script call and no refund."""
        # A leased limit is a bucket that rejects (the config refuses quotas and delays): no debt.
        _, capacity, rate, cost, _ = _script_args(check)
        args = (capacity, rate, cost, str(want).encode())

        async def lease_with(secret: bytes) -> Any:  # the script's reply, as Redis sent it
            (key,) = self._keys((check,), secret)
            return await self._scripts.token_lease.call(
                self._redis, key_slot(key), (key,), args, before_eval=self._fleet_secret.after_noscript
            )

        reply = await self._fleet_secret.run(lease_with)
        try:
            allowed, granted, remaining, retry_ms = reply
            retry_ms = int(retry_ms)
            return LeaseGrant(
                allowed=bool(allowed),
                granted=int(granted),
                remaining=float(remaining),
                retry_after=float("inf") if retry_ms < 0 else retry_ms / 1000,
            )
        except (TypeError, ValueError) as exc:
            raise StoreError(f"unexpected lease script reply {reply!r}") from exc

    async def refund(self, check: LimitCheck, tokens: int) -> None:
        """One bucket, so one slot: `lua/token_refund.lua`, as for a check denied in a later slot."""
        secret = await self._fleet_secret.ensure()
        _, capacity, *_ = _script_args(check)
        (key,) = self._keys((check,), secret)
        await self._scripts.refund.call(self._redis, key_slot(key), (key,), (capacity, str(tokens).encode()))

    async def settle(self, check: LimitCheck, delta: int) -> None:
        """One bucket, so one slot and one script call: more than reserved is an owed check of
        the difference (`lua/token_bucket.lua`, whose TTL then covers the refill from the debt),
        less is a refund of it (`lua/token_refund.lua`), capped at the capacity."""
        if delta > 0:
            await self.check((dataclasses.replace(check, cost=delta, owed=True, max_delay=0.0, prepared=None),))
        elif delta < 0:
            await self.refund(check, -delta)

    async def read(self, limit: Limit, identity: str) -> BucketReading:
        key = await self._admin_key(limit, identity)
        reply = await self._redis.execute(key_slot(key), b"EVAL", READ_SCRIPT, 1, key, timeout=self._setup_timeout)
        try:
            (tokens, stamp), (seconds, micros) = reply
            now_ms = int(seconds) * 1000 + int(micros) / 1000
            state = None if tokens is None or stamp is None else bucket.BucketState(float(tokens), float(stamp) / 1000)
        except (TypeError, ValueError) as exc:
            raise StoreError(f"unexpected bucket read reply {reply!r}") from exc
        return bucket.reading(key, limit, state, now_ms / 1000)

    async def delete(self, limit: Limit, identity: str) -> bool:
        key = await self._admin_key(limit, identity)
        return bool(await self._redis.execute(key_slot(key), b"DEL", key, timeout=self._setup_timeout))

    async def _admin_key(self, limit: Limit, identity: str) -> str:
        secret = await self._fleet_secret.ensure()
        return self._keys([LimitCheck(limit=limit, identity=identity, cost=0)], secret)[0]

    async def _check_slots(self, checks: Sequence[LimitCheck], keys: list[str]) -> StoreDecision:
        """A check across Redis Cluster slots: one script call per slot, in slot order.

        Each call is all-or-nothing within its slot. When a later slot denies, what
        the earlier slots charged is given back (`lua/token_refund.lua`) before the
        denial is answered. Until the refund lands, those buckets hold less than they
        should, which can only deny, never admit. Owed charges are never given back, and
        those of the slots after a denial are still sent (alone), since they are charged
        whatever the answer. When a later slot fails, earlier charges stay: the request
        may yet be allowed by the failure policy."""
        slots: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            slots.setdefault(key_slot(key), []).append(i)
        if len(slots) == 1:
            return _decision(await self._batches.add(next(iter(slots)), keys, _args(checks)))
        remaining: list[float | None] = [None] * len(checks)
        resets: list[float | None] = [None] * len(checks)
        charged: list[int] = []
        wait = 0.0
        denial: StoreDecision | None = None
        for slot in sorted(slots):
            indices = slots[slot]
            if denial is not None:  # refused: what the later slots owe is charged all the same
                indices = [i for i in indices if checks[i].owed]
                if not indices:
                    continue
            part = [checks[i] for i in indices]
            decision = _decision(await self._batches.add(slot, [keys[i] for i in indices], _args(part)))
            for i, left, reset in zip(indices, decision.remaining, decision.resets):
                remaining[i], resets[i] = left, reset
            if denial is not None:
                if not decision.allowed and decision.retry_after > denial.retry_after:
                    denial = decision
                continue
            if not decision.allowed:
                denial = decision
                given_back = [i for i in charged if checks[i].cost and not checks[i].owed]
                for i in given_back:
                    found = remaining[i]
                    assert found is not None  # its slot answered
                    remaining[i] = found + checks[i].cost  # as found, before this request
                await self._refund(given_back, checks, keys)
                continue
            charged += indices
            wait = max(wait, decision.wait)
        if denial is not None:
            return StoreDecision(allowed=False, remaining=tuple(remaining), retry_after=denial.retry_after, resets=tuple(resets))
        return StoreDecision(allowed=True, remaining=tuple(remaining), retry_after=0.0, wait=wait, resets=tuple(resets))

    async def _refund(self, indices: list[int], checks: Sequence[LimitCheck], keys: list[str]) -> None:
        """Give back what `indices` were charged, one call per slot. Awaited, so this
        gateway's next check of the same client finds the tokens back."""
        slots: dict[int, list[int]] = {}
        for i in indices:
            slots.setdefault(key_slot(keys[i]), []).append(i)
        refunds = [
            self._scripts.refund.call(
                self._redis,
                slot,
                [keys[i] for i in part],
                [arg for i in part for arg in _script_args(checks[i])[1::2]],  # capacity (or limit), cost
            )
            for slot, part in slots.items()
        ]
        for outcome in await asyncio.gather(*refunds, return_exceptions=True):
            if isinstance(outcome, StoreError):
                # The tokens stay charged: this client is under-admitted until they refill.
                log.warning("could not refund a check denied in another slot: %s", outcome)
            elif isinstance(outcome, BaseException):
                raise outcome

    def _send_checks(self, slot: int, keys: list[str], args: list[bytes], batch: Batch) -> object:
        """One script call carrying the checks of `batch` (`gateway.redis.check_batches`):
        queued now, so it goes in the connection's write under way. One node answers `batch`
        itself; a Cluster returns an awaitable that follows redirects."""
        return self._scripts.check.evalsha(self._redis, slot, keys, args, weight=len(batch), waiter=batch)

    def _recover_checks(
        self, error: StoreError, slot: int, keys: list[str], args: list[bytes], checks: int
    ) -> Awaitable[object] | None:
        if not is_noscript(error):
            return None
        return self._scripts.check.eval_after(
            error, self._redis, slot, keys, args, weight=checks, before_eval=self._fleet_secret.after_noscript
        )

    def _keys(self, checks: Sequence[LimitCheck], secret: bytes) -> list[str]:
        """The bucket of each check, kept for the last KEYS_CACHE_ENTRIES (limit, identity)
        pairs of this secret: hashing an identity costs more than the rest of a check."""
        cache = self._keys_cache
        if self._keys_secret is not secret:
            cache.clear()
            self._keys_secret = secret
        keys = []
        for c in checks:
            key = cache.get((c.limit.name, c.identity))
            if key is None:
                key = bucket_key(self._config.prefix, c.limit.name, identity_digest(secret, c.identity))
                # A long identity is hashed each time: kept, a client minting long ones would
                # make the cache hold every one of them whole.
                if len(c.identity) <= COMPACT_IDENTITY:
                    if len(cache) >= KEYS_CACHE_ENTRIES:
                        cache.clear()
                    cache[(c.limit.name, c.identity)] = key
            keys.append(key)
        return keys


def _args(checks: Sequence[LimitCheck]) -> Sequence[bytes]:
    """ARGV of one check: the kind of each limit (b: bucket, q: quota; in capitals when owed), then four values per limit."""
    if len(checks) == 1:  # most routes' one limit, without a call more
        check = checks[0]
        prepared = check.prepared
        return prepared.args if prepared is not None and prepared.fits(check) else script_args(check)  # type: ignore[no-any-return]
    formatted = [_script_args(c) for c in checks]
    return [b"".join(argv[0] for argv in formatted), *(arg for argv in formatted for arg in argv[1:])]


def _script_args(check: LimitCheck) -> tuple[bytes, ...]:
    """The check's own, as prepared when the plans were compiled, else derived for it alone."""
    prepared = check.prepared
    if prepared is not None and prepared.fits(check):
        return prepared.args  # type: ignore[no-any-return]
    return script_args(check)


def script_args(check: LimitCheck) -> tuple[bytes, ...]:
    """The kind and four values of one limit: a bucket's capacity, rate per second, cost and
    debt (max_delay × rate), or a quota's limit, period, cost and offset in ms
    (`gateway.limiter.bucket.spec_of`)."""
    spec = bucket.spec_of(check)
    if isinstance(spec, quota.QuotaSpec):
        kind, values = b"q", (spec.limit, spec.period_ms, spec.cost, spec.offset_ms)
    else:
        kind, values = b"b", (spec.capacity, spec.rate, spec.cost, spec.debt)
    if spec.owed:
        kind = kind.upper()
    return (kind, *(repr(float(v)).encode() for v in values))


def lease_args(limit: ConcurrencyLimit) -> tuple[bytes, bytes]:
    """A concurrency limit's ARGV after the lease id: its N and TTL in ms."""
    return str(limit.concurrency).encode(), str(math.ceil(limit.lease_ttl * 1000)).encode()


def _decision(reply: Any) -> StoreDecision:
    """The token-bucket script's reply: {allowed, {remaining, ...}, retry_after_ms, wait_ms, {reset_ms, ...}}."""
    try:
        allowed, remaining, retry_ms, wait_ms, resets = reply
        # hiredis gives the script's numbers as ints: compared and divided as they come.
        return StoreDecision(
            allowed=bool(allowed),
            remaining=tuple(map(float, remaining)),
            retry_after=float("inf") if retry_ms < 0 else retry_ms / 1000,
            wait=wait_ms / 1000,
            resets=tuple(None if r < 0 else r / 1000 for r in resets),
        )
    except (TypeError, ValueError) as exc:
        raise StoreError(f"unexpected script reply {reply!r}") from exc
