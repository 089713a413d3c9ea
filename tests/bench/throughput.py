"""Throughput: wrk against every variant in interleaved rounds (a b c …, a b c …),
so a noisy neighbour or a change of CPU clock lands on all variants alike rather
than on whichever ran during it. Around each run, Redis's INFO commandstats
gives the script calls (EVALSHA + EVAL) the run cost, per request served.

The decision services take their turn in the same rounds: wrk asks the decision
listener as Traefik's forwardAuth does, and tests.bench.rls_clients, a process of
its own as wrk is, keeps gRPC calls in flight against the RLS.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import redis

from tests.bench.install import REPO_ROOT, BenchError
from tests.bench.variants import FLOOD_API_KEY, RLS_DECISIONS, TRAEFIK_DECISIONS, RunningVariant, Variant

CLIENT_COUNT = 10_000
# The RLS's clients: Envoy keeps an HTTP/2 connection to the service per worker thread,
# so 4 channels stand for 4 Envoy workers; 50 calls in flight on each, 200 in all, as
# the store phase keeps 200 checks in flight.
RLS_CHANNELS = 4
RLS_IN_FLIGHT_PER_CHANNEL = 50
# Long enough for pools to fill and caches to warm before anything is recorded.
WARMUP_SECONDS = 1
# wrk's default of 2 s would count a stalled request as an error instead of a slow one.
WRK_TIMEOUT = "5s"
SCRIPT_COMMANDS = ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_eval_ro", "cmdstat_evalsha_ro")

# Each request carries one of CLIENT_COUNT API keys, drawn at random. The requests are
# formatted once per wrk thread, in init(): wrk sets the Host header only just before
# it calls init, so requests formatted earlier would have none (and get 400).
_KEYS_SCRIPT = """\
-- {count} distinct clients for wrk: one X-API-Key of {count}, at random, per request.
local requests = {{}}
init = function(args)
  for i = 1, {count} do
    requests[i] = wrk.format(nil, nil, {{["X-API-Key"] = "client-" .. i}})
  end
end
request = function()
  return requests[math.random({count})]
end
"""

# The same clients, asked about at the decision listener with the headers Traefik's
# forwardAuth writes (docs/beside-proxies.md): the original request is (b)'s `GET /`.
_TRAEFIK_SCRIPT = """\
-- {count} distinct clients, each request a Traefik forwardAuth question about a GET /.
local requests = {{}}
init = function(args)
  for i = 1, {count} do
    requests[i] = wrk.format("GET", "{path}", {{
      ["X-API-Key"] = "client-" .. i,
      ["X-Forwarded-Method"] = "GET",
      ["X-Forwarded-Proto"] = "https",
      ["X-Forwarded-Host"] = "shop.example",
      ["X-Forwarded-Uri"] = "/",
      ["X-Forwarded-For"] = "203.0.113.7",
    }})
  end
end
request = function()
  return requests[math.random({count})]
end
"""
TRAEFIK_PATH = "/decide/traefik"

_REQUESTS_PER_SECOND = re.compile(r"^Requests/sec:\s+([\d.]+)", re.MULTILINE)
_REQUESTS = re.compile(r"^\s+(\d+) requests in", re.MULTILINE)
_NON_SUCCESS = re.compile(r"Non-2xx or 3xx responses: (\d+)")
_SOCKET_ERRORS = re.compile(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)")


@dataclass(frozen=True)
class WrkResult:
    """What wrk counted in a run, or the RLS client in the same terms (a call for a request)."""

    requests: int
    requests_per_second: float
    non_success: int  # responses that were neither 2xx nor 3xx: the 429s of a flood
    socket_errors: int


@dataclass(frozen=True)
class ThroughputRun:
    wrk: WrkResult
    script_calls: int  # EVALSHA + EVAL that Redis ran during the run

    @property
    def script_calls_per_request(self) -> float:
        return self.script_calls / self.wrk.requests if self.wrk.requests else float("nan")


@dataclass(frozen=True)
class LoadSettings:
    wrk: str
    duration: int
    connections: int
    threads: int


@dataclass(frozen=True)
class WrkScripts:
    api_keys: Path
    traefik: Path


def write_keys_script(directory: Path, count: int = CLIENT_COUNT) -> Path:
    path = directory / "api-keys.lua"
    path.write_text(_KEYS_SCRIPT.format(count=count))
    return path


def write_scripts(directory: Path, count: int = CLIENT_COUNT) -> WrkScripts:
    traefik = directory / "traefik.lua"
    traefik.write_text(_TRAEFIK_SCRIPT.format(count=count, path=TRAEFIK_PATH))
    return WrkScripts(api_keys=write_keys_script(directory, count), traefik=traefik)


def run_wrk(settings: LoadSettings, url: str, extra_args: Sequence[str], *, duration: int | None = None) -> WrkResult:
    seconds = duration or settings.duration
    command = [
        settings.wrk, f"-t{settings.threads}", f"-c{settings.connections}", f"-d{seconds}s",
        "--timeout", WRK_TIMEOUT, *extra_args, url + "/",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 30)
    rate, requests = _REQUESTS_PER_SECOND.search(result.stdout), _REQUESTS.search(result.stdout)
    if result.returncode != 0 or not rate or not requests:
        reason = (result.stderr.strip() or result.stdout.strip() or f"exit {result.returncode}").splitlines()[-1]
        raise BenchError(f"wrk against {url} failed: {reason}")
    non_success = _NON_SUCCESS.search(result.stdout)
    socket_errors = _SOCKET_ERRORS.search(result.stdout)
    return WrkResult(
        requests=int(requests.group(1)),
        requests_per_second=float(rate.group(1)),
        non_success=int(non_success.group(1)) if non_success else 0,
        socket_errors=sum(map(int, socket_errors.groups())) if socket_errors else 0,
    )


def script_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return sum(int(stats[name]["calls"]) for name in SCRIPT_COMMANDS if name in stats)


def run_rls_clients(target: str, seconds: int, count: int = CLIENT_COUNT) -> WrkResult:
    """tests.bench.rls_clients against the RLS at `target` for `seconds`."""
    command = [
        sys.executable, "-m", "tests.bench.rls_clients", target, str(seconds), str(count),
        str(RLS_CHANNELS), str(RLS_IN_FLIGHT_PER_CHANNEL),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 60, cwd=REPO_ROOT)
    if result.returncode != 0:
        reason = (result.stderr.strip() or f"exit {result.returncode}").splitlines()[-1]
        raise BenchError(f"the RLS clients against {target} failed: {reason}")
    counts = json.loads(result.stdout)
    return WrkResult(
        requests=counts["calls"],
        requests_per_second=counts["calls"] / counts["seconds"] if counts["seconds"] else 0.0,
        non_success=counts["not_ok"],
        socket_errors=counts["errors"],
    )


def wrk_args_for(variant: Variant, scripts: WrkScripts) -> list[str]:
    if variant.flood:
        return ["-H", f"X-API-Key: {FLOOD_API_KEY}"]
    if variant.decides == TRAEFIK_DECISIONS:
        return ["-s", str(scripts.traefik)]
    return ["-s", str(scripts.api_keys)]


def run_load(
    settings: LoadSettings, variant: Variant, server: RunningVariant, scripts: WrkScripts, *, duration: int | None = None
) -> WrkResult:
    """One run against `variant`: wrk, or for the RLS its gRPC clients."""
    if variant.decides == RLS_DECISIONS:
        return run_rls_clients(server.url, duration or settings.duration)
    return run_wrk(settings, server.url, wrk_args_for(variant, scripts), duration=duration)


def measure_throughput(
    running: Sequence[tuple[Variant, RunningVariant]],
    settings: LoadSettings,
    redis_client: redis.Redis,
    work_dir: Path,
    *,
    rounds: int,
) -> dict[str, list[ThroughputRun]]:
    """`rounds` runs of every variant, interleaved; the runs of each variant by its key."""
    scripts = write_scripts(work_dir)
    for variant, server in running:
        run_load(settings, variant, server, scripts, duration=WARMUP_SECONDS)
    runs: dict[str, list[ThroughputRun]] = {variant.key: [] for variant, _ in running}
    for round_number in range(1, rounds + 1):
        progress = []
        for variant, server in running:
            before = script_calls(redis_client)
            result = run_load(settings, variant, server, scripts)
            runs[variant.key].append(ThroughputRun(result, script_calls(redis_client) - before))
            progress.append(f"{variant.key} {result.requests_per_second:.0f}")
        print(f"bench: throughput round {round_number}/{rounds} (req/s): {', '.join(progress)}", file=sys.stderr)
    return runs
