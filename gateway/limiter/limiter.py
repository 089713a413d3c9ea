"""The decision the proxy asks for: check a request's limits, and apply each
limit's failure policy when the store cannot answer.

Trusts the store to be atomic and to raise only `StoreError`. When it does,
each limit's `on_store_error` decides (gateway.limiter.failure_policies): `open`
allows, `closed` rejects (the proxy answers 503), and `local` asks an in-process
bucket whose rate and burst are the global ones divided by `store.local_divisor` × `workers`.

Shadow limits (`shadow: true`) never decide a request. `check_with_shadow` sends
the enforced limits in one all-or-nothing store check, as `check` does, and each
shadow limit in a check of its own, all at once. So a shadow limit that is short
never keeps the enforced limits from being charged, nor another shadow limit:
each is charged whenever it alone has room, as if it were the request's only
limit. The Lua script and its model stay as they are. Routes without shadow
limits call `check` and pay nothing for the feature.

Leased limits (`lease: N`, see `gateway.limiter.token_leases`) are taken first, one
at a time, each from this process's lease, refilled from the store when it
cannot pay; then the request's other limits go to the store in one check as
usual. If any limit denies, what the leased limits took goes back to their
leases, locally: the request is still all or nothing, and the store needs no
refund, since leased tokens were charged there when they were leased. Only a
lease that would then hold more than N (it was refilled while requests held its
tokens) gives the excess back to the store, so no process sits on more than N.
A request the store failed once (a refill, or the check of the other limits)
asks it nothing more: its limits still to decide take their failure policies at
once, as its concurrency limits do (`Decision.store_unanswered`), so it waits out
one store timeout at most, not one per call.
That refund goes in the background, and only while the circuit breaker is
closed: a denial never waits for it, and a refund the store fails or the breaker
holds back leaves those tokens charged (under-admission until the bucket refills,
never over-admission). A check that owes its charge (`LimitCheck.owed`) goes to the store
past the denial cache and the client waves, which would answer it without charging.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

from gateway.config.model import FailurePolicy, Limit
from gateway.limiter.circuit_breaker import BreakerState, CircuitBreaker
from gateway.limiter.client_waves import ClientWaves, check_seats
from gateway.limiter.concurrency import FAILED_THIS_REQUEST as NOT_ASKED_AGAIN
from gateway.limiter.concurrency import SETTLE_SECONDS, Concurrency
from gateway.limiter.decision import (
    UNLIMITED,
    Decision,
    LimitStatus,
    as_shadow,
    cached_denial,
    decision_of,
    leased,
    local_share,
    owes_charge,
)
from gateway.limiter.denial_cache import REFUNDING_STORE_MAX_HOLD, DenialCache
from gateway.limiter.failure_policies import FAILURE_LOG_INTERVAL, FailurePolicies
from gateway.limiter.memory_store import MemoryStore, StoreFull
from gateway.limiter.outcomes import (
    ALLOW,
    FAILURE_OUTCOME,
    FAILURE_OUTCOMES,
    SKIPPED,
)
from gateway.limiter.settlement import Settlements
from gateway.limiter.store import (
    BucketReading,
    LimitCheck,
    Prepared,
    SharedStore,
    Store,
    StoreDecision,
    StoreError,
    StoreNotConnected,
)
from gateway.limiter.token_leases import Leases
from gateway.limiter.top_limited import TopLimited
from gateway.limiter.worker_resets import WorkerResets

log = logging.getLogger(__name__)

# What a check is told while the circuit breaker keeps it from the store.
BREAKER_OPEN = StoreError("the store failed repeatedly; circuit breaker open")
# What a leased check is told when the refill it waited for failed.
LEASE_REFILL_FAILED = StoreError("the store failed the lease refill this request waited for")
# What the rest of a request's checks are told once the store failed one of them.
FAILED_THIS_REQUEST = StoreError(NOT_ASKED_AGAIN)  # the reason its concurrency limits are given too


class Limiter:
    """`shared_store`: the store is shared with other gateways over the network (Redis).
    Then a bucket found short of its cost is answered locally until it could pay
    (`gateway.limiter.denial_cache`), one client's concurrent checks reach the
    store in waves (`gateway.limiter.client_waves`), and a store that keeps failing
    is left alone for a while (`gateway.limiter.circuit_breaker`).
    `on_breaker_change` is told each new breaker state, for the metric,
    `on_lease_release_failed` of each concurrency lease left to its TTL, and `on_settlement`
    of each settlement's outcome (`gateway.limiter.settlement`)."""

    def __init__(
        self,
        store: Store,
        *,
        local_divisor: int = 1,
        shared_store: bool = False,
        on_breaker_change: Callable[[BreakerState], None] | None = None,
        on_lease_release_failed: Callable[[], None] | None = None,
        on_settlement: Callable[[str], None] | None = None,
        resets: WorkerResets | None = None,
        local_store: Callable[..., MemoryStore] = MemoryStore,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`resets`: with several workers, the log of bucket resets they share. `local_store`
        makes each in-process stand-in of `on_store_error: local`, on `clock`. `clock`: the
        seconds every expiry, refill and breaker wait here is read from, so that tests of
        them can set the time rather than wait for it."""
        self._clock = clock
        self.store = store
        # The store that leases tokens and takes them back: a shared one only, found once.
        self._shared = store if isinstance(store, SharedStore) else None
        self._resets = resets
        self.leases = Leases() if shared_store else None
        if not shared_store:
            self.denials = None
        elif store.refunds:
            self.denials = DenialCache(max_hold=REFUNDING_STORE_MAX_HOLD)
        else:
            self.denials = DenialCache()
        self.breaker = CircuitBreaker(on_change=on_breaker_change)
        self._waves = ClientWaves(seats=lambda checks, waited: check_seats(checks, waited, clock()))
        self._local_divisor = local_divisor
        self._local_store = local_store(clock=clock)
        self._policies = FailurePolicies(self._local_store, local_divisor, clock)
        self._last_refund_log = -FAILURE_LOG_INTERVAL
        self._refunds: set[asyncio.Future[None]] = set()  # the event loop holds tasks only weakly
        # (limit name, identity) of each denial, for the admin API's top limited clients.
        self.top_limited = TopLimited(now=clock())
        # Costs the response said, settled where their reservations were charged.
        self.settlements = Settlements(
            store, self._local_store, self.breaker, self._policies.local_check, on_outcome=on_settlement, clock=clock
        )
        # Concurrency limits: leases in the same store, behind the same breaker.
        self.concurrency = Concurrency(
            store,
            local_divisor=local_divisor,
            breaker=self.breaker if shared_store else None,
            on_release_failed=on_lease_release_failed,
            local_store=local_store(clock=clock),
            clock=clock,
        )

    def prepare(self, limit: Limit, cost: int, *, max_delay: float = 0.0, owed: bool = False) -> Prepared:
        """What a check of `limit` at `cost` carries (`LimitCheck.prepared`), made when the plans
        are compiled: the store's arguments and, under `on_store_error: local`, the stand-in's
        for the limit's share (its `local.limit`, which the rate-limit fields describe too)."""
        prepared = self.store.prepare(limit, cost, max_delay=max_delay, owed=owed)
        if limit.on_store_error is not FailurePolicy.LOCAL:
            return prepared
        share = local_share(limit, self._local_divisor, cost)
        local = self._local_store.prepare(share, cost, max_delay=max_delay, owed=owed)
        return dataclasses.replace(prepared, local=local)

    async def check(self, checks: Sequence[LimitCheck], *, shed: bool = False) -> Decision:
        """`shed`: the caller is past its in-flight cap; the failure policies answer at once,
        without the store, its breaker or the caches."""
        if not checks:
            return UNLIMITED
        if shed:
            return self._policies.decide(checks)
        if self._resets is not None:
            self._apply_sibling_resets(self._resets)
        # The stand-in is checked only while the store fails: without this, the buckets of
        # every client of an outage's last refill period stayed until the next outage.
        self._local_store.forget_full()
        if self.denials is not None:
            if leased(checks):
                decision = await self._check_leased(checks, self.denials)
            else:
                decision = await self._check_shared(checks, self.denials)
        else:
            try:
                decision = decision_of(checks, await self.store.check(checks))
            except StoreError as exc:
                decision = self._policies.on_store_error(checks, exc)
            except StoreFull as exc:
                decision = self._policies.no_room(checks, exc)
        if not decision.allowed:  # an allowed request costs this one test
            now = self._clock()
            for c, status in zip(checks, decision.statuses):
                if status.denied:
                    self.top_limited.denied(c.limit.name, c.identity, now)
        return decision

    async def check_with_shadow(self, checks: Sequence[LimitCheck], *, shed: bool = False) -> Decision:
        """`check` for checks of which some are shadow limits: only the enforced ones decide."""
        enforced = [c for c in checks if not c.limit.shadow]
        shadows = [c for c in checks if c.limit.shadow]
        main, *shadowed = await asyncio.gather(self.check(enforced, shed=shed), *(self.check((c,), shed=shed) for c in shadows))
        enforced_statuses = iter(main.statuses)
        shadow_statuses = (as_shadow(d.statuses[0]) for d in shadowed)
        statuses = tuple(next(shadow_statuses) if c.limit.shadow else next(enforced_statuses) for c in checks)
        return dataclasses.replace(main, statuses=statuses)

    async def _check_leased(self, checks: Sequence[LimitCheck], denials: DenialCache) -> Decision:
        """`check` for a request with leased limits (see the module docstring)."""
        statuses: list[LimitStatus | None] = [None] * len(checks)
        spent: list[int] = []  # the leased limits that took their cost
        failed: StoreError | None = None  # set once the store failed this request
        for i, c in enumerate(checks):
            if not (c.limit.lease and c.cost):
                continue
            leased = await self._lease(c, denials, failed)
            statuses[i] = leased.statuses[0]
            if leased.statuses[0].outcome in FAILURE_OUTCOMES:
                failed = FAILED_THIS_REQUEST
            if leased.statuses[0].outcome == ALLOW:  # a failure policy's allow took nothing
                spent.append(i)
            if not leased.allowed:
                return self._denied_after_leases(checks, statuses, spent, leased)
        rest = [i for i, status in enumerate(statuses) if status is None]
        wait = 0.0  # a leased limit never delays; a shaping limit among the rest may
        if rest:
            decision = await self._check_shared([checks[i] for i in rest], denials, failed=failed)
            for i, status in zip(rest, decision.statuses):
                statuses[i] = status
            if not decision.allowed:
                return self._denied_after_leases(checks, statuses, spent, decision)
            wait = decision.wait
        return Decision(allowed=True, statuses=tuple(statuses), retry_after=0.0, store_failed=False, wait=wait)  # type: ignore[arg-type]

    async def _lease(self, check: LimitCheck, denials: DenialCache, failed: StoreError | None = None) -> Decision:
        """One leased limit: paid from this process's lease, else by a refill from the store,
        one in flight per bucket; requests that find one in flight wait and spend what it brought.
        `failed`: the store failed this request already; a lease that cannot pay takes the policy."""
        leases = self.leases
        assert leases is not None
        answered = True
        while True:
            left = leases.take(check, self._clock())
            if left is not None:
                return Decision(
                    allowed=True, statuses=(LimitStatus(check.limit, check.cost, left, ALLOW),), retry_after=0.0, store_failed=False
                )
            if not answered:  # the store failed the refill waited for
                return self._policies.on_store_error((check,), LEASE_REFILL_FAILED)
            if failed is not None:
                return self._policies.on_store_error((check,), failed)
            refill = leases.refilling(check)
            if refill is None:
                break
            answered = await asyncio.shield(refill)
        with leases.refill(check) as refilled:
            decision = await self._check_shared((check,), denials, lease=True)
            status = decision.statuses[0]
            refilled.set_result(status.outcome not in FAILURE_OUTCOME.values())
        if status.outcome == ALLOW and status.remaining is not None:  # the store's tokens, and the lease's
            status = dataclasses.replace(status, remaining=status.remaining + leases.unspent(check))
            decision = dataclasses.replace(decision, statuses=(status,))
        return decision

    async def _lease_from_store(self, check: LimitCheck) -> StoreDecision:
        """A refill: the store takes up to `lease` tokens, the cost for this request and the
        rest for the lease. Its answer reads as a check of that one bucket."""
        assert self.leases is not None and self._shared is not None
        grant = await self._shared.lease(check, max(check.limit.lease, check.cost))
        if grant.allowed:
            self.leases.grant(check, grant.granted - check.cost, grant.remaining, self._clock())
        return StoreDecision(allowed=grant.allowed, remaining=(grant.remaining,), retry_after=grant.retry_after, resets=(None,))

    def _refund(self, check: LimitCheck, tokens: int) -> None:
        """Give `tokens` leased of the check's bucket back to the store, without the denial
        waiting for it: a refund costs a round trip, and a full store timeout when the store
        is slow or gone. Not while the circuit breaker keeps checks from the store (nor as
        its probe). A refund not made leaves the tokens charged: under-admission until the
        bucket refills, never over-admission."""
        if self.breaker.state is not BreakerState.CLOSED:
            self._refund_lost(check, tokens, BREAKER_OPEN)
            return
        task = asyncio.ensure_future(self._send_refund(check, tokens))
        self._refunds.add(task)
        task.add_done_callback(self._refunds.discard)

    async def _send_refund(self, check: LimitCheck, tokens: int) -> None:
        assert self._shared is not None  # only a lease's tokens are refunded
        try:
            await self._shared.refund(check, tokens)
        except StoreError as exc:
            self._refund_lost(check, tokens, exc)

    def _refund_lost(self, check: LimitCheck, tokens: int, exc: StoreError) -> None:
        now = self._clock()
        if now - self._last_refund_log >= FAILURE_LOG_INTERVAL:
            self._last_refund_log = now
            log.warning(
                "could not give %d leased tokens of %s back to the store, they stay charged: %s", tokens, check.limit.name, exc
            )

    async def settle(self) -> None:
        """Wait, boundedly, for the refunds, lease releases and renewals under way; any left
        are cancelled (refunds leave their tokens charged, leases expire with their TTL)."""
        if self._refunds:
            await asyncio.wait(self._refunds, timeout=SETTLE_SECONDS)
        for task in list(self._refunds):
            task.cancel()
        await self.settlements.close(SETTLE_SECONDS)
        await self.concurrency.settle()

    def _denied_after_leases(
        self, checks: Sequence[LimitCheck], statuses: list[LimitStatus | None], spent: list[int], denial: Decision
    ) -> Decision:
        """The request is denied (by `denial`): the leased limits that took their cost give it
        back to their leases and count as skipped, as do the limits not asked. What a lease
        cannot keep goes back to the store in the background (`_refund`)."""
        assert self.leases is not None
        now = self._clock()
        for i in spent:
            excess = self.leases.give_back(checks[i], now)
            if excess:
                self._refund(checks[i], excess)
            status = statuses[i]
            assert status is not None and status.remaining is not None
            statuses[i] = dataclasses.replace(status, remaining=status.remaining + status.cost, outcome=SKIPPED)
        final = tuple(
            status if status is not None else LimitStatus(c.limit, c.cost, None, SKIPPED) for c, status in zip(checks, statuses)
        )
        return Decision(allowed=False, statuses=final, retry_after=denial.retry_after, store_failed=denial.store_failed)

    async def _check_shared(
        self, checks: Sequence[LimitCheck], denials: DenialCache, *, lease: bool = False, failed: StoreError | None = None
    ) -> Decision:
        """`lease`: the one check is a refill of its lease (`_lease_from_store`). `failed`: the
        store failed this request already; the failure policies answer without asking it."""
        owes = owes_charge(checks)
        if not owes:
            cached = denials.lookup(checks, self._clock())
            if cached is not None:
                return cached_denial(checks, cached)
        if failed is not None:
            return self._policies.on_store_error(checks, failed)
        if owes:
            # An owed charge is taken whatever the answer: no cached denial or wave holds it back.
            try:
                answer = await self._ask_store(checks, denials, lease=False)
            except StoreError as exc:
                return self._policies.on_store_error(checks, exc)
            return self._policies.on_store_error(checks, BREAKER_OPEN) if answer is None else decision_of(checks, answer)
        signature: tuple[object, ...] = tuple((c.limit.name, c.identity, c.cost) for c in checks)
        if lease:
            signature = ("lease", *signature)
        try:
            wave = await self._waves.join(signature, None if lease else checks)
        except StoreError as exc:  # the wave this one waited for failed
            return self._policies.on_store_error(checks, exc)
        error = None
        try:
            if wave.after is not None:  # the wave waited for may have emptied the bucket
                cached = denials.lookup(checks, self._clock())
                if cached is not None:
                    return cached_denial(checks, cached)
            sent_at = self._clock()
            found = await self._ask_store(checks, denials, lease=lease, sent_at=sent_at)
            if found is None:
                # Not the wave's error: the store was not asked, and the next wave asks
                # the breaker for itself (it may be closed again by then).
                return self._policies.on_store_error(checks, BREAKER_OPEN)
            answer = found
            if not lease:
                wave.learn(sent_at, answer.remaining, answer.resets)
        except StoreError as exc:
            error = exc
            return self._policies.on_store_error(checks, exc)
        finally:
            # After recording: the next wave wakes to a cache that knows this answer.
            self._waves.leave(signature, wave, error)
        return decision_of(checks, answer)

    async def _ask_store(
        self, checks: Sequence[LimitCheck], denials: DenialCache, *, lease: bool, sent_at: float | None = None
    ) -> StoreDecision | None:
        """The store's answer, behind the circuit breaker (None: it holds the store back), taught
        to the denial cache. Raises StoreError."""
        if sent_at is None:
            sent_at = self._clock()
        if not self.breaker.allows(sent_at):
            return None
        try:
            answer = await (self._lease_from_store(checks[0]) if lease else self.store.check(checks))
        except StoreNotConnected:
            self.breaker.not_sent(self._clock())
            raise
        except StoreError:
            self.breaker.failed(self._clock())
            raise
        except asyncio.CancelledError:
            self.breaker.abandoned(self._clock())
            raise
        self.breaker.succeeded()
        denials.learn(checks, answer, sent_at)
        return answer

    async def read_bucket(self, limit: Limit, identity: str) -> BucketReading:
        """The bucket of `limit` for `identity` as the store holds it. Raises StoreError."""
        return await self.store.read(limit, identity)

    def denied_here_for(self, limit: Limit, identity: str) -> float:
        """How long this process still answers that bucket's denial itself (0: it asks the store)."""
        if self.denials is None:
            return 0.0
        return self.denials.held_for(limit, identity, self._clock())

    async def reset_bucket(self, limit: Limit, identity: str) -> bool:
        """Delete the bucket in the store, and then this process's cached denials of it,
        which would otherwise keep the client denied here until they ran out. Sibling
        workers are told (`resets`) before this returns, and drop theirs before their next check. Whether the
        store held the bucket. The in-process stand-in of `on_store_error: local` is reset
        first, so a reset while the store is down still frees the client here; then
        StoreError is raised, and the cached denials stay, as does the store's bucket."""
        self._forget_bucket(limit.name, identity)
        try:
            held = await self.store.delete(limit, identity)
        finally:
            if self._resets is not None:  # the other workers forget theirs before it is answered
                self._resets.publish(limit.name, identity)
        if self.denials is not None:
            self.denials.forget(limit.name, identity)
        return held

    def _forget_bucket(self, limit_name: str, identity: str) -> None:
        """Drop what this process holds of a bucket outside the store but its cached denials:
        the stand-in of `on_store_error: local` and a lease."""
        self._local_store.delete_now(limit_name, identity)  # bucket ids ignore the stand-in's cost
        if self.leases is not None:
            self.leases.forget(limit_name, identity)

    def _apply_sibling_resets(self, resets: WorkerResets) -> None:
        """Apply the resets other workers' admin APIs made (and this one's: a second time, harmless)."""
        unseen = resets.unseen()
        if not unseen:
            if unseen is None and self.denials is not None:
                self.denials.clear()  # some were missed: ask the store about every client again
            return
        for limit_name, identity in unseen:
            self._forget_bucket(limit_name, identity)
            if self.denials is not None:
                self.denials.forget(limit_name, identity)

    async def store_reachable(self) -> tuple[bool, str]:
        """Whether the store answers now, and if not, why (`store.refusal(why)`: it refuses us)."""
        try:
            await self.store.ping()
        except StoreError as exc:
            return False, str(exc)
        return True, "ok"
