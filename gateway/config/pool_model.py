"""The parsed config of an upstream pool: its targets, how it balances them, and its
active and passive health checks. Immutable and trusted, as the rest of the parsed config
(gateway.config.model), which holds a route's pool as one of these."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from gateway.config.redaction import redacted_url


class Balance(enum.Enum):
    """How a pool picks the target of a request (see gateway.upstream.balancing)."""

    ROUND_ROBIN = "round_robin"  # nginx's smooth weighted round robin
    LEAST_REQUESTS = "least_requests"  # fewest requests in flight for its weight
    RANDOM_TWO_CHOICES = "random_two_choices"  # the less busy of two drawn by weight


@dataclass(frozen=True, kw_only=True)
class Target:
    url: str  # base URL, without a trailing slash
    name: str  # its label in metrics and logs: as configured, else its host:port
    weight: int = 1


@dataclass(frozen=True, kw_only=True)
class HealthCheck:
    """Active checks: a GET of `path` on each target every `interval`."""

    path: str
    interval: float
    timeout: float
    unhealthy_after: int  # consecutive failed checks that take a target out of rotation
    healthy_after: int  # consecutive passed checks that bring it back


@dataclass(frozen=True, kw_only=True)
class PassiveEjection:
    eject_after: int  # consecutive connection errors or 5xx answers
    eject_for: float  # seconds out of rotation


@dataclass(frozen=True, kw_only=True)
class UpstreamPool:
    targets: tuple[Target, ...]
    balance: Balance
    health: HealthCheck | None
    passive: PassiveEjection | None
    retries: int  # further targets tried after a connect failure

    def __str__(self) -> str:
        """As `gateway check` shows it."""
        targets = ", ".join(redacted_url(t.url) + (f" (weight {t.weight})" if t.weight != 1 else "") for t in self.targets)
        parts = [f"{self.balance.value} over {targets}", f"retries {self.retries}"]
        if self.health is not None:
            parts.append(f"health {self.health.path} every {self.health.interval:g}s")
        if self.passive is not None:
            parts.append(f"eject after {self.passive.eject_after} failures for {self.passive.eject_for:g}s")
        return "; ".join(parts)
