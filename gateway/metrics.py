"""Prometheus metrics for dashboards. No label ever holds a client identity:
routes are labelled by their configured match, methods by a fixed set.

What the request path counts (requests, decisions, upstream and limiter latencies,
pool targets' attempts, in-flight gauges) is, in one process, plain numbers on small
objects that the route plans keep (`CounterValue`, `GaugeValue`, `HistogramValue`):
an increment is an addition, where prometheus_client's takes a lock. One collector,
the only one in the gateway's registry, reads them at scrape time into the families,
names, help, labels and samples (`_total`, `_created`, buckets) prometheus_client
would expose, in the order they are declared here. Only the event loop's thread
touches them; the counts that other threads add to (the log writers' dropped lines)
and the rare ones stay prometheus_client's.

With several workers (`multiprocess=True`) every metric is prometheus_client's, kept
in its per-process mmap files, which whichever worker answers /metrics sums. A
worker's plain numbers are out of the others' reach, and flushing them into those
files on a timer would leave up to a period of each other worker's counts out of
every scrape, and lose them for good when a worker is killed; the mmap write on each
increment is what makes a count visible fleet-wide the moment it happens.

Both kinds bind children the same way (`labels(...)`, kept by `Children`), and a
child bound shows at 0 until counted, so a label set known from the config can be
exported from the start by binding it when the plans are compiled.
"""

from __future__ import annotations

import abc
import contextlib
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.samples import Sample
from prometheus_client.utils import INF, floatToGoString

from gateway import __version__
from gateway.limiter.circuit_breaker import BreakerState

UNMATCHED_ROUTE = "unmatched"
# gateway_upstream_unavailable_total's reasons: why a request was answered 503 without going upstream.
NO_TARGET = "no_target"
QUEUE_FULL = "queue_full"
TARGET_HEALTHY = "gateway_upstream_target_healthy"
TARGET_METRICS = "gateway_upstream_target_"  # the families labelled by pool target
# From a same-host Redis (~0.1 ms) up past the largest sensible store.timeout.
LIMITER_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5)
# From a fraction of a token's refill up to the longest max_delay (60 s).
DELAY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
UPSTREAM_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


# status // 100 -> its label; HTTP status codes have three digits.
STATUS_CLASSES = tuple(f"{digit}xx" for digit in range(10))


class CounterValue:
    """One counter series: `inc` adds, with no lock (see the module docstring)."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value: float = 0
        self.created = time.time()  # its _created sample, as prometheus_client stamps a child

    def inc(self, amount: float = 1) -> None:
        self.value += amount


class GaugeValue:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: float = 0

    def inc(self, amount: float = 1) -> None:
        self.value += amount

    def dec(self, amount: float = 1) -> None:
        self.value -= amount


class HistogramValue:
    """One histogram series: a count per bucket, summed into cumulative buckets only at scrape time."""

    __slots__ = ("_bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0
        self.created = time.time()

    @property
    def bounds(self) -> tuple[float, ...]:
        """Each bucket's upper bound, +Inf last."""
        return self._bounds

    def observe(self, amount: float) -> None:
        # The first bound at or above `amount`, as prometheus_client files it; the last is +Inf.
        self.counts[bisect_left(self._bounds, amount)] += 1
        self.sum += amount


def _use_created() -> bool:
    """Whether `_created` samples are exported: prometheus_client's own switch, which
    PROMETHEUS_DISABLE_CREATED_SERIES sets at import and disable_created_metrics() turns
    off, so the plain numbers drop them exactly when its Counters and Histograms do."""
    return bool(prometheus_metrics._use_created)


class PlainMetric(abc.ABC):
    """A metric family of plain values by label values, read by `collect` at scrape time.
    Binds children as prometheus_client's metrics do (`labels`, `remove`), so `Children`
    and the plans hold either kind alike."""

    __slots__ = ("_values", "documentation", "labelnames", "name")

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._values: dict[tuple[str, ...], Any] = {}
        if not self.labelnames:
            self._values[()] = self._new_value()  # shown from the start, as prometheus_client shows one

    @abc.abstractmethod
    def _new_value(self) -> Any:
        """A fresh value of this kind, at 0."""

    def labels(self, **labels: str) -> Any:
        """The value of these label values, made at 0 on first use."""
        if labels.keys() != set(self.labelnames):
            raise ValueError(f"{self.name}: labels {sorted(labels)}, expected {sorted(self.labelnames)}")
        key = tuple(str(labels[name]) for name in self.labelnames)
        value = self._values.get(key)
        if value is None:
            value = self._values[key] = self._new_value()
        return value

    def remove(self, *values: str) -> None:
        """Drop the series of these label values (in `labelnames` order); KeyError if never bound."""
        del self._values[values]

    @abc.abstractmethod
    def collect(self) -> Iterator[Metric]:
        """This family with every bound series, as prometheus_client's collectors yield it."""


class PlainCounter(PlainMetric):
    __slots__ = ()

    def _new_value(self) -> CounterValue:
        return CounterValue()

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for key, counter in self._values.items():
            family.add_metric(key, counter.value, created=counter.created if _use_created() else None)
        yield family


class PlainGauge(PlainMetric):
    __slots__ = ()

    def _new_value(self) -> GaugeValue:
        return GaugeValue()

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for key, gauge in self._values.items():
            family.add_metric(key, gauge.value)
        yield family


class PlainHistogram(PlainMetric):
    __slots__ = ("_bounds", "_le")

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (), *, buckets: Sequence[float]) -> None:
        self._bounds = (*buckets, INF)
        self._le = tuple(floatToGoString(bound) for bound in self._bounds)  # the `le` labels
        super().__init__(name, documentation, labelnames)

    def _new_value(self) -> HistogramValue:
        return HistogramValue(self._bounds)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for key, histogram in self._values.items():
            cumulative, buckets = 0, []
            for le, count in zip(self._le, histogram.counts):
                cumulative += count
                buckets.append((le, cumulative))
            family.add_metric(key, buckets, histogram.sum)
            if _use_created():
                family.samples.append(Sample(self.name + "_created", dict(zip(self.labelnames, key)), histogram.created))
        yield family


class Children:
    """The children of one labelled metric for some fixed labels (a route, a limit), each
    bound on first use and kept.

    `labels()` checks the names and looks the child up (prometheus_client's under a lock,
    about 3 µs a call); a kept child is one dict hit away. The label sets the config
    makes known (each limit's decisions, each route's reasons, each target's error kinds)
    are bound up front (`export`); the others on first use, so /metrics is not every
    method by every status class. Callers pass values from a bounded set (gateway.identity.methods.method_label,
    STATUS_CLASSES, decision outcomes), so the dict stays small."""

    __slots__ = ("_bound", "_fixed", "_metric", "_names")

    def __init__(self, metric: PlainMetric | MetricWrapperBase, names: tuple[str, ...] = (), **fixed: str) -> None:
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

    def export(self, *label_sets: tuple[str, ...]) -> Children:
        """Bind these label sets now, so /metrics shows them at 0 before anything is
        counted: a dashboard then reads 0, not "no data", for what has not happened."""
        for values in label_sets:
            self(*values)
        return self


class _Exposed:
    """The registry's one collector: every metric of a `Metrics`, in the order declared."""

    def __init__(self) -> None:
        self.metrics: list[Any] = []  # PlainMetric or prometheus_client metrics, each a collector

    def collect(self) -> Iterator[Metric]:
        for metric in self.metrics:
            yield from metric.collect()


class Metrics:
    def __init__(self, *, multiprocess: bool = False) -> None:
        # Each gateway has its own registry, so several can run in one process (tests, gateway.testing).
        self.registry = CollectorRegistry(auto_describe=True)
        self.multiprocess = multiprocess  # several workers: every count lives in the workers' files
        self._exposed = _Exposed()
        # The request path's metrics: plain in one process, prometheus_client's files with several.
        counter: Callable[..., Any] = Counter if multiprocess else PlainCounter
        gauge: Callable[..., Any] = Gauge if multiprocess else PlainGauge
        histogram: Callable[..., Any] = Histogram if multiprocess else PlainHistogram
        # prometheus_client's own metrics go in no registry: `_exposed` collects them in order.
        files: dict[str, Any] = {"registry": None} if multiprocess else {}
        summed = {**files, "multiprocess_mode": "livesum"} if multiprocess else {}
        add = self._add
        self.requests = add(counter(
            "gateway_requests", "Requests answered, by route, method and status class.",
            ["route", "method", "status_class"], **files,
        ))
        self.decisions = add(counter(
            "gateway_limiter_decisions", "Limiter decisions, by route, limit and decision.",
            ["route", "limit", "decision"], **files,
        ))
        self.cost = add(counter(
            "gateway_limiter_cost",
            "Units charged to rate limits by admitted requests, by route and limit: a fixed cost when the request is "
            "admitted, a cost the response says when it is settled (its reservation, if the settlement was lost).",
            ["route", "limit"], **files,
        ))
        self.settlements = add(counter(
            "gateway_limiter_settlements",
            "Costs the response said, by outcome: settled, retried (settled once the store was reachable again), "
            "lost (never sent within the retry bound), unconfirmed (sent, not answered, not sent again).",
            ["outcome"], **files,
        ))
        # Envoy's rate-limit service: its domains are the config's, so the labels stay bounded.
        self.rls_descriptors = add(counter(
            "gateway_rls_descriptors",
            "Descriptors Envoy's rate-limit service answered, by domain (`unknown` for one the config lacks) and decision "
            "(the limiter's, or `unmatched` for a descriptor without a rate limit).",
            ["domain", "decision"], **files,
        ))
        self.rls_shed = add(counter(
            "gateway_rls_shed",
            "RPCs of Envoy's rate-limit service answered by their rules' failure policies, the store unasked, because "
            "max_in_flight were already in flight.",
            **files,
        ))
        self.decision_requests = add(counter(
            "gateway_decision_requests",
            "Questions answered on the decision listener, by the proxy's mode (nginx, traefik, envoy) and the gateway's "
            "status (nginx is sent 403 for a 429 and 401 for a 503).",
            ["mode", "status"], **files,
        ))
        self.decision_concurrency_skipped = add(counter(
            "gateway_decision_concurrency_skipped",
            "Concurrency limits not taken for a request allowed on the decision listener, by route and limit.",
            ["route", "limit"], **files,
        ))
        self.limiter_latency = add(histogram(
            "gateway_limiter_latency_seconds", "Time to decide a request's rate and concurrency limits, store calls included.",
            buckets=LIMITER_BUCKETS, **files,
        ))
        self.delay = add(histogram(
            "gateway_limiter_delay_seconds", "Time requests admitted by a mode: delay limit waited before going on.",
            buckets=DELAY_BUCKETS, **files,
        ))
        self.upstream_latency = add(histogram(
            "gateway_upstream_latency_seconds", "Time from sending upstream to the response headers, by route.",
            ["route"], buckets=UPSTREAM_BUCKETS, **files,
        ))
        self.client_closed = add(counter(
            "gateway_client_closed_requests",
            "Requests whose client closed the connection before the answer (logged as 499; also in gateway_requests_total as 4xx).",
            ["route"], **files,
        ))
        # Pool targets are labelled by their configured name (default: host:port), so the
        # label sets are bounded by the config.
        self.target_requests = add(counter(
            "gateway_upstream_target_requests", "Attempts sent to each pool target, retries included.",
            ["target"], **files,
        ))
        self.target_errors = add(counter(
            "gateway_upstream_target_errors",
            "Failed attempts on each pool target, by kind: connect, reset, timeout, 5xx.",
            ["target", "kind"], **files,
        ))
        self.target_latency = add(histogram(
            "gateway_upstream_target_latency_seconds", "Time from sending to a pool target to its response headers.",
            ["target"], buckets=UPSTREAM_BUCKETS, **files,
        ))
        self._checked_targets: frozenset[str] = frozenset()  # see show_targets
        self._named_targets: frozenset[str] = frozenset()  # see keep_targets
        self._named_routes: frozenset[str] | None = None  # see keep_routes; None: not told yet
        self._named_limits: frozenset[str] | None = None
        self.target_healthy = add(Gauge(
            TARGET_HEALTHY,
            "Worker processes whose active health checks see each checked pool target healthy.",
            ["target"], registry=None, multiprocess_mode="livesum",
        ))
        self.target_ejections = add(counter(
            "gateway_upstream_target_ejections",
            "Times each pool target was taken out of rotation for eject_for after consecutive failures.",
            ["target"], **files,
        ))
        self.retries = add(counter(
            "gateway_upstream_retries", "Attempts sent to another pool target after a connect failure, by route.",
            ["route"], **files,
        ))
        # Envoy counts these as upstream_cx_none_healthy and upstream_rq_pending_overflow.
        self.upstream_unavailable = add(counter(
            "gateway_upstream_unavailable",
            "Requests answered 503 without being sent upstream, by route and reason: no_target "
            "(no pool target in rotation) or queue_full (no upstream connection came free within timeout.queue).",
            ["route", "reason"], **files,
        ))
        self.shed = add(counter(
            "gateway_requests_shed", "Requests answered 503 at once because max_in_flight were already in flight.",
            **files,
        ))
        self.local_store_evictions = add(counter(
            "gateway_local_store_evictions",
            "Buckets the in-process store evicted before they had refilled, to make room within local_store_memory: "
            "each such client starts again from a full bucket.",
            **files,
        ))
        self.in_flight = add(gauge("gateway_requests_in_flight", "Requests being handled now.", **summed))
        self.store_breaker = add(Gauge(
            "gateway_store_breaker", "Worker processes whose store circuit breaker is in each state (closed, open, half_open).",
            ["state"], registry=None, multiprocess_mode="livesum",
        ))
        build = add(Gauge(
            "gateway_build_info", "The running gateway's version.", ["version"], registry=None, multiprocess_mode="max"
        ))
        build.labels(version=__version__).set(1)
        self.concurrency_in_flight = add(gauge(
            "gateway_concurrency_in_flight", "Requests in flight admitted by each concurrency limit, summed over workers.",
            ["limit"], **summed,
        ))
        self.lease_release_failures = add(Counter(
            "gateway_concurrency_lease_release_failures",
            "Concurrency leases whose release kept failing (the store was down) until they expired with their lease_ttl.",
            registry=None,
        ))
        self.access_log_dropped = add(Counter(
            "gateway_access_log_dropped",
            "Access log lines dropped because stdout did not take them: the queue of lines waiting was full "
            "(gateway.proxy.access_log.QUEUE_LINES) or a write failed.",
            registry=None,
        ))
        self.log_lines_dropped = add(Counter(
            "gateway_log_lines_dropped",
            "Lines of the gateway's own log dropped because stderr did not take them: the queue of lines waiting "
            "was full (gateway.log_lines.STDERR_QUEUE_LINES) or a write failed.",
            registry=None,
        ))
        self.reload_failures = add(reload_failures_counter(None))
        self.reload_success = add(Gauge(
            "gateway_config_last_reload_success_timestamp", "Unix time of the last config reload that took effect (0: none yet).",
            registry=None, multiprocess_mode="max",
        ))
        self.registry.register(self._exposed)

    def _add(self, metric: Any) -> Any:
        """`metric`, exposed after those added before it; an unlabelled plain one is given
        as its one value, which callers count on directly."""
        self._exposed.metrics.append(metric)
        if isinstance(metric, PlainMetric) and not metric.labelnames:
            return metric.labels()
        return metric

    def show_targets(self, names: frozenset[str]) -> None:
        """The pool targets health checks run for now (gateway.upstream.health_checks), whose
        gateway_upstream_target_healthy /metrics shows. With several workers a gauge's child
        cannot be removed: prometheus_client keeps its last value in the workers' files, so a
        target a reload renamed or dropped would be shown (at 0: out of rotation) until the
        next restart. It is left out of the exposition instead."""
        self._checked_targets = names

    def keep_targets(self, names: frozenset[str]) -> None:
        """The pool targets the config names now, at start and on each reload. The children
        of a target no longer named leave the registry, so a fleet whose targets change on
        every deploy does not add a series per target it ever had. With several workers, where a
        child cannot be removed (see show_targets), they are left out of the exposition."""
        for name in self._named_targets - names:
            for metric in (self.target_requests, self.target_latency, self.target_ejections):
                with contextlib.suppress(KeyError):  # never bound
                    metric.remove(name)
            kinds = {s.labels["kind"] for f in self.target_errors.collect() for s in f.samples if s.labels["target"] == name}
            for kind in kinds:
                self.target_errors.remove(name, kind)
        self._named_targets = names

    def keep_routes(self, routes: frozenset[str], limits: frozenset[str]) -> None:
        """The routes (by label) and limits the config names now, at start and on each
        reload: the series of a route or limit a reload removed leave /metrics, as a
        target's do (see keep_targets), so a config's series stay those it exports at 0."""
        self._named_routes = routes | {UNMATCHED_ROUTE}
        self._named_limits = limits
        for metric in self._exposed.metrics:
            if not isinstance(metric, PlainMetric):
                continue  # prometheus_client's: left out of the exposition (_CurrentConfigOnly)
            for key in [key for key in metric._values if not self._named(dict(zip(metric.labelnames, key)))]:
                metric.remove(*key)

    def _named(self, labels: Mapping[str, str]) -> bool:
        """Whether a series' route and limit, if it has them, are in the config now."""
        route, limit = labels.get("route"), labels.get("limit")
        if route is not None and self._named_routes is not None and route not in self._named_routes:
            return False
        return limit is None or self._named_limits is None or limit in self._named_limits

    def exposition_registry(self) -> CollectorRegistry:
        """What /metrics serves: this process's registry, or every worker's when there are several."""
        if not self.multiprocess:
            return self.registry
        combined = CollectorRegistry()
        combined.register(_CurrentConfigOnly(MultiProcessCollector(None), self))
        return combined


class _CurrentConfigOnly:
    """The workers' metrics, with the pool target families only for the targets named now,
    gateway_upstream_target_healthy only for those checked now, and the series of routes
    and limits only for those the config names now."""

    def __init__(self, source: MultiProcessCollector, metrics: Metrics) -> None:
        self._source = source
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        for family in self._source.collect():
            if family.name.startswith(TARGET_METRICS):
                shown = self._metrics._checked_targets if family.name == TARGET_HEALTHY else self._metrics._named_targets
                family.samples = [s for s in family.samples if s.labels.get("target") in shown]
            family.samples = [s for s in family.samples if self._metrics._named(s.labels)]
            yield family


def reload_failures_counter(registry: CollectorRegistry | None) -> Counter:
    """gateway_config_reload_failures_total: a worker's, or with several workers the supervisor's,
    which checks each reload once for all of them (gateway.server)."""
    return Counter(
        "gateway_config_reload_failures", "Config reloads refused because the new file was invalid; the old config serves on.",
        registry=registry,
    )


def breaker_gauge_setter(gauge: Gauge) -> Callable[[BreakerState], None]:
    """Keep `gateway_store_breaker` at 1 for the breaker's state and 0 for the others."""
    children = {state: gauge.labels(state=state.value) for state in BreakerState}

    def set_state(current: BreakerState) -> None:
        for state, child in children.items():
            child.set(1 if state is current else 0)

    return set_state

