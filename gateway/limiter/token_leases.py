"""Leased tokens: what one gateway process holds of a shared bucket, to spend locally.

A global limit, or one very busy client, puts every request on one Redis key. A
limit with `lease: N` takes up to N tokens of its bucket in one script call
(`lua/token_lease.lua`, at least the request's cost) and spends the rest in
process, so that key sees about one call per N requests. The contract:

- **Never more than the limit.** Tokens are charged in the store when they are
  leased, before any is spent, so the fleet admits at most what the bucket gave.
- **Bounded under-admission.** Leased tokens not spent within the limit's
  `lease_lapse` of the last grant lapse: charged, never spent. So the fleet
  admits at most N tokens per process per lapse less than the limit allows.
  Tokens given back past N (see `give_back`) go back to the store.
- **Denials come from the store.** A process whose lease cannot pay asks the
  store, and only the store denies (or the denial cache, which caches the
  store's denials exactly).
- **One refill in flight per bucket and process.** Requests that find the lease
  empty while a refill is in flight wait for it and spend what it brought; the
  next refill is sent only when that has run out, so a burst of concurrent
  requests costs one call per N of them, not one each. When the store failed
  that refill, they take their failure policy at once rather than each wait
  out a timeout of their own.

No I/O and no clock of its own: times are passed in. Bounded: past
`max_entries` the oldest lease is dropped, which costs its unspent tokens only.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from gateway.config.model import Limit
from gateway.limiter.keys import memory_key
from gateway.limiter.store import LimitCheck

# One per leasing client per process; ~200 bytes each.
DEFAULT_MAX_ENTRIES = 65_536
# Lapsed leases dropped per grant, oldest first: more than a grant adds, so memory
# follows the clients that lease, and no grant pays for a long quiet spell.
FORGET_PER_GRANT = 8

_Key = tuple[str, str | bytes]  # (limit name, memory_key(identity))


@dataclass(slots=True)
class Lease:
    # The limit it was leased for. A reload that changed the limit makes a new one that never
    # spends it; an unchanged one (equal, though a new object) takes it over on first use.
    limit: Limit
    tokens: int  # leased and not yet spent
    expires: float  # when the unspent tokens lapse
    remaining: float  # the bucket's tokens in the store after the last grant


class Leases:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self._max_entries = max_entries
        self._held: dict[_Key, Lease] = {}  # in grant order: the eviction order
        self._refills: dict[_Key, asyncio.Future[bool]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def take(self, check: LimitCheck, now: float) -> float | None:
        """Spend the check's cost from its lease: the tokens left then (the store's as of
        the last grant, plus the lease's), or None when the lease cannot pay."""
        key = (check.limit.name, memory_key(check.identity))
        lease = self._held.get(key)
        if lease is None:
            return None
        if lease.limit is not check.limit:
            if lease.limit != check.limit:
                del self._held[key]
                return None
            lease.limit = check.limit  # the same limit, reloaded
        if lease.expires <= now:
            del self._held[key]
            return None
        if lease.tokens < check.cost:
            return None
        lease.tokens -= check.cost
        return lease.remaining + lease.tokens

    def unspent(self, check: LimitCheck) -> int:
        """The tokens the check's lease holds (0 for none)."""
        lease = self._held.get((check.limit.name, memory_key(check.identity)))
        return lease.tokens if lease is not None and _same(lease.limit, check.limit) else 0

    def grant(self, check: LimitCheck, tokens: int, remaining: float, now: float) -> None:
        """Hold `tokens` more for the check's bucket, which the store left at `remaining`;
        what is unspent lapses `lease_lapse` from now."""
        key = (check.limit.name, memory_key(check.identity))
        held = self._held.pop(key, None)  # re-inserted last
        if held is not None and _same(held.limit, check.limit) and held.expires > now:
            tokens += held.tokens
        for _ in range(FORGET_PER_GRANT):
            oldest = next(iter(self._held.values()), None)
            if oldest is None or oldest.expires > now:
                break
            del self._held[next(iter(self._held))]
        if len(self._held) >= self._max_entries:
            del self._held[next(iter(self._held))]
        self._held[key] = Lease(limit=check.limit, tokens=tokens, expires=now + check.limit.lease_lapse, remaining=remaining)

    def give_back(self, check: LimitCheck, now: float) -> int:
        """Return the cost a request spent, when another of its limits denied it: the store
        was charged when the tokens were leased. A lease that lapsed meanwhile takes nothing
        back. Returns what the lease cannot keep, for the caller to give back to the store:
        requests that find the lease empty while others hold its tokens refill it, so the
        tokens coming back can outnumber a lease, and a process holding more than
        max(lease, cost) would under-admit the fleet past the bound, then let them lapse."""
        lease = self._held.get((check.limit.name, memory_key(check.identity)))
        if lease is None or not _same(lease.limit, check.limit) or lease.expires <= now:
            return 0
        lease.tokens += check.cost
        excess = lease.tokens - max(check.limit.lease, check.cost)
        if excess <= 0:
            return 0
        lease.tokens -= excess
        return excess

    def forget(self, limit_name: str, identity: str) -> None:
        """Drop a bucket's lease (the bucket was reset)."""
        self._held.pop((limit_name, memory_key(identity)), None)

    def refilling(self, check: LimitCheck) -> asyncio.Future[bool] | None:
        """The refill of the check's lease in flight, if any. Its result: whether the
        store answered it; if so `take` again, and if not, the store just failed."""
        return self._refills.get((check.limit.name, memory_key(check.identity)))

    @contextlib.contextmanager
    def refill(self, check: LimitCheck) -> Iterator[asyncio.Future[bool]]:
        """Mark a refill of the check's lease in flight until the block ends. Set the
        future's result to False when the store failed; it is True otherwise."""
        key = (check.limit.name, memory_key(check.identity))
        done = self._refills[key] = asyncio.get_running_loop().create_future()
        try:
            yield done
        finally:
            del self._refills[key]
            if not done.done():
                done.set_result(True)


def _same(held: Limit, limit: Limit) -> bool:
    """The same limit: the very object, or an equal one a reload made (compared field by field)."""
    return held is limit or held == limit
