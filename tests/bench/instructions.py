"""`python -m tests.bench.instructions --against REV`: CPU instructions per request of
this checkout's gateway and of other commits', counted by valgrind's callgrind.

Requests per second on a shared machine move 5-15% between two runs of the same code,
so a change of a few percent is lost in them. Instructions are counted, not timed: the
same code serving the same requests counts within a fraction of a percent, however
busy the machine is. Each commit's gateway runs as users run it (`python -m gateway
run`, from `git archive` of that commit), on (a), (b), (k) and (c)'s configs of the
throughput phase, against one nginx upstream and one private Redis. After a warm-up,
its counters are zeroed, exactly `--requests` keep-alive requests are sent, and the
count is dumped, so start-up and import are left out. Every answer's status is checked
((a), (b) and (k) all 200, (c) all 429); a run with other statuses stops the comparison.
A commit from before costs read from the response rejects (k)'s config: its (k) is shown
as "—".

The ceiling (g) and the floor of a denial (h), this checkout's tests/bench probes, are
counted the same way once a run, since they run no gateway code: (g) serves (a)'s
requests, (h) (c)'s. Each source's (a) ÷ (g), (b) ÷ (a), (k) ÷ (b) and (c) ÷ (h) follow, as ratios
of throughput would read were time proportional to instructions.

    .venv/bin/python -m tests.bench.instructions --against HEAD~3 [--against REV ...] [--requests 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import contextlib
import glob
import io
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.bench.install import REPO_ROOT, BenchError, _apt_install, ensure_tools, find_tool
from tests.bench.servers import nginx_upstream, started
from tests.bench.variants import ALL_ALLOWED_LIMIT, COSTED_LIMIT, FLOOD_API_KEY, FLOOD_LIMIT, gateway_yaml
from tests.processes import RedisServer, free_port

WARMUP_REQUESTS = 300
CONNECTIONS = 10
CLIENT_COUNT = 10_000  # API keys of (b), as the throughput phase sends them
# Valgrind runs a gateway some 50 times slower: the store timeout must not turn that into
# fail-open answers, which would count another path.
STORE_TIMEOUT = "1s"
START_SECONDS = 600  # a start under valgrind imports everything at that slowness
WORKING_TREE = "working tree"
PROBE_SOURCE = "probe"  # the results' source of (g) and (h), which this checkout's tests/bench runs


@dataclass(frozen=True)
class Case:
    key: str
    title: str
    status: str  # what every answer must be
    flood: bool = False  # sent as the flooding client, as (c) is
    # A module of tests/bench and its arguments, run in place of a gateway ("{upstream}" is
    # the nginx upstream's URL): the same code for every commit, so counted once a run.
    probe: tuple[str, ...] = ()
    # Older commits may not run it (their gateway exits at start): counted as missing, not an error.
    optional: bool = False

    def config(self, upstream_url: str, redis_url: str, port: int, admin_port: int) -> str:
        if self.key == "a":
            text = gateway_yaml(upstream_url)
        else:
            limit = {"b": ALL_ALLOWED_LIMIT, "k": COSTED_LIMIT}.get(self.key, FLOOD_LIMIT)
            text = gateway_yaml(upstream_url, store_url=redis_url, limit=limit)
            text = text.replace(f"  url: {redis_url}\n", f"  url: {redis_url}\n  timeout: {STORE_TIMEOUT}\n")
        return text.replace("listen: 127.0.0.1:0", f"listen: 127.0.0.1:{port}", 1).replace(
            "admin_listen: 127.0.0.1:0", f"admin_listen: 127.0.0.1:{admin_port}"
        )


CASES = (
    Case("a", "gateway, no limits", "200"),
    Case("b", "gateway, Redis limit, 10,000 clients, all allowed", "200"),
    Case("k", "gateway, (b)'s limit costed by the response (reserve 2, settled at 1)", "200", optional=True),
    Case("c", "gateway, Redis limit, one client flooding (1/hour)", "429", flood=True),
)
# The ceiling serves (a)'s requests and the floor of a denial (c)'s, as in the throughput phase.
PROBES = (
    Case("g", "the ceiling: aiohttp web.Server + httptools upstream client", "200",
         probe=("tests.bench.ceiling", "--upstream", "{upstream}")),
    Case("h", "the floor of a denial: aiohttp web.Server, fixed 429", "429", flood=True, probe=("tests.bench.denial_floor",)),
)
# The ratios, each as throughput would give it were time proportional to instructions:
# (numerator, denominator), read as the denominator's count ÷ the numerator's.
RATIOS = (("a", "g"), ("b", "a"), ("k", "b"), ("c", "h"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.instructions", description=__doc__.splitlines()[0])
    parser.add_argument("--against", action="append", default=[], metavar="REV", help="a commit to compare with (repeatable)")
    parser.add_argument("--requests", type=int, default=2000, help="requests counted per gateway (default %(default)s)")
    args = parser.parse_args(argv)
    if not args.against:
        parser.error("give at least one --against REV")
    if args.requests < CONNECTIONS:
        parser.error(f"--requests must be at least {CONNECTIONS}")
    return args


def export_commit(rev: str, into: Path) -> Path:
    """The tree of `rev` as files, without git metadata, so its `gateway` is imported."""
    archive = subprocess.run(["git", "archive", "--format=tar", rev], cwd=REPO_ROOT, capture_output=True)
    if archive.returncode != 0:
        raise BenchError(f"git archive {rev} failed: {archive.stderr.decode().strip().splitlines()[-1]}")
    target = into / rev.replace("/", "_")
    target.mkdir()
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(target, filter="data")
    return target


async def send(port: int, count: int, flood: bool) -> collections.Counter[str]:
    """Exactly `count` keep-alive GETs over CONNECTIONS connections; their statuses."""
    statuses: collections.Counter[str] = collections.Counter()

    async def one_connection(index: int, requests: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for n in range(requests):
            key = FLOOD_API_KEY if flood else f"client-{(index * 7919 + n) % CLIENT_COUNT + 1}"
            writer.write(f"GET / HTTP/1.1\r\nHost: bench\r\nX-API-Key: {key}\r\n\r\n".encode())
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                (int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0
            )
            await reader.readexactly(length)
            statuses[head.split(b" ", 2)[1].decode()] += 1
        writer.close()

    share, extra = divmod(count, CONNECTIONS)
    await asyncio.gather(*(one_connection(i, share + (i < extra)) for i in range(CONNECTIONS)))
    return statuses


def wait_listening(port: int, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            lines = log.read_text(errors="replace").strip().splitlines()
            raise BenchError(f"a server under valgrind exited {process.returncode}: {lines[-1] if lines else 'no output'}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.2)  # polling a process we cannot be told about: it prints its port only to its log
    raise BenchError(f"a server under valgrind did not listen within {START_SECONDS} s")


def instructions(dump: Path) -> int:
    for line in dump.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise BenchError(f"callgrind wrote no total in {dump}")


def count(tag: str, source: Path, case: Case, env: dict[str, str], requests: int, work: Path) -> int:
    """Instructions per request of the gateway in `source` serving `case`, or of `case`'s
    probe (`source` then being this checkout); `tag` names its files."""
    port = free_port()
    if case.probe:
        module, *probe_args = case.probe
        program = ["-m", module, "--port", str(port), *(arg.format(**env) for arg in probe_args)]
    else:
        config = work / f"{tag}.yaml"
        config.write_text(case.config(env["upstream"], env["redis"], port, free_port()))
        program = ["-m", "gateway", "run", "-c", str(config)]
    out, log = work / f"{tag}.callgrind", work / f"{tag}.log"
    command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, *program]
    # The working directory holds no `gateway` nor `tests`: PYTHONPATH alone picks the checkout.
    with open(log, "w") as log_file:
        process = subprocess.Popen(
            command, cwd=work, env={**os.environ, "PYTHONPATH": str(source)}, stdout=subprocess.DEVNULL, stderr=log_file
        )
    try:
        wait_listening(port, process, log)
        asyncio.run(send(port, WARMUP_REQUESTS, case.flood))
        subprocess.run(["callgrind_control", "--zero", str(process.pid)], check=True, capture_output=True)
        statuses = asyncio.run(send(port, requests, case.flood))
        subprocess.run(["callgrind_control", "--dump", str(process.pid)], check=True, capture_output=True)
    finally:
        process.terminate()
        process.wait(60)
    if statuses != {case.status: requests}:
        raise BenchError(f"({case.key}) of {tag} answered {dict(statuses)}, not {requests} × {case.status}")
    dumps = sorted(glob.glob(f"{out}.*"), key=os.path.getmtime)
    return instructions(Path(dumps[-1])) // requests


def render(results: dict[tuple[str, str], int | None], sources: list[str], requests: int) -> str:
    """Markdown tables: each source's count, and the working tree's over each commit's; the
    probes' counts; and the issue's ratios for each source, against the probes."""
    tree, commits = sources[0], sources[1:]
    header = "| variant | " + " | ".join(sources) + " | " + " | ".join(f"{tree} ÷ {rev}" for rev in commits) + " |"
    lines = [
        f"Instructions per request (callgrind, {requests:,} requests each over {CONNECTIONS} keep-alive connections)",
        "",
        header,
        "|---|" + "---:|" * (len(sources) + len(commits)),
    ]
    for case in CASES:
        counts = [results[case.key, source] for source in sources]
        ratios = [f"{counts[0] / n:.3f}" if counts[0] and n else "—" for n in counts[1:]]
        shown = (f"{n:,}" if n else "—" for n in counts)
        lines.append(f"| ({case.key}) {case.title} | " + " | ".join(shown) + " | " + " | ".join(ratios) + " |")
    lines += ["", "The ceiling and the floor, the same code for every commit, counted once:", "",
              "| probe | instructions per request |", "|---|---:|"]
    lines += [f"| ({probe.key}) {probe.title} | {results[probe.key, PROBE_SOURCE]:,} |" for probe in PROBES]
    lines += ["", "Ratios as throughput, were time proportional to instructions (X ÷ Y is Y's count ÷ X's):", "",
              "| ratio | " + " | ".join(sources) + " |", "|---|" + "---:|" * len(sources)]
    for numerator, denominator in RATIOS:
        pairs = [(_count_of(results, denominator, source), _count_of(results, numerator, source)) for source in sources]
        values = [f"{d / n:.2f}" if d and n else "—" for d, n in pairs]
        lines.append(f"| ({numerator}) ÷ ({denominator}) | " + " | ".join(values) + " |")
    return "\n".join(lines) + "\n"


def _count_of(results: dict[tuple[str, str], int | None], key: str, source: str) -> int | None:
    """`key`'s count for `source`, or the probe's, which is the same for all."""
    return results[key, source] if (key, source) in results else results[key, PROBE_SOURCE]


def _result(job: concurrent.futures.Future[int], optional: bool) -> int | None:
    """A count; None for an optional case whose gateway would not start (an older commit's)."""
    try:
        return job.result()
    except BenchError as exc:
        if optional and "exited" in str(exc):
            print(f"bench: left out: {exc}", file=sys.stderr)
            return None
        raise


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        tools = ensure_tools()
        if find_tool("valgrind") is None:
            _apt_install(["valgrind"])
        with contextlib.ExitStack() as stack:
            work = Path(tempfile.mkdtemp(prefix="gateway-instructions-"))
            stack.callback(shutil.rmtree, work, ignore_errors=True)
            sources = {WORKING_TREE: REPO_ROOT} | {rev: export_commit(rev, work) for rev in args.against}
            redis_server = stack.enter_context(started(RedisServer(), "redis-server"))
            upstream = stack.enter_context(nginx_upstream(tools["nginx"]))
            env = {"upstream": upstream.url, "redis": redis_server.url}
            # Counts do not depend on what else runs: two at a time only saves wall time.
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                jobs = {
                    (case.key, name): pool.submit(count, f"{index}-{case.key}", source, case, env, args.requests, work)
                    for case in CASES for index, (name, source) in enumerate(sources.items())
                }
                for probe in PROBES:
                    jobs[probe.key, PROBE_SOURCE] = pool.submit(
                        count, f"probe-{probe.key}", REPO_ROOT, probe, env, args.requests, work
                    )
                optional = {case.key for case in CASES if case.optional}
                results = {key: _result(job, key[0] in optional) for key, job in jobs.items()}
    except BenchError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 1
    print(render(results, list(sources), args.requests))
    return 0


if __name__ == "__main__":
    sys.exit(main())
