"""`python -m tests.bench`: the whole benchmark in one command.

Installs what is missing, starts a private redis-server, an nginx upstream and
every variant as real processes, measures throughput (wrk) and, in the same
rounds, the decisions per second of the decision listener and of Envoy's
rate-limit service beside their floors, latency at a fixed rate (httperf and an open-loop client),
store checks per second and the gateway's RSS while 1 GiB streams each way,
stops everything it started (also on Ctrl-C or SIGTERM), and prints a markdown
report on stdout; progress goes to stderr.

    .venv/bin/python -m tests.bench [--rounds 5] [--duration 4] [--connections 50] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys

import redis

from tests.bench.install import BenchError, ensure_bench_extra, ensure_tools
from tests.bench.latency import measure_latency
from tests.bench.report import Results, Settings, median_rate, render
from tests.bench.servers import make_private_dir, nginx_upstream, started
from tests.bench.store_checks import contender_titles, measure_store_checks
from tests.bench.streaming import GIB, QUICK_BYTES, measure_streaming
from tests.bench.throughput import LoadSettings, measure_throughput
from tests.bench.variants import VARIANTS, Environment
from tests.processes import RedisServer

DEFAULT_ROUNDS = 5
DEFAULT_DURATION = 4
DEFAULT_CONNECTIONS = 50
DEFAULT_THREADS = 1  # one wrk thread leaves the other core of a 2-core machine to the server under test
# The "50% load" of the targets: far enough below the maximum that queueing does not dominate.
LATENCY_LOAD_FRACTION = 0.5
LATENCY_VARIANTS = ("a", "b", "d")
# Store contenders warm up this long (at most) before the rounds, filling their pools.
STORE_WARMUP_SECONDS = 1.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="interleaved rounds (default %(default)s)")
    parser.add_argument("--duration", type=int, default=DEFAULT_DURATION, help="seconds per run (default %(default)s)")
    parser.add_argument(
        "--connections", type=int, default=DEFAULT_CONNECTIONS, help="wrk connections (default %(default)s)"
    )
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS, help="wrk threads (default %(default)s)")
    parser.add_argument(
        "--latency-rate", type=float, default=None,
        help="req/s of the latency phase (default: half of (a)'s median). The open-loop client and httperf share "
        "the machine with the gateway: on 2 cores, half of a fast (a) can saturate it, which measures the client",
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 round of 1 s, 64 MiB streamed each way")
    args = parser.parse_args(argv)
    args.stream_bytes = GIB
    if args.quick:
        args.rounds, args.duration, args.stream_bytes = 1, 1, QUICK_BYTES
    if args.rounds < 1 or args.duration < 1 or args.connections < 1 or args.threads < 1:
        parser.error("--rounds, --duration, --connections and --threads must be at least 1")
    return args


def run_benchmark(args: argparse.Namespace, tools: dict[str, str]) -> str:
    load_average_before = os.getloadavg()[0]
    load = LoadSettings(wrk=tools["wrk"], duration=args.duration, connections=args.connections, threads=args.threads)
    with contextlib.ExitStack() as stack:
        work_dir = make_private_dir()
        stack.callback(shutil.rmtree, work_dir, ignore_errors=True)
        # Real-time priority stands in for the host of its own that Redis has in
        # production: on 2 shared cores it otherwise waits behind wrk and the gateway.
        redis_server = stack.enter_context(started(RedisServer(dedicated=True), "redis-server"))
        upstream = stack.enter_context(nginx_upstream(tools["nginx"]))
        env = Environment(tools=tools, upstream_url=upstream.url, redis=redis_server, work_dir=work_dir)
        redis_client = stack.enter_context(redis_server.client())  # for INFO commandstats

        with contextlib.ExitStack() as variants_stack:
            print(f"bench: starting {len(VARIANTS)} variants", file=sys.stderr)
            running = [(variant, variants_stack.enter_context(variant.start(env))) for variant in VARIANTS]
            by_key = {variant.key: server for variant, server in running}
            throughput = measure_throughput(running, load, redis_client, work_dir, rounds=args.rounds)
            decisions = {key: server.limiter_decisions() for key, server in by_key.items() if server.gateway}
            latency_rate = args.latency_rate or LATENCY_LOAD_FRACTION * median_rate(throughput["a"])
            latency = measure_latency(
                [(variant, server) for variant, server in running if variant.key in LATENCY_VARIANTS],
                tools["httperf"], rate=latency_rate, rounds=args.rounds, duration=args.duration,
            )
            event_loop = by_key["a"].event_loop()

        # After the HTTP variants are gone, so the store has the machine to itself.
        store = measure_store_checks(
            redis_server.url, rounds=args.rounds, seconds=args.duration,
            warmup=min(STORE_WARMUP_SECONDS, args.duration / 2),
        )
        streaming = measure_streaming(work_dir, size=args.stream_bytes)
    results = Results(
        variants=VARIANTS, throughput=throughput, decisions=decisions, latency=latency,
        store_titles=contender_titles(), store=store, streaming=streaming, event_loop=event_loop,
        load_average_before=load_average_before,
    )
    settings = Settings(
        rounds=args.rounds, duration=args.duration, connections=args.connections, threads=args.threads,
        latency_rate=latency_rate, latency_share=latency_rate / median_rate(throughput["a"]),
        stream_bytes=args.stream_bytes,
    )
    return render(results, settings)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwinds every `with`, so each process is stopped as on Ctrl-C


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGINT too: a shell starts background jobs with it ignored, and `kill -INT` must still stop the run.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _interrupt)
    try:
        tools = ensure_tools()
        ensure_bench_extra()
        report = run_benchmark(args, tools)
    # A tool, a server or the machine failed us: one line, since the traceback would only show our code.
    except (BenchError, redis.RedisError, OSError, subprocess.SubprocessError) as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench: interrupted; every process it started has been stopped", file=sys.stderr)
        return 130
    print(report, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
