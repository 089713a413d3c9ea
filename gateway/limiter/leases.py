"""Concurrency-lease math: the reference model every store carries out. No I/O, no clock.

One identity's leases under one concurrency limit are a set of lease ids, each
with the time it expires. A lease is live until then; an expired lease is as
good as released, so a gateway that died holding leases gives them up within
their TTL. Acquiring drops the expired leases, then takes the lease if fewer
than `capacity` are live. Acquiring a lease already held renews it (a new
expiry) without counting it twice; that is how long requests keep theirs.
`lua/concurrency_lease.lua` is the same model in milliseconds, and the store
tests hold the Redis script and the in-process store to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gateway.limiter.store import LeaseReading


@dataclass(frozen=True, slots=True)
class LeaseOutcome:
    admitted: bool
    in_flight: int  # live leases after the call: the taken one included when admitted


def live(leases: Mapping[str, float], now: float) -> dict[str, float]:
    """The leases that have not expired by `now` (one expiring exactly at `now` has)."""
    return {lease: expiry for lease, expiry in leases.items() if expiry > now}


def acquire(
    leases: Mapping[str, float], lease: str, *, capacity: int, ttl: float, now: float
) -> tuple[LeaseOutcome, dict[str, float]]:
    """Take (or renew) `lease` for `ttl` if it is held or fewer than `capacity` are live.
    Returns the outcome and the leases to store back."""
    current = live(leases, now)
    if lease in current or len(current) < capacity:
        current[lease] = now + ttl
        return LeaseOutcome(admitted=True, in_flight=len(current)), current
    return LeaseOutcome(admitted=False, in_flight=len(current)), current


def release(leases: Mapping[str, float], lease: str, now: float) -> dict[str, float]:
    """The live leases without `lease`; releasing one not held changes nothing."""
    current = live(leases, now)
    current.pop(lease, None)
    return current


def lease_reading(key: str, held: Mapping[str, float], now: float) -> LeaseReading:
    """An identity's leases (lease id -> expiry) as live at `now`, by the model's rule (`live`)."""
    expiries = sorted(live(held, now).values())
    return LeaseReading(
        key=key,
        in_flight=len(expiries),
        next_expiry_in=expiries[0] - now if expiries else None,
        last_expiry_in=expiries[-1] - now if expiries else None,
    )
