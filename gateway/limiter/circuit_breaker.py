"""The store's circuit breaker: stop asking a store that keeps failing.

After `BREAKER_FAILURES` consecutive store failures spread over at least
`BREAKER_FAILING_SECONDS`, the breaker opens: for
`BREAKER_COOLDOWN` seconds no check is sent, and each limit's failure policy
answers at once, so a dead or hung Redis costs a request nothing instead of a
timeout. Then one check is let through as a probe (half-open); its success
closes the breaker, its failure opens it for another cool-down. A probe that
could not be sent, for want of a connection, leaves the probe to the next caller.

No I/O and no clock of its own: the limiter reports outcomes and passes the time.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

# Enough to tell a dead store from one unlucky timeout.
BREAKER_FAILURES = 5
# A stall shorter than this never opens the breaker: with hundreds of checks in
# flight, a 15 ms hiccup fails them all at once, and opening then would turn it
# into a cool-down of unmetered (or rejected) traffic. A dead store costs requests
# at most this long of timeouts before the breaker opens.
BREAKER_FAILING_SECONDS = 0.1
# Short enough that decisions resume well within a second of the store coming
# back, long enough that a dead store sees two probes a second, not a flood.
BREAKER_COOLDOWN = 0.5


class BreakerState(enum.Enum):
    CLOSED = "closed"  # checks go to the store
    OPEN = "open"  # no checks go to the store until the cool-down ends
    HALF_OPEN = "half_open"  # one probe is out; the rest wait for its outcome as if open


class CircuitBreaker:
    """`on_change` is told each new state, for the metric."""

    def __init__(
        self,
        *,
        failures: int = BREAKER_FAILURES,
        failing_seconds: float = BREAKER_FAILING_SECONDS,
        cooldown: float = BREAKER_COOLDOWN,
        on_change: Callable[[BreakerState], None] | None = None,
    ) -> None:
        self._threshold = failures
        self._failing_seconds = failing_seconds
        self._cooldown = cooldown
        self._on_change = on_change
        self.state = BreakerState.CLOSED
        self._failures = 0
        self._failing_since = 0.0  # the first failure of the current run
        self._open_until = 0.0
        if on_change is not None:
            on_change(self.state)

    def _become(self, state: BreakerState) -> None:
        if state is not self.state:
            self.state = state
            if self._on_change is not None:
                self._on_change(state)

    def allows(self, now: float) -> bool:
        """Whether a check may go to the store now. Past the cool-down, the first caller
        becomes the probe; it must report back with `succeeded` or `failed`."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN and now >= self._open_until:
            self._become(BreakerState.HALF_OPEN)
            return True
        return False

    def succeeded(self) -> None:
        if self.state is not BreakerState.CLOSED:
            log.warning("store answered again; circuit breaker closed")
        self._become(BreakerState.CLOSED)
        self._failures = 0

    def abandoned(self, now: float) -> None:
        """A check given leave went away without an outcome (its request was cancelled):
        a probe is owed, so the next caller becomes it."""
        if self.state is BreakerState.HALF_OPEN:
            self._become(BreakerState.OPEN)
            self._open_until = now

    def not_sent(self, now: float) -> None:
        """A check failed without reaching the store (no connection; one is being made).
        While closed that is a failure like any other. A probe that could not be sent
        learned nothing and cost nothing, so the next caller probes: decisions resume
        with the first check after the connection is back, not a cool-down later."""
        if self.state is BreakerState.HALF_OPEN:
            self.abandoned(now)
        else:
            self.failed(now)

    def failed(self, now: float) -> None:
        if self._failures == 0:
            self._failing_since = now
        self._failures += 1
        if self.state is BreakerState.HALF_OPEN or (
            self.state is BreakerState.CLOSED
            and self._failures >= self._threshold
            and now - self._failing_since >= self._failing_seconds
        ):
            if self.state is BreakerState.CLOSED:
                log.warning(
                    "%d store failures in a row; circuit breaker open, failure policies answer for %g s at a time",
                    self._failures,
                    self._cooldown,
                )
            self._become(BreakerState.OPEN)
            self._open_until = now + self._cooldown
