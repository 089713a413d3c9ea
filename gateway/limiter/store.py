"""The one small interface between the limiter and wherever the counts live.

A store takes the request's list of (limit, identity, cost) and answers with a
decision in one atomic step: all limits allow and all are charged, or nothing
is charged but what is owed (`LimitCheck.owed`), which is charged either way. It also holds concurrency leases: it takes one atomically if
fewer than the limit's concurrency are live, and gives it up on release. For
the admin API it reads a bucket or an identity's leases without changing them,
and forgets them. It knows nothing of HTTP. Every failure to reach the shared
state is raised as `StoreError`; library exceptions never cross this line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from gateway.config.model import ConcurrencyLimit, Limit


class StoreError(Exception):
    """The store could not answer (down, slow, or refusing); the limit's failure policy decides."""


# Redis's replies when it will not serve us: a wrong password or user (WRONGPASS), no
# AUTH where one is required (NOAUTH), or an ACL that denies a command or key (NOPERM).
# Retrying changes none of them: the deployment must.
REFUSALS = ("WRONGPASS", "NOAUTH", "NOPERM")


def refusal(detail: str) -> bool:
    """Whether a store error says the store refuses us, rather than that it is away."""
    return any(code in detail for code in REFUSALS)


class StoreNotConnected(StoreError):
    """Nothing was sent: there is no connection to the store now, and one is being made.
    Costs the caller nothing and says nothing new about the store."""


@dataclass(frozen=True, slots=True)
class Prepared:
    """What a store derives from a limit as one route or rule applies it (its cost, max_delay
    and owed) made once, when the plans are compiled (`Store.prepare`), so a check carries it
    and the store reads it rather than deriving it per request. A reload compiles new plans
    and so new ones: nothing is kept across configs."""

    limit: Limit
    cost: int
    max_delay: float
    owed: bool
    args: Any  # the store's own: the Redis script's ARGV, the in-process store's spec
    # Under `on_store_error: local`, the same made by the in-process stand-in for the limit's
    # share (gateway.limiter.decision.local_share); None for any other policy.
    local: Prepared | None = None

    def fits(self, check: LimitCheck) -> bool:
        """Whether this was made for `check`'s limit, cost, max_delay and owed: a check changed
        after it was built (a cost of 0 to read, a tier's limit) derives its own."""
        return (
            self.limit is check.limit
            and self.cost == check.cost
            and self.max_delay == check.max_delay
            and self.owed == check.owed
        )


# Not frozen: a frozen dataclass sets each field through object.__setattr__ (three times the
# cost), and one is made for every check. Treated as immutable all the same: changed only
# through dataclasses.replace.
@dataclass(slots=True)
class LimitCheck:
    limit: Limit
    identity: str  # "source=value", as the client presented it; hashed by the store
    cost: int
    # The longest this request may wait to be admitted (the limit's max_delay, when the
    # caller has room to hold it); 0: admitted now or rejected.
    max_delay: float = 0.0
    # The cost is owed whatever the answer (settled after the response, or a rule that
    # charges every hit): charged even when the request is refused, past what the bucket
    # holds, into debt. It still refuses when it could not pay, as does a read (cost 0)
    # while the bucket is in debt. Never waits: max_delay is ignored.
    owed: bool = False
    # Made for this limit, cost, max_delay and owed when the plans were compiled; None, or one
    # that does not fit (`Prepared.fits`): the store derives them for this check alone.
    prepared: Prepared | None = None


# Not frozen: a frozen dataclass sets each field through object.__setattr__ (three times the
# cost), and one is made for every check. Treated as immutable all the same: changed only
# through dataclasses.replace.
@dataclass(slots=True)
class StoreDecision:
    allowed: bool
    # Per check, in order. None: not asked, because a check in an earlier Redis Cluster slot denied.
    remaining: tuple[float | None, ...]
    retry_after: float  # seconds; 0 when allowed
    resets: tuple[float | None, ...]  # per check: seconds until a quota's window ends; None for a bucket or not asked
    wait: float = 0.0  # seconds an allowed request waits before it goes on (mode: delay)


@dataclass(frozen=True, slots=True)
class LeaseGrant:
    """A lease's answer: whole tokens taken from one bucket, at least the check's cost."""

    allowed: bool
    granted: int  # 0 when denied
    remaining: float  # the bucket's tokens after the grant, or as found when denied
    retry_after: float  # seconds; 0 when allowed, inf if the cost exceeds the capacity


@dataclass(frozen=True, slots=True)
class BucketReading:
    """One bucket as the store holds it now, for the admin API."""

    key: str  # where the store keeps it: the Redis key, or "LIMIT:{DIGEST}" in process
    held: bool  # False: never charged, or refilled and forgotten; then it is full
    tokens: float  # as refilled up to now
    full_in: float  # seconds until it is full again, left alone


@dataclass(frozen=True, slots=True)
class LeaseCheck:
    """One request's lease under a concurrency limit."""

    limit: ConcurrencyLimit
    identity: str  # "source=value", as the client presented it; hashed by the store
    lease: str  # unique per request across the fleet
    # Made for `limit` when the plans were compiled; None, or one made for another limit
    # (the stand-in's share): the store derives what it needs for this call alone.
    prepared: PreparedLease | None = None


@dataclass(frozen=True, slots=True)
class PreparedLease:
    """What a store derives from a concurrency limit, made when the plans are compiled
    (`Store.prepare_lease`), and the limit's share under `on_store_error: local`."""

    limit: ConcurrencyLimit
    args: Any  # the store's own: the lease script's ARGV after the lease id
    local: ConcurrencyLimit | None = None  # this process's share, for the stand-in


@dataclass(frozen=True, slots=True)
class LeaseDecision:
    admitted: bool
    in_flight: int  # the identity's live leases after the call


@dataclass(frozen=True, slots=True)
class LeaseReading:
    """One identity's leases under a concurrency limit as the store holds them now, for the admin API."""

    key: str  # where the store keeps them: the Redis key, or "LIMIT:leases:{DIGEST}" in process
    in_flight: int  # live leases, by the store's own clock: expired ones count for nothing
    next_expiry_in: float | None  # seconds until the soonest live lease expires unless renewed; None: none live
    last_expiry_in: float | None  # seconds until the last one does, were none renewed; None: none live


class Store(Protocol):
    description: str  # for logs and /readyz, with any password removed
    # Whether a check may give back tokens it charged (a Redis Cluster check across
    # slots that a later slot denied). Then tokens can reappear faster than they refill.
    refunds: bool

    def prepare(self, limit: Limit, cost: int, *, max_delay: float = 0.0, owed: bool = False) -> Prepared:
        """What a check of `limit` at `cost`, `max_delay` and `owed` needs that depends on them
        alone, made once when the plans are compiled (without `local`: the limiter adds it)."""

    def prepare_lease(self, limit: ConcurrencyLimit) -> PreparedLease:
        """What a lease under `limit` needs that depends on it alone (`LeaseCheck.prepared`;
        without `local`: the limiter adds it)."""

    async def start(self) -> None:
        """Open connections. May raise StoreError; the gateway still starts and retries."""

    async def check(self, checks: Sequence[LimitCheck]) -> StoreDecision:
        """Check all buckets and charge them all, or none but the owed ones. Raises StoreError."""

    async def settle(self, check: LimitCheck, delta: int) -> None:
        """Settle a cost the response said, `delta` past the `check.cost` reserved for it (a token
        bucket's), in one atomic step: less (`delta` < 0) goes back, never past the capacity;
        more is an owed charge, into debt. Raises StoreError."""

    async def acquire(self, lease: LeaseCheck) -> LeaseDecision:
        """Take the lease if fewer than the limit's concurrency are live, or renew it if held
        (gateway.limiter.leases). Raises StoreError."""

    async def release(self, lease: LeaseCheck) -> None:
        """Give the lease up. Raises StoreError; a lease not released expires with its TTL."""

    async def read_leases(self, limit: ConcurrencyLimit, identity: str) -> LeaseReading:
        """The live leases of `limit` for `identity` ("source=value"), changing nothing. Raises StoreError."""

    async def delete_leases(self, limit: ConcurrencyLimit, identity: str) -> bool:
        """Forget that identity's leases, so it is admitted again; whether any was live. The
        requests that held them go on: a later release finds nothing, and a renewal takes the
        lease afresh if there is room. Raises StoreError."""

    async def read(self, limit: Limit, identity: str) -> BucketReading:
        """The bucket of `limit` for `identity` ("source=value"), without charging it. Raises StoreError."""

    async def delete(self, limit: Limit, identity: str) -> bool:
        """Forget that bucket, so it is full again; whether the store held it. Raises StoreError."""

    async def ping(self) -> None:
        """Raise StoreError unless the store answers now."""

    async def close(self) -> None:
        """Release connections."""


@runtime_checkable
class SharedStore(Store, Protocol):
    """A store the fleet shares (Redis), which also leases tokens to a gateway process. The
    in-process store does not: its buckets are this process's own, and the config refuses
    a `lease` without a shared `store`."""

    async def lease(self, check: LimitCheck, want: int) -> LeaseGrant:
        """Take min(`want`, whole tokens held) from one bucket, at least the check's cost, or
        nothing if it holds less than the cost. Raises StoreError."""

    async def refund(self, check: LimitCheck, tokens: int) -> None:
        """Give `tokens` leased for the check's bucket back to it, never past its capacity.
        Raises StoreError."""
