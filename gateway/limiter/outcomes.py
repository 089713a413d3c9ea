"""What a limit did with a request: the `decision` label of gateway_limiter_decisions_total,
the access log's outcome of each limit, and what the proxy reads to answer. One list,
for rate limits and concurrency limits alike. Plain strings, trusted by every reader."""

from __future__ import annotations

from gateway.config.model import ConcurrencyLimit, FailurePolicy, Limit

ALLOW = "allow"
DENY = "deny"  # a rate limit had no room: the request was refused
SKIPPED = "skipped"  # another limit refused the request, so this one was not charged: it had room, or was not asked
DELAYED = "delayed"  # admitted after a wait, into the bucket's debt (mode: delay)
SHADOW_LIMITED = "shadow_limited"  # a shadow limit that would have denied: not charged, the request went on
CONCURRENCY_LIMITED = "concurrency_limited"  # a concurrency limit was full: the request got 429
ALLOWLISTED = "allowlisted"  # the limit's `allow` names the client: not checked, never charged
# The store could not answer: the limit's failure policy decided instead.
FAIL_OPEN, FAIL_CLOSED, FAIL_LOCAL = "fail_open", "fail_closed", "fail_local"
FAILURE_OUTCOME = {FailurePolicy.OPEN: FAIL_OPEN, FailurePolicy.CLOSED: FAIL_CLOSED, FailurePolicy.LOCAL: FAIL_LOCAL}
FAILURE_OUTCOMES = frozenset(FAILURE_OUTCOME.values())
# The in-process store had no room for the client's bucket or lease: the request got 503.
NO_ROOM = "no_room"


def rate_limit_outcomes(limit: Limit) -> tuple[str, ...]:
    """The decisions a rate limit can take on its own, besides `skipped`: the series of
    gateway_limiter_decisions_total a dashboard reads, exported at 0 from the start."""
    return (
        ALLOW,
        SHADOW_LIMITED if limit.shadow else DENY,
        *((DELAYED,) if limit.max_delay else ()),
        *((ALLOWLISTED,) if limit.allow is not None else ()),
        FAILURE_OUTCOME[limit.on_store_error],
    )


def concurrency_outcomes(limit: ConcurrencyLimit) -> tuple[str, ...]:
    """The same for a concurrency limit."""
    return ALLOW, CONCURRENCY_LIMITED, FAILURE_OUTCOME[limit.on_store_error]
