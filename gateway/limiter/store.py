"""The one small interface between the limiter and wherever the counts live.

A store takes the request's list of (limit, identity, cost) and answers with a
decision in one atomic step: all limits allow and all are charged, or nothing
is charged. It knows nothing of HTTP. Every failure to reach the shared
state is raised as `StoreError`; library exceptions never cross this line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.config.model import Limit


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
class LimitCheck:
    limit: Limit
    identity: str  # "source=value", as the client presented it; hashed by the store
    cost: int


@dataclass(frozen=True, slots=True)
class StoreDecision:
    allowed: bool
    # Per check, in order. None: not asked, because a check in an earlier Redis Cluster slot denied.
    remaining: tuple[float | None, ...]
    retry_after: float  # seconds; 0 when allowed


@dataclass(frozen=True, slots=True)
class BucketReading:
    """One bucket as the store holds it now, for the admin API."""

    key: str  # where the store keeps it: the Redis key, or "LIMIT:{DIGEST}" in process
    held: bool  # False: never charged, or refilled and forgotten; then it is full
    tokens: float  # as refilled up to now
    full_in: float  # seconds until it is full again, left alone


class Store(Protocol):
    description: str  # for logs and /readyz, with any password removed
    # Whether a check may give back tokens it charged (a Redis Cluster check across
    # slots that a later slot denied). Then tokens can reappear faster than they refill.
    refunds: bool

    async def start(self) -> None:
        """Open connections. May raise StoreError; the gateway still starts and retries."""

    async def check(self, checks: Sequence[LimitCheck]) -> StoreDecision:
        """Check all buckets and charge them all, or none. Raises StoreError."""

    async def read(self, limit: Limit, identity: str) -> BucketReading:
        """The bucket of `limit` for `identity` ("source=value"), without charging it. Raises StoreError."""

    async def delete(self, limit: Limit, identity: str) -> bool:
        """Forget that bucket, so it is full again; whether the store held it. Raises StoreError."""

    async def ping(self) -> None:
        """Raise StoreError unless the store answers now."""

    async def close(self) -> None:
        """Release connections."""
