"""GET /stats: the routes and limits served now, the pool targets with their routes, and
the gateway's counter totals, for the admin page, which computes rates from the change
between polls.

The totals are read from the metric objects `Metrics` keeps, never looked up by name
strings: in one process each object holds every count. With several workers an object
holds only its own worker's counts, so its family is read from the workers' summed
files instead, found by the object's own name; a counter is then summed over the
workers, and a target's health gauge counts the workers that see it healthy. Trusts
its caller: app.py mounts it behind the Host check and the bearer token.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric

from gateway import __version__
from gateway.config.model import GatewayConfig, Route
from gateway.config.pool_model import UpstreamPool
from gateway.config.redaction import redacted_url
from gateway.metrics import CounterValue, GaugeValue, HistogramValue, Metrics, PlainMetric

# A metric's series: each one's labels and value.
Series = list[tuple[dict[str, str], float]]


class Totals:
    """The series of the metrics /stats shows, as they stand at one moment."""

    def __init__(self, metrics: Metrics) -> None:
        registry = metrics.exposition_registry()
        # The workers' files are read once a request, however many metrics are shown.
        self._summed = {family.name: family for family in registry.collect()} if metrics.multiprocess else None

    def of(self, metric: PlainMetric | MetricWrapperBase | CounterValue | GaugeValue) -> Series:
        if isinstance(metric, (CounterValue, GaugeValue)):  # an unlabelled plain metric: its one series
            return [({}, metric.value)]
        return [series for family in self._families(metric) for series in _values(family)]

    def histogram(self, metric: HistogramValue | MetricWrapperBase) -> dict[str, Any]:
        """An unlabelled histogram's cumulative counts at its finite bounds, its count and its sum:
        the page takes quantiles and means from their change between two polls."""
        if isinstance(metric, HistogramValue):
            cumulative = list(itertools.accumulate(metric.counts))
            finite = [[bound, count] for bound, count in zip(metric.bounds[:-1], cumulative)]
            return {"buckets": finite, "count": cumulative[-1], "sum": metric.sum}
        families = self._families(metric)
        samples = [sample for family in families for sample in family.samples]
        buckets = [
            [float(sample.labels["le"]), _number(sample.value)]
            for sample in samples
            if sample.name.endswith("_bucket") and sample.labels["le"] != "+Inf"
        ]
        count = sum(sample.value for sample in samples if sample.name.endswith("_count"))
        total = sum(sample.value for sample in samples if sample.name.endswith("_sum"))
        return {"buckets": buckets, "count": _number(count), "sum": total}

    def _families(self, metric: PlainMetric | MetricWrapperBase) -> list[Metric]:
        if self._summed is None:
            return list(metric.collect())
        assert isinstance(metric, MetricWrapperBase)  # several workers: every metric is prometheus_client's
        found = self._summed.get(next(iter(metric.describe())).name)
        return [] if found is None else [found]


def _values(family: Metric) -> Iterator[tuple[dict[str, str], float]]:
    # A counter's family carries `_created` samples beside its counts, which are `_total`.
    counted = family.name + "_total" if family.type == "counter" else family.name
    for sample in family.samples:
        if sample.name == counted:
            yield dict(sample.labels), sample.value


def stats(config: GatewayConfig, metrics: Metrics) -> dict[str, Any]:
    """What /stats answers: the routes and limits served now, and the counters' totals."""
    totals = Totals(metrics)

    def rows(metric: Any, *labels: str) -> list[dict[str, Any]]:
        return [
            {**{label: found.get(label, "") for label in labels}, "total": _number(total)}
            for found, total in totals.of(metric)
        ]

    def single(metric: Any) -> float | int:
        return _number(sum(total for _, total in totals.of(metric)))

    return {
        "time": time.time(),
        "version": __version__,
        "routes": [
            {
                "route": route.label,
                "upstream": _upstream_text(route.upstream),
                "limits": [{"name": rl.limit.name, "cost": rl.cost} for rl in route.limits]
                + [{"name": limit.name, "cost": 1} for limit in route.concurrency],  # one lease a request
            }
            for route in config.routes
        ],
        "limits": [
            {
                "name": limit.name,
                "rate": limit.rate.text,
                "burst": _number(limit.burst),
                "key": [str(source) for source in limit.key],
                "on_store_error": limit.on_store_error.value,
                "shadow": limit.shadow,
            }
            for limit in config.limits
        ]
        + [
            {
                "name": limit.name,
                "concurrency": limit.concurrency,
                "key": [str(source) for source in limit.key],
                "on_store_error": limit.on_store_error.value,
            }
            for limit in config.concurrency_limits
        ],
        "targets": _pool_targets(config.routes, metrics, totals),
        "workers": config.workers,
        "requests": rows(metrics.requests, "route", "method", "status_class"),
        "decisions": rows(metrics.decisions, "route", "limit", "decision"),
        "in_flight": single(metrics.in_flight),
        "shed": single(metrics.shed),
        # 503s for want of a target in rotation or of a free upstream connection.
        "unavailable": rows(metrics.upstream_unavailable, "route", "reason"),
        # Worker processes in each state: one, with one worker.
        # The time to decide a request's limits, the store's round trips included.
        "limiter_latency": totals.histogram(metrics.limiter_latency),
        "breaker": {found["state"]: _number(count) for found, count in totals.of(metrics.store_breaker)},
        "reload": {
            "failures": single(metrics.reload_failures),
            "last_success": single(metrics.reload_success) or None,
        },
    }


def _number(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


def _pool_targets(routes: tuple[Route, ...], metrics: Metrics, totals: Totals) -> list[dict[str, Any]]:
    """Each pool target of `routes`, once however many routes name it (a target has one name),
    with its counters. `healthy` is the workers whose health checks see it healthy: null for a
    target no pool checks, or before its first check."""

    def by_target(metric: Any) -> dict[str, Series]:
        found: dict[str, Series] = {}
        for labels, total in totals.of(metric):
            found.setdefault(labels.get("target", ""), []).append((labels, total))
        return found

    healthy = by_target(metrics.target_healthy)
    requests = by_target(metrics.target_requests)
    errors = by_target(metrics.target_errors)
    ejections = by_target(metrics.target_ejections)
    targets: dict[str, dict[str, Any]] = {}
    for route in routes:
        if not isinstance(route.upstream, UpstreamPool):
            continue
        for target in route.upstream.targets:
            name = target.name
            shown = targets.get(name)
            if shown is None:
                shown = targets[name] = {
                    "target": name,
                    "url": redacted_url(target.url),
                    "routes": [],
                    "checked": False,
                    "requests": _number(sum(total for _, total in requests.get(name, []))),
                    "errors": {labels["kind"]: _number(total) for labels, total in errors.get(name, [])},
                    "ejections": _number(sum(total for _, total in ejections.get(name, []))),
                }
            if route.label not in shown["routes"]:
                shown["routes"].append(route.label)
            shown["checked"] = shown["checked"] or route.upstream.health is not None
    for name, shown in targets.items():
        seen = healthy.get(name) if shown["checked"] else None
        shown["healthy"] = None if seen is None else _number(sum(total for _, total in seen))
    return list(targets.values())


def _upstream_text(upstream: str | UpstreamPool) -> str:
    """A route's upstream as the admin page shows it: the URL, or a pool's target URLs."""
    if isinstance(upstream, UpstreamPool):
        return ", ".join(redacted_url(target.url) for target in upstream.targets)
    return redacted_url(upstream)
