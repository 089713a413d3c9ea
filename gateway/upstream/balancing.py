"""Upstream pools, a route's targets: which target a request goes to, when a target is
out of rotation, and when a failed attempt may go to another. (The connections kept
open to one target are another thing: gateway.upstream.client's `IdleConnections`.)

Pure: no sockets, no clock of its own (callers pass `now`, a monotonic time), no
metrics. The proxy asks a `Balancer` for a target and reports each attempt's
`Outcome` to the target's `TargetState`; the background checks of
gateway.upstream.health_checks report theirs. Trusts its config, which the loader
validated.

A target's state is per URL, shared by every route whose pool names it: one
instance that fails for one route is out for all, and `least_requests` sees all
its load. `TargetStates` keeps that state across reloads while a target's
settings stay the same. The rotation of round robin belongs to the pool.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable, Mapping, Sequence

from gateway.config.model import GatewayConfig
from gateway.config.pool_model import Balance, HealthCheck, PassiveEjection, UpstreamPool


class Outcome(enum.Enum):
    """How one attempt on a target ended; the value is its `kind` in the errors metric."""

    ANSWERED = "answered"  # any status below 500
    SERVER_ERROR = "5xx"
    CONNECT_FAILED = "connect"  # refused, unreachable or timed out before the request was written
    FAILED = "reset"  # the connection broke after the request went out
    TIMEOUT = "timeout"  # no answer within the route's read (or total) timeout


def retry_allowed(outcome: Outcome, *, retries_used: int, retries: int, remaining: float | None) -> bool:
    """Whether a request whose attempt ended in `outcome` may go to another target.

    Only a connect failure is retried: the request never left the gateway, so its body,
    whether buffered or still streaming from the client, has not started and goes whole
    to the next target, whatever the method. After the connection was made, the target
    may have seen the request and acted on it, so nothing is sent twice: a reset, a
    timeout or a 5xx is the client's answer. Retries are bounded by the pool's `retries`
    and by what is left of the route's `timeout.total` (`remaining`; None: no total)."""
    return (
        outcome is Outcome.CONNECT_FAILED
        and retries_used < retries
        and (remaining is None or remaining > 0)
    )


class TargetState:
    """One target's requests in flight, passive ejection and active health."""

    __slots__ = ("_fails", "_failures", "_passes", "ejected_until", "health", "healthy", "in_flight", "passive")

    def __init__(self, passive: PassiveEjection | None, health: HealthCheck | None) -> None:
        self.passive = passive
        self.health = health
        self.in_flight = 0  # attempts on this target now, from every route
        # A target starts in rotation, as in nginx: the gateway serves at once, and the first
        # checks take out what is down.
        self.healthy = True
        self.ejected_until = 0.0
        self._failures = 0  # consecutive connection errors, timeouts and 5xx answers
        self._passes = 0  # consecutive active checks passed
        self._fails = 0  # consecutive active checks failed

    def available(self, now: float) -> bool:
        return self.healthy and now >= self.ejected_until

    def answered(self, outcome: Outcome, now: float) -> bool:
        """Count an attempt's outcome for passive ejection; True when it ejects the target.
        Outcomes of attempts still finishing after an ejection neither extend it nor count
        towards the next: the target comes back after `eject_for` with a clean slate."""
        if outcome is Outcome.ANSWERED:
            self._failures = 0
            return False
        if self.passive is None or now < self.ejected_until:
            return False
        self._failures += 1
        if self._failures < self.passive.eject_after:
            return False
        self._failures = 0
        self.ejected_until = now + self.passive.eject_for
        return True

    def checked(self, passed: bool) -> bool:
        """Count an active check; True when it changes `healthy`. Passing checks alone do
        not end an ejection: a target can answer its health path and fail real requests."""
        assert self.health is not None, "checked without a health check"
        if passed:
            self._fails = 0
            self._passes += 1
            if not self.healthy and self._passes >= self.health.healthy_after:
                # Checks saw it down and now see it back: that ends a passive ejection too,
                # as in Envoy, so a recovered target rejoins without waiting out eject_for.
                self.healthy = True
                self.ejected_until = 0.0
                self._failures = 0
                return True
        else:
            self._passes = 0
            self._fails += 1
            if self.healthy and self._fails >= self.health.unhealthy_after:
                self.healthy = False
                return True
        return False


class TargetStates:
    """The state of every target some pool names, kept from one config to the next."""

    def __init__(self) -> None:
        self._states: dict[str, TargetState] = {}

    def update(self, config: GatewayConfig) -> Mapping[str, TargetState]:
        """The state of each pool target of `config`, by URL: the one it had for a target
        whose health and passive settings are unchanged, a fresh one otherwise. Targets no
        pool names any more are forgotten. The loader has made one URL's settings agree."""
        states: dict[str, TargetState] = {}
        pools = (route.upstream for route in config.routes if isinstance(route.upstream, UpstreamPool))
        for pool in pools:
            for target in pool.targets:
                state = self._states.get(target.url)
                if state is None or (state.health, state.passive) != (pool.health, pool.passive):
                    state = TargetState(pool.passive, pool.health)
                states[target.url] = state
        self._states = states
        return states


class Balancer:
    """Picks one target of a pool among those available now and not yet tried by the request."""

    __slots__ = ("_current", "_pick", "_rng", "_states", "_weights")

    def __init__(
        self,
        states: Sequence[TargetState],
        weights: Sequence[int],
        balance: Balance,
        rng: random.Random | None = None,
    ) -> None:
        self._states = tuple(states)
        self._weights = tuple(weights)
        self._current = [0] * len(self._states)  # smooth round robin's current weights
        self._pick: Callable[[list[int]], int] = getattr(self, _STRATEGIES[balance])
        self._rng = rng or random.Random()

    def choose(self, now: float, tried: int = 0) -> int | None:
        """The index of the target for the next attempt, or None when no target is left.
        `tried` has bit i set for each target i this request already tried."""
        candidates = [
            i for i, state in enumerate(self._states) if not tried >> i & 1 and state.available(now)
        ]
        if not candidates:
            return None
        return candidates[0] if len(candidates) == 1 else self._pick(candidates)

    def _round_robin(self, candidates: list[int]) -> int:
        """nginx's smooth weighted round robin (ngx_http_upstream_get_peer): each candidate
        gains its weight, the richest is picked and pays the total. Weights 5, 1, 1 give
        a a b a c a a rather than a a a a a b c, and every cycle of sum(weights) picks is exact."""
        current, weights = self._current, self._weights
        total = 0
        best = candidates[0]
        for i in candidates:
            current[i] += weights[i]
            total += weights[i]
            if current[i] > current[best]:
                best = i
        current[best] -= total
        return best

    def _least_requests(self, candidates: list[int]) -> int:
        """The fewest requests in flight for their weight; ties, as when all are idle, by
        round robin, so light traffic still follows the weights."""
        states, weights = self._states, self._weights
        loads = [states[i].in_flight / weights[i] for i in candidates]
        least = min(loads)
        return self._round_robin([i for i, load in zip(candidates, loads) if load == least])

    def _random_two_choices(self, candidates: list[int]) -> int:
        """Two distinct targets drawn by weight; the less loaded for its weight wins, the
        first drawn on a tie (Mitzenmacher's power of two choices)."""
        weights = [self._weights[i] for i in candidates]
        first = self._rng.choices(range(len(candidates)), weights)[0]
        weights[first] = 0
        second = self._rng.choices(range(len(candidates)), weights)[0]
        a, b = candidates[first], candidates[second]
        states = self._states
        if states[b].in_flight / self._weights[b] < states[a].in_flight / self._weights[a]:
            return b
        return a


_STRATEGIES = {
    Balance.ROUND_ROBIN: "_round_robin",
    Balance.LEAST_REQUESTS: "_least_requests",
    Balance.RANDOM_TWO_CHOICES: "_random_two_choices",
}
