"""The rate-limit fields of a response, in each limit's `response.headers` style,
compiled per route at load time.

`ietf` follows draft-ietf-httpapi-ratelimit-headers-12 (20 November 2026):
`RateLimit-Policy` lists every ietf-style limit of the route,
`"name";q=QUOTA;w=WINDOW, ...` (the draft allows a list), and each concurrency
limit as `"name";q=N;qu="concurrent-requests"` (also on a route with no ietf-style
rate limit, where the policy is all that is sent); `RateLimit:
"name";r=REMAINING;t=WINDOW` names the one closest to exhaustion, where `t` is
the effective window: the seconds within which the client can use no more than
the `r` left. `x-ratelimit` sends `X-RateLimit-Limit`, `X-RateLimit-Remaining`
and `X-RateLimit-Reset` for the x-ratelimit-style limit closest to exhaustion,
as GitHub and Kong do, except that the reset is seconds from now (as `t` and
Retry-After are), not an epoch: the bucket runs on the store's clock, and a
client's clock need not agree with it. `none` limits are not advertised. A route
mixing styles sends each set for its own limits. A set is sent only when some
limit in it is known, so a request no store answered (failed open, say) carries
none: their absence says the store did not decide.

For a token bucket the quota (`q`, `X-RateLimit-Limit`) is the burst, the window
`w` the seconds an empty bucket takes to refill, the remaining the whole tokens
left, `t` the seconds until one token more than those is due (so on a 429 `t`
is at most Retry-After, which waits for all the tokens the request costs), and
`X-RateLimit-Reset` the seconds until the bucket is full again. A limit decided
by its `on_store_error: local` stand-in is described as that stand-in: its share
of the burst and rate, the quota actually applied. A bucket in debt (`mode:
delay`) shows 0 left, and its `t` runs until its debt is repaid and one token is
back. For a quota (a fixed window), `q` is its limit, `w` its window (a month's
nominally 30 days), and both `t` and the reset the seconds until its window
ends, as the store's clock measured it: nothing comes back before then.

A limit whose cost the response says (`cost: {from: ...}`) counts other units than
requests, which the draft's `qu` parameter names, its default being `requests`. The
draft registers `content-bytes`, so `response-bytes` says `qu="content-bytes"`. It
registers no unit for an LLM's tokens or an upstream's own units, and leaving `qu`
out would tell every client that `q` and `r` count requests: so `json:`, `sse-json:`
and `header:` say `qu` with the config's spelling of the source (`qu="json:usage.total_tokens"`,
`qu="header:X-Usage-Units"`), a value outside the registry. A client that knows the
draft cannot take that item for requests; one that insists on registered units ignores
the item, as it must a malformed one, rather than misread it.
"""

from __future__ import annotations

import math
import string
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gateway.config.model import ConcurrencyLimit, HeaderStyle, Limit
from gateway.limiter.decision import LimitStatus, local_share
from gateway.limiter.outcomes import FAIL_LOCAL


@dataclass(frozen=True, slots=True)
class Advertised:
    """One limit of a route as its fields describe it."""

    index: int  # in the route's limits, and so in a decision's statuses
    limit: Limit
    local: Limit  # what `on_store_error: local` applies in its place (`limit` when it is not local)
    policy: str  # the RateLimit-Policy item of `limit`
    local_policy: str  # ... and of `local`
    tier_policies: Mapping[str, str]  # ... and of each of its tiers, by the tier's limit name (LIMIT/TIER)

    def applied(self, status: LimitStatus, local_divisor: int) -> Limit:
        """The limit that decided `status`: the local stand-in, or the limit itself, or the
        client's tier of it (`status.limit`, named LIMIT/TIER)."""
        if status.limit is not self.limit:  # a tier: its own numbers, and its own local share
            return local_share(status.limit, local_divisor, status.cost) if _decided_locally(status) else status.limit
        return self.local if _decided_locally(status) else self.limit

    def policy_for(self, status: LimitStatus, local_divisor: int) -> str:
        if status.limit is self.limit:
            return self.local_policy if _decided_locally(status) else self.policy
        if _decided_locally(status):  # a tier's local share: only while the store is down
            return policy(self.applied(status, local_divisor))
        return self.tier_policies[status.limit.name]

    def as_configured(self, status: LimitStatus) -> bool:
        """Whether `status` was decided by the limit itself, so its policy is `policy`."""
        return status.limit is self.limit and not _decided_locally(status)


@dataclass(frozen=True, slots=True)
class RateLimitFields:
    """A route's rate-limit fields, compiled from its limits."""

    ietf: tuple[Advertised, ...]
    x: tuple[Advertised, ...]
    policy: str  # RateLimit-Policy while every ietf limit is decided as configured
    concurrency_policy: str  # the items of the route's concurrency limits, which end every RateLimit-Policy
    # The fields of every response when no ietf-style rate limit is there to describe: a
    # route whose limits are concurrency limits alone still advertises their policy, which
    # depends on the config only. Shared by every response: never written to.
    fixed: dict[str, str]
    # Some ietf limit has a local stand-in or tiers, whose policy may replace its own.
    varies: bool
    local_divisor: int  # store.local_divisor: the share a local stand-in of a tier applies

    @classmethod
    def of(
        cls,
        limits: Sequence[tuple[Limit, Limit]],
        local_divisor: int = 1,
        concurrency: Sequence[ConcurrencyLimit] = (),
    ) -> RateLimitFields:
        """`limits`: each rate limit of the route, in order, with its local stand-in;
        `concurrency`: its concurrency limits."""
        advertised = [
            Advertised(
                index=i,
                limit=limit,
                local=local,
                policy=policy(limit),
                local_policy=policy(local),
                tier_policies={tier.name: policy(tier) for tier in limit.tiers.limits.values()} if limit.tiers else {},
            )
            for i, (limit, local) in enumerate(limits)
        ]
        ietf = tuple(a for a in advertised if a.limit.response.headers is HeaderStyle.IETF)
        x = tuple(a for a in advertised if a.limit.response.headers is HeaderStyle.X_RATELIMIT)
        concurrency_policy = ", ".join(concurrency_policy_item(limit) for limit in concurrency)
        return cls(
            ietf=ietf,
            x=x,
            policy=", ".join([*(a.policy for a in ietf), *filter(None, [concurrency_policy])]),
            concurrency_policy=concurrency_policy,
            fixed={"RateLimit-Policy": concurrency_policy} if concurrency_policy and not ietf else {},
            varies=any(a.local is not a.limit or a.limit.tiers is not None for a in ietf),
            local_divisor=local_divisor,
        )

    def headers(self, statuses: Sequence[LimitStatus]) -> dict[str, str]:
        """The fields for a decision's `statuses` (one per limit of the route)."""
        fields = dict(self.fixed)
        divisor = self.local_divisor
        chosen = _chosen(statuses, self.ietf, divisor)
        if chosen is not None:
            if self.varies and not all(a.as_configured(statuses[a.index]) for a in self.ietf):
                items = [a.policy_for(statuses[a.index], divisor) for a in self.ietf]
                fields["RateLimit-Policy"] = ", ".join([*items, *filter(None, [self.concurrency_policy])])
            else:
                fields["RateLimit-Policy"] = self.policy
            status = statuses[chosen.index]
            limit, remaining, window, _ = _state(chosen.applied(status, divisor), status)
            fields["RateLimit"] = f'"{limit.name}";r={remaining};t={window}'
        chosen = _chosen(statuses, self.x, divisor)
        if chosen is not None:
            status = statuses[chosen.index]
            limit, remaining, _, reset = _state(chosen.applied(status, divisor), status)
            fields["X-RateLimit-Limit"] = str(math.floor(limit.burst))
            fields["X-RateLimit-Remaining"] = str(remaining)
            fields["X-RateLimit-Reset"] = str(reset)
        return fields


def _chosen(statuses: Sequence[LimitStatus], candidates: Sequence[Advertised], local_divisor: int) -> Advertised | None:
    """most_restrictive, without ranking when there is nothing to rank (most routes' case)."""
    if len(candidates) > 1:
        return most_restrictive(statuses, candidates, local_divisor)
    if candidates and statuses[candidates[0].index].remaining is not None:
        return candidates[0]
    return None


def most_restrictive(
    statuses: Sequence[LimitStatus], candidates: Sequence[Advertised], local_divisor: int = 1
) -> Advertised | None:
    """Of `candidates`, the one with the fewest requests left (the slower to refill on a
    tie), or None if no candidate's remaining is known."""
    best: Advertised | None = None
    best_rank: tuple[float, float] | None = None
    for candidate in candidates:
        status = statuses[candidate.index]
        if status.remaining is None:
            continue
        rank = (status.remaining // max(status.cost, 1), -candidate.applied(status, local_divisor).refill_seconds)
        if best_rank is None or rank < best_rank:
            best, best_rank = candidate, rank
    return best


def _decided_locally(status: LimitStatus) -> bool:
    """Whether the local stand-in decided (with a fail-closed limit beside it, none did)."""
    return status.outcome == FAIL_LOCAL and status.remaining is not None


def _state(limit: Limit, status: LimitStatus) -> tuple[Limit, int, int, int]:
    """The limit applied, its whole tokens left, the effective window (whole seconds until
    one more token than those is due; for a quota, until its window ends), and the whole
    seconds until it is full again (for a quota, the same)."""
    held = status.remaining or 0.0  # below 0 for a bucket in debt (mode: delay)
    left = math.floor(max(0.0, held))
    if status.reset is not None:
        window = full = math.ceil(status.reset)
    else:
        # Within this many seconds the client can use no more than `left`; a full bucket's
        # next token comes one refill interval after the client spends one.
        window = math.ceil((left + 1 - held) / limit.rate.per_second)
        full = math.ceil((limit.burst - held) / limit.rate.per_second) if held < limit.burst else 0
    return limit, left, window, full


def policy(limit: Limit) -> str:
    """The RateLimit-Policy item of `limit`, which depends on the config alone."""
    item = f'"{limit.name}";q={math.floor(limit.burst)};w={max(1, math.ceil(limit.refill_seconds))}'
    unit = quota_unit(limit)
    return item if unit is None else f'{item};qu="{unit}"'


# What a Structured Field String may hold unescaped: printable ASCII but `"` and `\`
# (RFC 9651 section 3.3.3); `%` too, which escapes the rest.
_SF_STRING_SAFE = "".join(c for c in string.printable if c.isprintable() and c not in '"\\%')


def quota_unit(limit: Limit) -> str | None:
    """The draft's `qu` of `limit`: None for requests (the default), `content-bytes` for a
    response's bytes, else the spelling of where the response says its cost (see above),
    percent-encoded where a Structured Field String could not carry it."""
    if limit.cost is None:
        return None
    source = limit.cost.source
    if source.kind == "response-bytes":
        return "content-bytes"
    return urllib.parse.quote(str(source), safe=_SF_STRING_SAFE)


def concurrency_policy_item(limit: ConcurrencyLimit) -> str:
    """The RateLimit-Policy item of a concurrency limit: its quota is requests in flight,
    a unit the draft registers, over no window."""
    return f'"{limit.name}";q={limit.concurrency};qu="concurrent-requests"'


def retry_after_seconds(seconds: float) -> int:
    """Whole seconds, rounded up, at least 1."""
    if math.isinf(seconds):
        return 86400
    return max(1, math.ceil(seconds))
