"""The RateLimit-Policy and RateLimit response fields, per
draft-ietf-httpapi-ratelimit-headers: `"name";q=QUOTA;w=WINDOW` and
`"name";r=REMAINING;t=RESET`.

For a token bucket the quota `q` is the burst, the window `w` is the time an
empty bucket takes to refill, `r` is the whole tokens left, and `t` is the
seconds until the bucket is full again. Only the most restrictive limit is
described: the one with the fewest requests left.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gateway.config.model import Limit
from gateway.limiter.limiter import LimitStatus


def most_restrictive(statuses: Sequence[LimitStatus]) -> int | None:
    """The index of the status with the fewest requests left, or None if none is known."""
    best: int | None = None
    best_rank: tuple[float, float] | None = None
    for index, status in enumerate(statuses):
        if status.remaining is None:
            continue
        rank = (status.remaining // max(status.cost, 1), -status.limit.refill_seconds)
        if best_rank is None or rank < best_rank:
            best, best_rank = index, rank
    return best


def policy(limit: Limit) -> str:
    """The RateLimit-Policy value of `limit`, which depends on the config alone."""
    return f'"{limit.name}";q={math.floor(limit.burst)};w={max(1, math.ceil(limit.refill_seconds))}'


def ratelimit_headers(statuses: Sequence[LimitStatus], policies: Sequence[str]) -> dict[str, str]:
    """The fields for a decision; `policies[i]` is `policy()` of `statuses[i].limit`."""
    index = most_restrictive(statuses)
    if index is None:
        return {}
    status = statuses[index]
    limit = status.limit
    remaining = max(0.0, status.remaining or 0.0)
    reset = math.ceil((limit.burst - remaining) / limit.rate.per_second) if remaining < limit.burst else 0
    return {
        "RateLimit-Policy": policies[index],
        "RateLimit": f'"{limit.name}";r={math.floor(remaining)};t={reset}',
    }


def retry_after_seconds(seconds: float) -> int:
    """Whole seconds, rounded up, at least 1."""
    if math.isinf(seconds):
        return 86400
    return max(1, math.ceil(seconds))
