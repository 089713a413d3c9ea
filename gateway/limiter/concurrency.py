"""Concurrency limits on the request path: a lease per limit before the upstream is asked,
renewed while the request lasts, given up when its response has ended.

Trusts the store to take a lease atomically and to raise only `StoreError`. When it
does, the limit's `on_store_error` decides, as for rate limits: `open` admits with no
lease, `closed` rejects (the proxy answers 503), and `local` takes the lease in an
in-process store whose concurrency is the limit's divided by `store.local_divisor` × `workers`
(at least 1). A lease whose take failed may still have been taken (the script ran, the
reply came late), so it is released all the same. Releases and renewals run in the
background: a response never waits for them. A renewal that fails is tried at the next
one; a release that fails is tried again, backing off, until the lease has expired, and
at once when the store answers another lease call, so a client whose leases outlived an
outage gets its room back within a round trip of the store's return, not a backoff later.
A Redis Cluster answers for its other masters while one is down, so a release woken that
way and failing again keeps listening, but tries no more often than every RELEASE_RETRY_FIRST.

A request is admitted only if every concurrency limit of its route admits it; the
leases are taken one limit at a time, and those taken before a refusal are given
back, so a refusal holds nothing. Once the store failed a request (its rate limits'
check, or one of these leases), the rest take their failure policies without asking
it, so a request waits out one store timeout at most, not one per call. The admin API
reads and resets one identity's leases through here. Knows nothing of HTTP.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.config.model import ConcurrencyLimit, FailurePolicy
from gateway.limiter.circuit_breaker import CircuitBreaker
from gateway.limiter.memory_store import MemoryStore, StoreFull
from gateway.limiter.outcomes import (
    ALLOW,
    CONCURRENCY_LIMITED,
    FAIL_CLOSED,
    FAIL_OPEN,
    FAILURE_OUTCOME,
    FAILURE_OUTCOMES,
    NO_ROOM,
    SKIPPED,
)
from gateway.limiter.store import LeaseCheck, LeaseReading, PreparedLease, Store, StoreError, StoreNotConnected

log = logging.getLogger(__name__)

# A held lease is renewed this often, as a fraction of its TTL: a renewal that fails
# (a slow or restarting store) leaves two more tries before the lease would expire.
RENEW_FRACTION = 1 / 3
# A release the store failed is tried again, backing off from the first to the longest wait,
# until the lease would have expired anyway: after a failover or a restart the store is back
# within seconds, and the client gets its room back then, not a lease_ttl (60 s) later.
RELEASE_RETRY_FIRST = 0.1
RELEASE_RETRY_LONGEST = 2.0
# At shutdown, the longest wait for releases under way; any still failing are left to their TTL.
SETTLE_SECONDS = 1.0
# Why the leases of a request the store failed already take their policies unasked.
FAILED_THIS_REQUEST = "the store failed this request's previous call; not asked again"
# Store failures come in floods; one line a second says enough.
FAILURE_LOG_INTERVAL = 1.0


@dataclass(frozen=True, slots=True)
class LeaseStatus:
    limit: ConcurrencyLimit
    outcome: str  # allow | concurrency_limited | skipped | fail_open | fail_closed | fail_local


class Admission:
    """What one request holds: its leases, renewed until `release()`, which is called once,
    when the response has ended (completed, aborted by the client, or failed)."""

    __slots__ = ("_held", "_owner", "_timer", "admitted", "statuses", "store_failed")

    def __init__(
        self,
        owner: Concurrency,
        *,
        admitted: bool,
        statuses: tuple[LeaseStatus, ...],
        store_failed: bool,
        held: list[tuple[Store, LeaseCheck]],
    ) -> None:
        self.admitted = admitted
        self.statuses = statuses
        self.store_failed = store_failed  # refused because a fail-closed limit could not be checked
        self._owner = owner
        self._held = held
        self._timer: asyncio.TimerHandle | None = None
        if held:
            self._schedule_renewal()

    def release(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        held, self._held = self._held, []
        for store, lease in held:
            self._owner.release(store, lease)

    def _schedule_renewal(self) -> None:
        every = min(lease.limit.lease_ttl for _, lease in self._held) * RENEW_FRACTION
        self._timer = asyncio.get_running_loop().call_later(every, self._renew)

    def _renew(self) -> None:
        for store, lease in self._held:
            self._owner.renew(store, lease)
        self._schedule_renewal()


class Concurrency:
    """`breaker`: the limiter's circuit breaker when the store is shared, so a store that
    keeps failing costs lease requests no timeout either. `on_release_failed` is told of
    each lease whose release failed (left to its TTL), for the metric."""

    def __init__(
        self,
        store: Store,
        *,
        local_divisor: int = 1,
        breaker: CircuitBreaker | None = None,
        on_release_failed: Callable[[], None] | None = None,
        local_store: MemoryStore | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock`: what breaker waits and lease expiries are read from (the limiter's)."""
        self._clock = clock
        self._store = store
        self._local_store = local_store if local_store is not None else MemoryStore(clock=clock)
        self._local_divisor = local_divisor
        self._breaker = breaker
        self._on_release_failed = on_release_failed
        # Unique across the fleet: 64 random bits per process, then a count.
        self._process = os.urandom(8).hex()
        self._serial = itertools.count()
        self._background: set[asyncio.Future[None]] = set()  # the event loop holds tasks only weakly
        self._last_failure_log = -FAILURE_LOG_INTERVAL
        # Set when the store answers a lease call: releases waiting to be retried go then.
        self._answered: asyncio.Future[None] | None = None

    def lease_id(self) -> str:
        return f"{self._process}:{next(self._serial)}"

    def prepare(self, limit: ConcurrencyLimit) -> PreparedLease:
        """What a lease under `limit` carries, made when the plans are compiled: the store's
        arguments and, under `on_store_error: local`, this instance's share of the limit."""
        prepared = self._store.prepare_lease(limit)
        if limit.on_store_error is not FailurePolicy.LOCAL:
            return prepared
        return dataclasses.replace(prepared, local=local_share(limit, self._local_divisor))

    async def acquire(
        self,
        limits: Sequence[ConcurrencyLimit],
        identities: Sequence[str],
        *,
        store_failed: bool = False,
        prepared: Sequence[PreparedLease | None] | None = None,
    ) -> Admission:
        """A lease under each limit for the identity beside it, or none at all. `store_failed`:
        the store failed this request already (its rate limits' check), so it is not asked.
        `prepared`: each limit's `prepare`, when the plans made them."""
        lease_id = self.lease_id()
        held: list[tuple[Store, LeaseCheck]] = []
        statuses: list[LeaseStatus] = []
        refused: LeaseStatus | None = None
        if prepared is None:
            prepared = (None,) * len(limits)
        try:
            for limit, identity, args in zip(limits, identities, prepared, strict=True):
                lease = LeaseCheck(limit=limit, identity=identity, lease=lease_id, prepared=args)
                if store_failed:
                    status, holder = self._on_store_error(lease, FAILED_THIS_REQUEST)
                else:
                    status, holder = await self._take(lease)
                    store_failed = status.outcome in FAILURE_OUTCOMES
                statuses.append(status)
                if holder is not None:
                    held.append((holder, lease))
                elif status.outcome != FAIL_OPEN:
                    refused = status
                    break
        except BaseException:  # cancelled: the request is gone, and so are its leases
            for store, lease in held:
                self.release(store, lease)
            raise
        if refused is not None:
            for store, lease in held:
                self.release(store, lease)
            skipped = [dataclasses.replace(s, outcome=SKIPPED) if s.outcome == ALLOW else s for s in statuses[:-1]]
            statuses = skipped + [refused] + [LeaseStatus(limit, SKIPPED) for limit in limits[len(statuses) :]]
            return Admission(
                self,
                admitted=False,
                statuses=tuple(statuses),
                store_failed=refused.outcome in (FAIL_CLOSED, NO_ROOM),
                held=[],
            )
        return Admission(self, admitted=True, statuses=tuple(statuses), store_failed=False, held=held)

    async def _take(self, lease: LeaseCheck) -> tuple[LeaseStatus, Store | None]:
        """The lease's status, and the store that holds it (None: not held)."""
        breaker = self._breaker
        if breaker is not None and not breaker.allows(self._clock()):
            return self._on_store_error(lease, "the store failed repeatedly; circuit breaker open")
        try:
            answer = await self._store.acquire(lease)
        except StoreFull as exc:
            self._log_failure(f"refusing requests with 503: {exc}")
            return LeaseStatus(lease.limit, NO_ROOM), None
        except StoreNotConnected as exc:
            if breaker is not None:
                breaker.not_sent(self._clock())
            return self._on_store_error(lease, str(exc))
        except StoreError as exc:
            if breaker is not None:
                breaker.failed(self._clock())
            self.release(self._store, lease)  # the script may have run
            return self._on_store_error(lease, str(exc))
        except asyncio.CancelledError:
            if breaker is not None:
                breaker.abandoned(self._clock())
            self.release(self._store, lease)
            raise
        if breaker is not None:
            breaker.succeeded()
        self._store_answered()
        if answer.admitted:
            return LeaseStatus(lease.limit, ALLOW), self._store
        return LeaseStatus(lease.limit, CONCURRENCY_LIMITED), None

    def _on_store_error(self, lease: LeaseCheck, why: str) -> tuple[LeaseStatus, Store | None]:
        limit = lease.limit
        self._log_failure(f"store failed, concurrency limit {limit.name} fails {limit.on_store_error.value}: {why}")
        outcome = FAILURE_OUTCOME[limit.on_store_error]
        if limit.on_store_error is not FailurePolicy.LOCAL:
            return LeaseStatus(limit, outcome), None
        local = self._local_lease(lease)
        try:
            answer = self._local_store.acquire_now(local)
        except StoreFull as exc:
            self._log_failure(f"refusing requests with 503: {exc}")
            return LeaseStatus(limit, NO_ROOM), None
        return LeaseStatus(limit, outcome), self._local_store if answer.admitted else None

    def _log_failure(self, line: str) -> None:
        """One line a second, however many requests the store fails."""
        now = self._clock()
        if now - self._last_failure_log >= FAILURE_LOG_INTERVAL:
            self._last_failure_log = now
            log.warning("%s", line)

    def _local_lease(self, lease: LeaseCheck) -> LeaseCheck:
        """`lease` as the stand-in holds it: under the limit's share, as the plans compiled it;
        a lease made without them has its share worked out here."""
        prepared = lease.prepared
        if prepared is not None and prepared.local is not None and prepared.limit is lease.limit:
            return dataclasses.replace(lease, limit=prepared.local)
        return dataclasses.replace(lease, limit=local_share(lease.limit, self._local_divisor))

    async def read(self, limit: ConcurrencyLimit, identity: str) -> LeaseReading:
        """The identity's live leases under `limit`, as the store holds them. Raises StoreError."""
        return await self._store.read_leases(limit, identity)

    async def reset(self, limit: ConcurrencyLimit, identity: str) -> bool:
        """Forget the identity's leases, so it is admitted again at once; whether the store held
        any live. The local stand-in's are forgotten first, so a reset while the store is down
        still frees the client here; then StoreError is raised.

        The requests that held them go on. Each release then finds nothing; a renewal takes its
        lease afresh while there is room, since that request really is in flight, and is
        refused, leaving the request uncounted, once new requests have taken the room."""
        await self._local_store.delete_leases(limit, identity)
        return await self._store.delete_leases(limit, identity)

    def release(self, store: Store, lease: LeaseCheck) -> None:
        if isinstance(store, MemoryStore):
            store.release_now(self._as_held(store, lease))  # nothing to wait for
            return
        self._in_background(self._release(store, lease))

    def renew(self, store: Store, lease: LeaseCheck) -> None:
        if isinstance(store, MemoryStore):
            store.acquire_now(self._as_held(store, lease))
            return
        self._in_background(self._renew(store, lease))

    def _as_held(self, store: Store, lease: LeaseCheck) -> LeaseCheck:
        """The lease as `store` holds it: the local stand-in holds it under the divided limit."""
        if store is self._local_store:
            return self._local_lease(lease)
        return lease

    async def _release(self, store: Store, lease: LeaseCheck) -> None:
        # The lease was last taken or renewed before now, so it has expired by `expired`.
        expired = self._clock() + lease.limit.lease_ttl
        wait = RELEASE_RETRY_FIRST
        woken = False  # the last try was woken early by the store answering another call
        while True:
            try:
                await store.release(lease)
                self._store_answered()
                return
            except StoreError as exc:
                if self._clock() + wait >= expired:
                    log.debug("could not release a lease of %s, left to its TTL: %s", lease.limit.name, exc)
                    if self._on_release_failed is not None:
                        self._on_release_failed()
                    return
            if self._answered is None:
                self._answered = asyncio.get_running_loop().create_future()
            answered = self._answered
            spacing = 0.0
            if woken:
                # The store answered another call but failed this one: on a Redis Cluster, the
                # other masters answer while this lease's master is down or failing over. Waking
                # on their answers still finds this one back soonest, but no more often than this.
                spacing = RELEASE_RETRY_FIRST
                await asyncio.sleep(spacing)
            done, _ = await asyncio.wait((answered,), timeout=wait - spacing)
            woken = bool(done)
            wait = min(2 * wait, RELEASE_RETRY_LONGEST)

    def _store_answered(self) -> None:
        """The store answered a lease call: wake the releases waiting to be retried."""
        answered, self._answered = self._answered, None
        if answered is not None and not answered.done():
            answered.set_result(None)

    async def _renew(self, store: Store, lease: LeaseCheck) -> None:
        try:
            answer = await store.acquire(lease)
        except StoreError as exc:
            log.debug("could not renew a lease of %s; it is tried again: %s", lease.limit.name, exc)
            return
        self._store_answered()
        if not answer.admitted:
            # It expired while the store could not be reached, or an operator reset the
            # client's leases, and others took its room: the request goes on, uncounted,
            # rather than being cut.
            log.warning("a lease of %s expired or was reset before it could be renewed", lease.limit.name)

    async def settle(self) -> None:
        """Wait, boundedly, for the releases and renewals under way; any left are cancelled and
        expire with their TTL."""
        if self._background:
            await asyncio.wait(self._background, timeout=SETTLE_SECONDS)
        for task in list(self._background):
            task.cancel()

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def local_share(limit: ConcurrencyLimit, divisor: int) -> ConcurrencyLimit:
    """This instance's share of the fleet's concurrency under `on_store_error: local`, at least 1."""
    return dataclasses.replace(limit, concurrency=max(1, limit.concurrency // divisor))
