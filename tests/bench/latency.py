"""Latency at a fixed request rate (half of what the gateway sustains), measured
two ways, both free of coordinated omission because requests leave on a schedule
rather than when the previous one returns.

httperf, the tool first asked for: with `--rate R --num-calls 1` it opens a new
connection every 1/R seconds however the server fares, and times each
connection from its connect() to its close. It keeps those times only in a
histogram of 1 ms bins (`src/stat/basic.c`: BIN_WIDTH 1e-3), printed with `-v -v`
("Connection lifetime histogram"); its "median" comes from the same bins, and no
option or output (`--print-reply` prints bytes, not times) gives finer ones. So
from httperf we read p50 and p99 as the 1 ms bin they fall in. That cannot
check a target of "p99 added ≤ 1 ms", so the open-loop client (`open_loop`)
runs the same schedule over keep-alive connections and keeps every latency.

httperf also busy-polls, taking a whole core for itself at any rate; on a
2-core machine the server under test then shares the other core with Redis and
nginx. Its numbers are for cross-checking, not for the targets.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from tests.bench.install import REPO_ROOT, BenchError
from tests.bench.variants import RunningVariant, Variant

HTTPERF_BIN_MS = 1.0
# A request still unanswered after this is an error to httperf; the open-loop client drains as long.
REQUEST_TIMEOUT_SECONDS = 5
# One key for httperf, which sends the same headers on every connection.
HTTPERF_API_KEY = "latency"
_HISTOGRAM_LINE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s+(\d+)\s*$")
_REPLY_STATUS = re.compile(r"Reply status: 1xx=(\d+) 2xx=(\d+) 3xx=(\d+) 4xx=(\d+) 5xx=(\d+)")
_ERRORS_TOTAL = re.compile(r"Errors: total (\d+)")
_CONNECTIONS = re.compile(r"Total: connections (\d+)")


@dataclass(frozen=True)
class HttperfResult:
    connections: int
    replies_2xx: int
    errors: int
    p50_bin_ms: float  # lower edge of the 1 ms bin holding the median connection time
    p99_bin_ms: float


@dataclass(frozen=True)
class OpenLoopResult:
    completed: int
    unanswered: int
    non_2xx: int
    p50_ms: float
    p99_ms: float
    dispatch_lag_p99_ms: float  # the client's own lateness, included in every latency
    waited_for_connection: int  # requests due while every connection was busy


def run_httperf(httperf: str, url: str, *, rate: float, duration: float) -> HttperfResult:
    host, _, port = url.removeprefix("http://").partition(":")
    command = [
        httperf, "--server", host, "--port", port, "--uri", "/",
        "--rate", f"{rate:.0f}", "--num-conns", str(max(1, int(rate * duration))), "--num-calls", "1",
        "--timeout", str(REQUEST_TIMEOUT_SECONDS), "--add-header", f"X-API-Key: {HTTPERF_API_KEY}\n",
        "-v", "-v",  # verbose > 1 is what prints the lifetime histogram
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=duration + 3 * REQUEST_TIMEOUT_SECONDS)
    if result.returncode != 0:
        raise BenchError(f"httperf failed ({result.returncode}): {result.stderr.strip().splitlines()[-1:]}")
    return parse_httperf(result.stdout)


def parse_httperf(output: str) -> HttperfResult:
    histogram = httperf_histogram(output)
    status = _REPLY_STATUS.search(output)
    errors = _ERRORS_TOTAL.search(output)
    connections = _CONNECTIONS.search(output)
    if not (status and errors and connections):
        raise BenchError("httperf printed no summary; is it httperf 0.9?")
    return HttperfResult(
        connections=int(connections.group(1)),
        replies_2xx=int(status.group(2)),
        errors=int(errors.group(1)),
        p50_bin_ms=histogram_percentile(histogram, 50),
        p99_bin_ms=histogram_percentile(histogram, 99),
    )


def httperf_histogram(output: str) -> dict[float, int]:
    """{bin lower edge in ms: connections}, from the lines after "Connection lifetime histogram".

    httperf prints each non-empty bin as its midpoint ((i + 0.5) ms) and its count,
    and a lone ':' where empty bins were skipped."""
    lines = output.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith("Connection lifetime histogram"))
    except StopIteration:
        return {}
    histogram: dict[float, int] = {}
    for line in lines[start + 1:]:
        if not line.strip():
            break
        match = _HISTOGRAM_LINE.match(line)
        if match:
            histogram[float(match.group(1)) - HTTPERF_BIN_MS / 2] = int(match.group(2))
    return histogram


def histogram_percentile(histogram: dict[float, int], percent: float) -> float:
    """The lower edge of the bin holding the `percent`th percentile; nan for an empty histogram."""
    total = sum(histogram.values())
    if not total:
        return math.nan
    needed = math.ceil(percent / 100 * total)
    seen = 0
    for lower_edge in sorted(histogram):
        seen += histogram[lower_edge]
        if seen >= needed:
            return lower_edge
    return max(histogram)


def run_open_loop(url: str, *, rate: float, duration: float) -> OpenLoopResult:
    command = [
        sys.executable, "-m", "tests.bench.open_loop", "--url", url + "/",
        "--rate", f"{rate:.0f}", "--duration", str(duration),
    ]
    result = subprocess.run(
        command, capture_output=True, text=True, cwd=REPO_ROOT, timeout=duration + 3 * REQUEST_TIMEOUT_SECONDS
    )
    if result.returncode != 0:
        raise BenchError(f"open-loop client failed: {(result.stderr.strip().splitlines() or ['no output'])[-1]}")
    summary = json.loads(result.stdout)
    return OpenLoopResult(
        completed=summary["completed"],
        unanswered=summary["unanswered"],
        non_2xx=summary["non_2xx"],
        p50_ms=summary["p50_ms"],
        p99_ms=summary["p99_ms"],
        dispatch_lag_p99_ms=summary["dispatch_lag_p99_ms"],
        waited_for_connection=summary["waited_for_connection"],
    )


@dataclass(frozen=True)
class LatencyRun:
    httperf: HttperfResult
    open_loop: OpenLoopResult


def measure_latency(
    running: Sequence[tuple[Variant, RunningVariant]], httperf: str, *, rate: float, rounds: int, duration: float
) -> dict[str, list[LatencyRun]]:
    """Each variant at `rate` req/s, with httperf and then the open-loop client, in interleaved rounds."""
    runs: dict[str, list[LatencyRun]] = {variant.key: [] for variant, _ in running}
    for round_number in range(1, rounds + 1):
        httperf_results = {variant.key: run_httperf(httperf, server.url, rate=rate, duration=duration)
                           for variant, server in running}
        for variant, server in running:
            open_loop = run_open_loop(server.url, rate=rate, duration=duration)
            runs[variant.key].append(LatencyRun(httperf_results[variant.key], open_loop))
        progress = ", ".join(f"{key} {results[-1].open_loop.p99_ms:.2f}" for key, results in runs.items())
        print(f"bench: latency round {round_number}/{rounds} (open-loop p99 ms): {progress}", file=sys.stderr)
    return runs
