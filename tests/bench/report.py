"""The benchmark's report: medians over the rounds, ratios, the targets
beside what was measured, and the machine, as markdown docs/performance.md can quote."""

from __future__ import annotations

import math
import os
import platform
import statistics
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tests.bench.install import REPO_ROOT
from tests.bench.latency import HTTPERF_BIN_MS, LatencyRun
from tests.bench.store_checks import StoreRun
from tests.bench.streaming import GIB, Transfer
from tests.bench.throughput import RLS_CHANNELS, RLS_IN_FLIGHT_PER_CHANNEL, TRAEFIK_PATH, ThroughputRun
from tests.bench.variants import Variant

# The bound set on what streaming a body may add to the gateway's RSS, each way.
RSS_GROWTH_LIMIT = 64 * 1000 * 1000
QUICK_NOTE = " (scaled down by --quick; the target is for 1 GiB)"
_MOVED = {"download": "downloaded", "upload": "uploaded"}


@dataclass(frozen=True)
class Settings:
    rounds: int
    duration: int
    connections: int
    threads: int
    latency_rate: float
    latency_share: float  # latency_rate as a share of (a)'s median throughput
    stream_bytes: int  # moved each way in the streaming phase


@dataclass(frozen=True)
class Results:
    variants: Sequence[Variant]
    throughput: Mapping[str, Sequence[ThroughputRun]]
    # gateway_limiter_decisions_total by decision, per gateway variant, after the throughput rounds
    decisions: Mapping[str, Mapping[str, int]]
    latency: Mapping[str, Sequence[LatencyRun]]
    store_titles: Sequence[tuple[str, str]]
    store: Mapping[str, Sequence[StoreRun]]
    streaming: Sequence[Transfer]
    event_loop: str
    # The 1-minute load average before the run, from other work alone: the largest source
    # of noise, and this says how much there was. (Later values would include the run itself.)
    load_average_before: float


@dataclass(frozen=True)
class Target:
    text: str
    measured: str
    goal: str
    met: bool


def machine_line(event_loop: str) -> str:
    return (
        f"{len(os.sched_getaffinity(0))} CPUs (nproc), {cpu_model()}, Linux {platform.release()}, "
        f"Python {platform.python_version()}, gateway event loop: {event_loop}"
    )


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def code_version() -> str:
    """The commit measured, marked when gateway/ or lua/ differ from it."""
    def git(*args: str) -> str:
        result = subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True)
        return result.stdout.strip() if result.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown commit"
    changed = git("status", "--porcelain", "--", "gateway", "lua")
    return f"{commit} with uncommitted changes in gateway/ or lua/" if changed else commit


def median_rate(runs: Sequence[ThroughputRun]) -> float:
    return statistics.median(run.wrk.requests_per_second for run in runs)


def _number(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:,.0f}"


def _ms(value: float) -> str:
    return "n/a" if math.isnan(value) else ("∞" if math.isinf(value) else f"{value:.2f} ms")


def _per_request(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.3f}"


def _ratio(value: float) -> str:
    return "n/a" if math.isnan(value) or math.isinf(value) else f"{value:.2f}×"


def _divide(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else math.nan


def _bin(lower_edge: float) -> str:
    if math.isnan(lower_edge):
        return "n/a"
    return f"{lower_edge:g}–{lower_edge + HTTPERF_BIN_MS:g} ms"


def throughput_table(results: Results) -> list[str]:
    baseline = median_rate(results.throughput["a"])
    lines = [
        "| variant | what | req/s (median) | min–max | × (a) | Redis script calls / request "
        "| fail_open / limiter decisions | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for variant in results.variants:
        if variant.decides:
            continue  # in decision_table
        runs = results.throughput[variant.key]
        rates = [run.wrk.requests_per_second for run in runs]
        calls = script_calls_per_request(runs)
        # For the flood, non-2xx answers (429) are the point, not errors.
        errors = sum(run.wrk.socket_errors + (0 if variant.flood else run.wrk.non_success) for run in runs)
        lines.append(
            f"| ({variant.key}) | {variant.title} | {_number(median_rate(runs))} | "
            f"{_number(min(rates))}–{_number(max(rates))} | {_ratio(_divide(median_rate(runs), baseline))} | "
            f"{_per_request(calls)} | {_fail_open_share(results.decisions.get(variant.key))} | {errors} |"
        )
    return lines


def decision_table(results: Results) -> list[str]:
    """The decision services beside the proxy: each decision against its own server's floor,
    asked the same questions in the same rounds, against (b)'s request, limited the same way,
    and against (g), the ceiling of a proxy in Python."""
    limited, ceiling = (median_rate(results.throughput[key]) if key in results.throughput else math.nan for key in ("b", "g"))
    lines = [
        "| variant | what | decisions/s (median) | min–max | × its floor | × (b) | × (g) "
        "| Redis script calls / decision | fail_open / limiter decisions | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for variant in results.variants:
        if not variant.decides:
            continue
        runs = results.throughput[variant.key]
        rates = [run.wrk.requests_per_second for run in runs]
        median = median_rate(runs)
        floor = _floor_ratio(results, variant)
        calls = script_calls_per_request(runs)
        # Every decision is an allow: a refusal (a non-2xx, or an RLS answer not OK) is an error here.
        errors = sum(run.wrk.socket_errors + run.wrk.non_success for run in runs)
        lines.append(
            f"| ({variant.key}) | {variant.title} | {_number(median)} | {_number(min(rates))}–{_number(max(rates))} | "
            f"{floor} | {_ratio(_divide(median, limited))} | {_ratio(_divide(median, ceiling))} | {_per_request(calls)} | "
            f"{_fail_open_share(results.decisions.get(variant.key))} | {errors} |"
        )
    return lines


def _floor_ratio(results: Results, variant: Variant) -> str:
    if variant.floor is None:
        return "—"
    floor = results.throughput.get(variant.floor)
    value = _divide(median_rate(results.throughput[variant.key]), median_rate(floor)) if floor else math.nan
    return f"{_ratio(value)} ({variant.floor})"


def script_calls_per_request(runs: Sequence[ThroughputRun]) -> float:
    """Redis script calls over the runs, per request (or RLS decision) served."""
    return _divide(sum(run.script_calls for run in runs), sum(run.wrk.requests for run in runs))


def _fail_open_share(decisions: Mapping[str, int] | None) -> str:
    """How many limiter decisions were the store failing and the request let through, of all."""
    if not decisions:
        return "—"
    return f"{decisions.get('fail_open', 0):,} / {sum(decisions.values()):,}"


def flood_line(results: Results) -> str:
    runs = results.throughput["c"]
    decisions = results.decisions.get("c", {})
    denied = sum(run.wrk.non_success for run in runs)
    calls = _divide(sum(run.script_calls for run in runs), denied)
    return (
        f"Flood (c), over the whole run: allowed {decisions.get('allow', 0)}, denied (429) in the rounds {denied:,}, "
        f"fail_open {decisions.get('fail_open', 0)}, Redis script calls per denied request {_per_request(calls)}."
    )


def latency_table(results: Results) -> list[str]:
    baseline_p99 = _median_of(results.latency["a"], lambda run: run.open_loop.p99_ms)
    lines = [
        "| variant | open-loop p50 | open-loop p99 | p99 added vs (a) | client's scheduler lag p99 "
        "| waited for a connection | httperf p50 (1 ms bin) | httperf p99 (1 ms bin) | unanswered / httperf errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, runs in results.latency.items():
        p99 = _median_of(runs, lambda run: run.open_loop.p99_ms)
        added = "—" if key == "a" else _ms(p99 - baseline_p99)
        failures = sum(run.open_loop.unanswered + run.open_loop.non_2xx for run in runs)
        httperf_errors = sum(run.httperf.errors for run in runs)
        lines.append(
            f"| ({key}) | {_ms(_median_of(runs, lambda run: run.open_loop.p50_ms))} | {_ms(p99)} | {added} | "
            f"{_ms(_median_of(runs, lambda run: run.open_loop.dispatch_lag_p99_ms))} | "
            f"{sum(run.open_loop.waited_for_connection for run in runs)} | "
            f"{_bin(_median_of(runs, lambda run: run.httperf.p50_bin_ms))} | "
            f"{_bin(_median_of(runs, lambda run: run.httperf.p99_bin_ms))} | {failures} / {httperf_errors} |"
        )
    return lines


def _median_of(runs: Sequence[LatencyRun], value) -> float:
    values = [value(run) for run in runs]
    return statistics.median(values) if values else math.nan


def store_table(results: Results) -> list[str]:
    baseline = statistics.median(run.checks_per_second for run in results.store["evalsha"])
    lines = [
        "| store | checks/s (median) | min–max | × redis-py EVALSHA | failed checks |",
        "|---|---:|---:|---:|---:|",
    ]
    for key, title in results.store_titles:
        rates = [run.checks_per_second for run in results.store[key]]
        median = statistics.median(rates)
        failed = sum(run.failed for run in results.store[key])
        lines.append(
            f"| {title} | {_number(median)} | {_number(min(rates))}–{_number(max(rates))} | "
            f"{_ratio(_divide(median, baseline))} | {failed} |"
        )
    return lines


def streaming_table(results: Results) -> list[str]:
    lines = [
        "| transfer | bytes | seconds | MB/s | gateway RSS before | peak during | growth |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for t in results.streaming:
        lines.append(
            f"| {t.direction} | {_size(t.size)} | {t.seconds:.1f} | {t.size / t.seconds / 1e6:,.0f} | "
            f"{_mb(t.rss_before)} | {_mb(t.rss_peak)} | {_mb(t.growth)} |"
        )
    return lines


def _size(size: int) -> str:
    return f"{size / GIB:g} GiB" if size >= GIB else f"{size >> 20} MiB"


def _mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


def targets(results: Results, settings: Settings) -> list[Target]:
    """The targets, each from this run alone."""
    rate = {key: median_rate(runs) for key, runs in results.throughput.items()}
    p99 = {key: _median_of(runs, lambda run: run.open_loop.p99_ms) for key, runs in results.latency.items()}
    added = p99["b"] - p99["a"]
    store = {key: statistics.median(r.checks_per_second for r in runs) for key, runs in results.store.items()}
    store_over_evalsha = _divide(store["store"], store["evalsha"])

    def ratio(text: str, numerator: str, denominator: str, at_least: float) -> Target:
        value = _divide(rate[numerator], rate[denominator])
        return Target(text, _ratio(value), f"≥ {at_least:.2f}", value >= at_least)

    # In a --quick run the volume is smaller than the target's 1 GiB, and the row says so.
    volume = _size(settings.stream_bytes)
    streaming = [
        Target(
            f"{volume} {_MOVED[t.direction]} through the gateway: RSS growth", _mb(t.growth), f"≤ {_mb(RSS_GROWTH_LIMIT)}",
            t.growth <= RSS_GROWTH_LIMIT,
        )
        for t in results.streaming
    ]
    rls_calls = script_calls_per_request(results.throughput["j"])
    return [
        ratio("(a) the gateway without limits ÷ (f) the naive aiohttp proxy", "a", "f", 2.5),
        ratio("(a) ÷ (g) the ceiling", "a", "g", 0.60),
        ratio("(b) a Redis limit, 10,000 clients, all allowed ÷ (a)", "b", "a", 0.85),
        ratio("(c) one client flooding ÷ (h) the floor of a denial", "c", "h", 0.60),
        ratio("(i) the decision listener ÷ (i-floor), its floor", "i", "i-floor", 0.50),
        ratio("(j) the RLS ÷ (j-floor), grpc.aio's floor", "j", "j-floor", 0.75),
        # A NaN (no decision counted) is missed, as every comparison with it is false.
        Target("Redis script calls per RLS decision, (j) at the throughput phase's load", _per_request(rls_calls),
               "≤ 0.2", rls_calls <= 0.2),
        Target("p99 added by limiting, (b) − (a), at the latency phase's rate, open loop", _ms(added), "≤ 1 ms", added <= 1.0),
        Target("store checks/s ÷ redis-py per-call EVALSHA, 200 in flight", _ratio(store_over_evalsha), "≥ 4.00",
               store_over_evalsha >= 4.0),
        *streaming,
    ]


def _rounds(count: int) -> str:
    return f"{count} round" if count == 1 else f"{count} rounds"


def render(results: Results, settings: Settings) -> str:
    lines = [
        "## Benchmark results",
        "",
        f"- Machine: {machine_line(results.event_loop)}",
        f"- Load average (1 min) before the run, from other work: {results.load_average_before:.2f}",
        "- Redis: a private redis-server at real-time CPU priority, standing in for a host of its own",
        f"- Code: {code_version()}",
        f"- Throughput: wrk -t{settings.threads} -c{settings.connections}, {_rounds(settings.rounds)} × "
        f"{settings.duration} s per variant, variants interleaved in each round; medians over the rounds",
        f"- Decisions: in the same rounds, (i) and its floor by the same wrk at {TRAEFIK_PATH}, (j) and its floor by "
        f"{RLS_CHANNELS} grpc.aio channels × {RLS_IN_FLIGHT_PER_CHANNEL} calls in flight from one process; "
        "medians over the rounds",
        f"- Latency: a fixed {settings.latency_rate:,.0f} req/s ({settings.latency_share:.0%} of (a)'s median), {_rounds(settings.rounds)} × "
        f"{settings.duration} s; medians of each round's percentiles",
        "",
        "### Throughput",
        "",
        *throughput_table(results),
        "",
        flood_line(results),
        "",
        "### Decisions per second, beside the proxy (nothing forwarded)",
        "",
        *decision_table(results),
        "",
        "### Latency at a fixed request rate (no coordinated omission)",
        "",
        *latency_table(results),
        "",
        "### Store checks per second (200 in flight from one process, no HTTP)",
        "",
        *store_table(results),
        "",
        f"### Streaming: {_size(settings.stream_bytes)} each way through a gateway without limits"
        f"{QUICK_NOTE if settings.stream_bytes < GIB else ''}",
        "",
        *streaming_table(results),
        "",
        "### Targets",
        "",
        "| measure | measured | target | met |",
        "|---|---:|---:|:---:|",
        *(f"| {t.text} | {t.measured} | {t.goal} | {'met' if t.met else 'missed'} |" for t in targets(results, settings)),
    ]
    return "\n".join(lines) + "\n"
