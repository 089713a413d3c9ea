"""An exact negative cache: answer a denied client locally until it could pass.

When the shared store reports a bucket holding fewer tokens than the cost
(found short and denied, or left short by the charge it just allowed), no
request of that cost on that bucket can pass before the missing tokens have
refilled: tokens only refill at the limit's rate, other gateways can only take
tokens away, and a bucket expires only once it would be full anyway. So until then a denial can be answered
without asking the store, and a client flooding far over its limit costs the
store almost nothing.

A limit that shapes (`mode: delay`) admits a request once the bucket's debt
would cover the rest, `max_delay` sooner than it could pay outright: its
denial ends that much sooner, and a bucket short by no more than its debt is
not denied at all. A quota (a fixed window) refills nothing until its window
ends: its denial lasts until then, as the store's clock measured it, from the
time the check was sent.

Exact as long as nobody deletes a bucket behind the gateway's back and the
store's clock is not stepped forward. A store that gives tokens back (a Redis
Cluster refunds a check that another slot denied) breaks the premise that
others only take tokens away: there a denial is held at most `max_hold`, so a
bucket a refund refilled is under-admitted for that long at most. So is a leased
limit's (`lease: N`) on any store, since a lease gives back tokens it cannot keep. Two details keep it exact:
- A denial is keyed by bucket and cost: a smaller cost on the same bucket may
  pass sooner.
- Its clock starts when the check was sent, which is before the store ran it,
  so the round trip never extends it. It is also shortened by a margin for
  clock-rate differences between hosts and the rounding of the store's reply.

No I/O and no clock of its own: times are passed in. Bounded: past
`max_entries` the oldest denial is forgotten, which only costs a store call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.config.model import Limit
from gateway.limiter.keys import memory_key
from gateway.limiter.store import LimitCheck, StoreDecision

# Enough for every client flooding one gateway at once; ~250 bytes each, long identities
# held by their digest (gateway.limiter.keys.memory_key), so at most ~16 MB.
DEFAULT_MAX_ENTRIES = 65_536
# NTP keeps clocks within 500 ppm of each other even while slewing; a cached
# denial gives up a thousandth of its length, and a millisecond for rounding.
CLOCK_RATE_MARGIN = 1e-3
ROUNDING_MARGIN = 0.001
# How long a store that refunds may have its denials answered locally: a flooding
# client still costs that store at most one call per wave per 50 ms.
REFUNDING_STORE_MAX_HOLD = 0.05


def could_pass_in(*, remaining: float, limit: Limit, cost: int, reset: float | None = None) -> float:
    """Seconds from the check until a request of `cost` could pass a bucket that held
    `remaining` tokens (a quota: `reset` seconds until its window ends), by the store's clock."""
    if limit.quota is not None:
        return reset if reset is not None else 0.0
    return (cost - remaining) / limit.rate.per_second - limit.max_delay


def held_until(sent_at: float, wait: float) -> float:
    """When a denial that the store measured as `wait` seconds from a check sent at `sent_at`
    stops being answered locally: that much sooner by the safety margins."""
    return sent_at + wait * (1 - CLOCK_RATE_MARGIN) - ROUNDING_MARGIN


@dataclass(frozen=True, slots=True)
class CachedDenial:
    index: int  # which of the request's checks is denied
    remaining: float  # that bucket's tokens now, as refilled since the denial
    retry_after: float  # seconds until the store expects the request could pass, as it would advertise
    expires_in: float  # seconds until the cached denial ends: sooner, by the margins (and `max_hold`)


class DenialCache:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, *, max_hold: float = float("inf")) -> None:
        self._max_entries = max_entries
        self._max_hold = max_hold
        # (limit name, memory_key(identity), cost) -> (limit, until, remaining, sent_at, passes_at). The
        # limit itself is kept so that one a reload changed never matches; an unchanged one
        # (equal, though a new object) takes the entry over on first use. `until`
        # ends the hold; `passes_at`, without the margins, is what a Retry-After advertises.
        self._entries: dict[tuple[str, str | bytes, int], tuple[Limit, float, float, float, float]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, checks: Sequence[LimitCheck], now: float) -> CachedDenial | None:
        """A cached denial covering one of `checks`, if any."""
        entries = self._entries
        if not entries:
            return None
        for index, check in enumerate(checks):
            limit, cost = check.limit, check.cost
            key = (limit.name, memory_key(check.identity), cost)
            entry = entries.get(key)
            if entry is None:
                continue
            cached_limit, until, remaining, sent_at, passes_at = entry
            if cached_limit is not limit:
                if cached_limit != limit:
                    del entries[key]
                    continue
                entries[key] = (limit, *entry[1:])  # the same limit, reloaded
            if until <= now:
                del entries[key]
                continue
            # Below `cost` until `until`, which the margins place before it could pay.
            refilled = remaining if limit.quota is not None else remaining + (now - sent_at) * limit.rate.per_second
            return CachedDenial(index=index, remaining=refilled, retry_after=passes_at - now, expires_in=until - now)
        return None

    def held_for(self, limit: Limit, identity: str, now: float) -> float:
        """How long the longest cached denial of one bucket, of any cost, still lasts; 0 if none.
        Only denials `lookup` would answer count: one cached for a limit a reload changed is
        not. Scans every entry: for the admin API, never the request path."""
        held = memory_key(identity)
        ends = [
            entry[1]
            for key, entry in self._entries.items()
            if key[0] == limit.name and key[1] == held and (entry[0] is limit or entry[0] == limit)
        ]
        return max([until - now for until in ends if until > now], default=0.0)

    def forget(self, limit_name: str, identity: str) -> int:
        """Drop the denials of one bucket, whatever their cost (the bucket was reset); how many.
        Scans every entry: for the admin API, never the request path."""
        held = memory_key(identity)
        doomed = [key for key in self._entries if key[0] == limit_name and key[1] == held]
        for key in doomed:
            del self._entries[key]
        return len(doomed)

    def clear(self) -> None:
        """Drop every denial: buckets were reset that this process cannot name."""
        self._entries.clear()

    def learn(self, checks: Sequence[LimitCheck], answer: StoreDecision, sent_at: float) -> None:
        """Record each bucket the store's answer to a check sent at `sent_at` left short of its
        cost, allowed or not: it cannot pass until it refills."""
        for c, left, reset in zip(checks, answer.remaining, answer.resets):
            if left is not None and left < c.cost:
                self.record(c, remaining=left, sent_at=sent_at, reset=reset)
                if c.owed and c.cost and left < 0:  # the reads' cached denial, which this debt made longer
                    self.record(dataclasses.replace(c, cost=0), remaining=left, sent_at=sent_at, reset=reset)

    def record(self, check: LimitCheck, *, remaining: float, sent_at: float, reset: float | None = None) -> None:
        """Remember that the store found this bucket short of its cost for a check sent at `sent_at`
        (a quota: `reset` seconds before its window ends)."""
        limit = check.limit
        wait = could_pass_in(remaining=remaining, limit=limit, cost=check.cost, reset=reset)
        # Tokens a lease gives back reappear in the store faster than they refill.
        max_hold = min(self._max_hold, REFUNDING_STORE_MAX_HOLD) if limit.lease else self._max_hold
        until = min(held_until(sent_at, wait), sent_at + max_hold)
        if until <= sent_at:
            return
        key = (limit.name, memory_key(check.identity), check.cost)
        entries = self._entries
        entries.pop(key, None)  # re-inserted last: the dict's order is the eviction order
        if len(entries) >= self._max_entries:
            del entries[next(iter(entries))]
        entries[key] = (limit, until, remaining, sent_at, sent_at + wait)
