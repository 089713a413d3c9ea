"""Prometheus metrics for dashboards. No label ever holds a client identity:
routes are labelled by their configured match, methods by a fixed set."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.multiprocess import MultiProcessCollector

from gateway import __version__
from gateway.limiter.circuit_breaker import BreakerState

# Anything else a client sends is counted as OTHER, so clients cannot mint label values.
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "CONNECT", "TRACE"})
UNMATCHED_ROUTE = "unmatched"
# From a same-host Redis (~0.1 ms) up past the largest sensible store.timeout.
LIMITER_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5)
UPSTREAM_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


# status // 100 -> its label; HTTP status codes have three digits.
STATUS_CLASSES = tuple(f"{digit}xx" for digit in range(10))


def method_label(method: str) -> str:
    return method if method in KNOWN_METHODS else "OTHER"


class Children:
    """The children of one labelled metric for some fixed labels (a route, a limit), each
    bound on first use and kept.

    `labels()` checks the names and looks the child up under a lock, about 3 µs a call;
    a kept child is one dict hit away. Binding on first use rather than up front keeps
    /metrics to the label sets that have happened. Callers pass values from a bounded
    set (method_label, STATUS_CLASSES, decision outcomes), so the dict stays small."""

    __slots__ = ("_metric", "_fixed", "_names", "_bound")

    def __init__(self, metric: MetricWrapperBase, names: tuple[str, ...] = (), **fixed: str) -> None:
        self._metric = metric
        self._fixed = fixed
        self._names = names
        self._bound: dict[tuple[str, ...], Any] = {}

    def __call__(self, *values: str) -> Any:
        child = self._bound.get(values)
        if child is None:
            child = self._metric.labels(**self._fixed, **dict(zip(self._names, values, strict=True)))
            self._bound[values] = child
        return child


class Metrics:
    def __init__(self, *, multiprocess: bool = False) -> None:
        # Each gateway has its own registry, so several can run in one process (tests, gateway.testing).
        self.registry = CollectorRegistry(auto_describe=True)
        self._multiprocess = multiprocess
        r = self.registry
        self.requests = Counter(
            "gateway_requests", "Requests answered, by route, method and status class.",
            ["route", "method", "status_class"], registry=r,
        )
        self.decisions = Counter(
            "gateway_limiter_decisions", "Limiter decisions, by route, limit and decision.",
            ["route", "limit", "decision"], registry=r,
        )
        self.limiter_latency = Histogram(
            "gateway_limiter_latency_seconds", "Time to decide a request's limits, store call included.",
            buckets=LIMITER_BUCKETS, registry=r,
        )
        self.upstream_latency = Histogram(
            "gateway_upstream_latency_seconds", "Time from sending upstream to the response headers, by route.",
            ["route"], buckets=UPSTREAM_BUCKETS, registry=r,
        )
        self.shed = Counter(
            "gateway_requests_shed", "Requests answered 503 at once because max_in_flight were already in flight.",
            registry=r,
        )
        self.in_flight = Gauge(
            "gateway_requests_in_flight", "Requests being handled now.", registry=r, multiprocess_mode="livesum"
        )
        self.store_breaker = Gauge(
            "gateway_store_breaker", "Worker processes whose store circuit breaker is in each state (closed, open, half_open).",
            ["state"], registry=r, multiprocess_mode="livesum",
        )
        build = Gauge(
            "gateway_build_info", "The running gateway's version.", ["version"], registry=r, multiprocess_mode="max"
        )
        build.labels(version=__version__).set(1)
        self.reload_failures = Counter(
            "gateway_config_reload_failures", "Config reloads refused because the new file was invalid; the old config serves on.",
            registry=r,
        )
        self.reload_success = Gauge(
            "gateway_config_last_reload_success_timestamp", "Unix time of the last config reload that took effect (0: none yet).",
            registry=r, multiprocess_mode="max",
        )

    def exposition_registry(self) -> CollectorRegistry:
        """What /metrics serves: this process's registry, or every worker's when there are several."""
        if not self._multiprocess:
            return self.registry
        combined = CollectorRegistry()
        MultiProcessCollector(combined)
        return combined


def breaker_gauge_setter(gauge: Gauge) -> Callable[[BreakerState], None]:
    """Keep `gateway_store_breaker` at 1 for the breaker's state and 0 for the others."""
    children = {state: gauge.labels(state=state.value) for state in BreakerState}

    def set_state(current: BreakerState) -> None:
        for state, child in children.items():
            child.set(1 if state is current else 0)

    return set_state
