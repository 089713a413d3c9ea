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

from gateway.limiter.limiter import LimitStatus


def most_restrictive(statuses: Sequence[LimitStatus]) -> LimitStatus | None:
    known = [s for s in statuses if s.remaining is not None]
    if not known:
        return None
    return min(known, key=lambda s: (s.remaining // max(s.cost, 1), -s.limit.refill_seconds))


def ratelimit_headers(statuses: Sequence[LimitStatus]) -> dict[str, str]:
    status = most_restrictive(statuses)
    if status is None:
        return {}
    limit = status.limit
    remaining = max(0.0, status.remaining or 0.0)
    window = max(1, math.ceil(limit.refill_seconds))
    reset = math.ceil((limit.burst - remaining) / limit.rate.per_second) if remaining < limit.burst else 0
    return {
        "RateLimit-Policy": f'"{limit.name}";q={math.floor(limit.burst)};w={window}',
        "RateLimit": f'"{limit.name}";r={math.floor(remaining)};t={reset}',
    }


def retry_after_seconds(seconds: float) -> int:
    """Whole seconds, rounded up, at least 1."""
    if math.isinf(seconds):
        return 86400
    return max(1, math.ceil(seconds))
