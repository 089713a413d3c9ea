"""Throughput: wrk against every variant in interleaved rounds (a b c …, a b c …),
so a noisy neighbour or a change of CPU clock lands on all variants alike rather
than on whichever ran during it. Around each run, Redis's INFO commandstats
gives the script calls (EVALSHA + EVAL) the run cost, per request served.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import redis

from tests.bench.install import BenchError
from tests.bench.variants import FLOOD_API_KEY, RunningVariant, Variant

CLIENT_COUNT = 10_000
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

_REQUESTS_PER_SECOND = re.compile(r"^Requests/sec:\s+([\d.]+)", re.MULTILINE)
_REQUESTS = re.compile(r"^\s+(\d+) requests in", re.MULTILINE)
_NON_SUCCESS = re.compile(r"Non-2xx or 3xx responses: (\d+)")
_SOCKET_ERRORS = re.compile(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)")


@dataclass(frozen=True)
class WrkResult:
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


def write_keys_script(directory: Path, count: int = CLIENT_COUNT) -> Path:
    path = directory / "api-keys.lua"
    path.write_text(_KEYS_SCRIPT.format(count=count))
    return path


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


def wrk_args_for(variant: Variant, keys_script: Path) -> list[str]:
    if variant.flood:
        return ["-H", f"X-API-Key: {FLOOD_API_KEY}"]
    return ["-s", str(keys_script)]


def measure_throughput(
    running: Sequence[tuple[Variant, RunningVariant]],
    settings: LoadSettings,
    redis_client: redis.Redis,
    work_dir: Path,
    *,
    rounds: int,
) -> dict[str, list[ThroughputRun]]:
    """`rounds` wrk runs of every variant, interleaved; the runs of each variant by its key."""
    keys_script = write_keys_script(work_dir)
    for variant, server in running:
        run_wrk(settings, server.url, wrk_args_for(variant, keys_script), duration=WARMUP_SECONDS)
    runs: dict[str, list[ThroughputRun]] = {variant.key: [] for variant, _ in running}
    for round_number in range(1, rounds + 1):
        progress = []
        for variant, server in running:
            before = script_calls(redis_client)
            result = run_wrk(settings, server.url, wrk_args_for(variant, keys_script))
            runs[variant.key].append(ThroughputRun(result, script_calls(redis_client) - before))
            progress.append(f"{variant.key} {result.requests_per_second:.0f}")
        print(f"bench: throughput round {round_number}/{rounds} (req/s): {', '.join(progress)}", file=sys.stderr)
    return runs
