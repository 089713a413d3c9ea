"""The benchmark's other servers, each a real process that is always stopped:
nginx as the upstream (`return 200 "ok"`, so the upstream is never the
bottleneck), nginx as a rate-limiting proxy (`limit_req`), the naive proxy, the
ceiling and denial-floor probes, the floors of the two decision services, and
the aiohttp upstream of the streaming phase.

Each nginx gets a private prefix in a temp dir (config, pid, logs, temp
paths), one worker, `daemon off`, and a free port on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from tests.bench.install import REPO_ROOT, BenchError
from tests.processes import START_DEADLINE, GatewayProcess, RedisServer, free_port, terminate

STOP_DEADLINE = 10.0
# The benchmark's clients reuse connections for minutes; nginx's default of 1000
# requests per keep-alive connection would make it close them mid-run.
KEEPALIVE_REQUESTS = 1_000_000
# limit_req rate and burst so high that every request passes: the cost of the check, not of denials.
NGINX_ALL_ALLOWED_RATE = "1000000r/s"
NGINX_ALL_ALLOWED_BURST = 1_000_000
# Idle keep-alive connections nginx keeps to the upstream, like the gateway's pool.
NGINX_UPSTREAM_KEEPALIVE = 64


class ListeningProcess:
    """A server command that listens on `port`; started when entered, stopped when left."""

    def __init__(self, argv: list[str], *, port: int, what: str, log_path: Path, cwd: Path | None = None) -> None:
        self.argv = argv
        self.port = port
        self.what = what
        self.log_path = log_path
        self.cwd = cwd
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ListeningProcess:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.cwd
            )
        try:
            self._wait_until_listening()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_until_listening(self) -> None:
        assert self.process is not None
        end = time.monotonic() + START_DEADLINE
        while time.monotonic() < end:
            if self.process.poll() is not None:
                raise BenchError(f"{self.what} exited with {self.process.returncode}: {self.last_log_line()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.02)
        raise BenchError(f"{self.what} did not listen on port {self.port} within {START_DEADLINE:g} s")

    def last_log_line(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "no log"
        return lines[-1] if lines else "no output"

    def stop(self) -> None:
        if self.process is None:
            return
        terminate(self.process, grace=STOP_DEADLINE)
        self.process = None


class NginxProcess(ListeningProcess):
    """nginx with one worker, serving `server_block` (which listens on `{port}`) inside `http {}`."""

    def __init__(self, nginx: str, server_block: str, *, what: str) -> None:
        self.prefix = Path(tempfile.mkdtemp(prefix="gateway-bench-nginx-"))
        # Workers run as `nobody` when nginx starts as root; they must reach the temp paths.
        self.prefix.chmod(0o755)
        port = free_port()
        config = self.prefix / "nginx.conf"
        config.write_text(_nginx_config(self.prefix, server_block.replace("{port}", str(port))))
        error_log = self.prefix / "error.log"
        # -e: nginx opens its default error log before reading the config unless told otherwise.
        argv = [nginx, "-p", str(self.prefix), "-c", str(config), "-e", str(error_log)]
        super().__init__(argv, port=port, what=what, log_path=error_log)

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            shutil.rmtree(self.prefix, ignore_errors=True)


def _nginx_config(prefix: Path, server_block: str) -> str:
    temp_paths = "\n".join(
        f"    {kind}_temp_path {prefix / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return f"""
daemon off;
master_process on;
worker_processes 1;
pid {prefix / 'nginx.pid'};
error_log {prefix / 'error.log'} warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    keepalive_requests {KEEPALIVE_REQUESTS};
{temp_paths}
{server_block}
}}
"""


def nginx_upstream(nginx: str) -> NginxProcess:
    """The upstream every variant forwards to: two bytes, answered by nginx itself, with the
    units (k)'s limit reads from the response (a header every variant relays alike)."""
    server = """
    server {
        listen 127.0.0.1:{port};
        location / { add_header X-Usage-Units 1; return 200 "ok"; }
    }"""
    return NginxProcess(nginx, server, what="nginx upstream")


def nginx_limit_req_proxy(nginx: str, upstream_url: str) -> NginxProcess:
    """nginx in front of the same upstream, with a limit_req zone keyed by X-API-Key that allows everything."""
    upstream_address = upstream_url.removeprefix("http://")
    server = f"""
    limit_req_zone $http_x_api_key zone=per_key:10m rate={NGINX_ALL_ALLOWED_RATE};
    upstream bench_upstream {{
        server {upstream_address};
        keepalive {NGINX_UPSTREAM_KEEPALIVE};
    }}
    server {{
        listen 127.0.0.1:{{port}};
        location / {{
            limit_req zone=per_key burst={NGINX_ALL_ALLOWED_BURST} nodelay;
            proxy_pass http://bench_upstream;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }}
    }}"""
    return NginxProcess(nginx, server, what="nginx limit_req proxy")


def naive_proxy(upstream_url: str, log_dir: Path, *, redis_url: str | None = None) -> ListeningProcess:
    """tests/bench/naive_proxy.py as its own process, with one EVALSHA per request when given `redis_url`."""
    argv = ["--upstream", upstream_url] + (["--redis", redis_url] if redis_url else [])
    name = "naive proxy + EVALSHA" if redis_url else "naive proxy"
    return python_server("tests.bench.naive_proxy", argv, what=name, log_dir=log_dir)


def ceiling_proxy(upstream_url: str, log_dir: Path) -> ListeningProcess:
    """tests/bench/ceiling.py as its own process: web.Server and the minimal httptools client."""
    return python_server("tests.bench.ceiling", ["--upstream", upstream_url], what="ceiling proxy", log_dir=log_dir)


def denial_floor(log_dir: Path) -> ListeningProcess:
    """tests/bench/denial_floor.py as its own process: web.Server answering a fixed 429."""
    return python_server("tests.bench.denial_floor", [], what="denial floor", log_dir=log_dir)


def decision_floor(log_dir: Path) -> ListeningProcess:
    """tests/bench/decision_floor.py as its own process: web.Server answering a prebuilt 200 with RateLimit fields."""
    return python_server("tests.bench.decision_floor", [], what="decision listener floor", log_dir=log_dir)


def rls_floor(log_dir: Path) -> ListeningProcess:
    """tests/bench/rls_floor.py as its own process: grpc.aio answering a prebuilt OK to every ShouldRateLimit."""
    return python_server("tests.bench.rls_floor", [], what="RLS floor", log_dir=log_dir)


def bulk_upstream(log_dir: Path) -> ListeningProcess:
    """tests/bench/bulk_upstream.py as its own process: the tests' aiohttp upstream, for bodies of any size."""
    return python_server("tests.bench.bulk_upstream", [], what="bulk upstream", log_dir=log_dir)


def python_server(module: str, argv: list[str], *, what: str, log_dir: Path) -> ListeningProcess:
    """`python -m MODULE --port PORT ARGV...` from the repository root, its output in a log in `log_dir`."""
    port = free_port()
    log_path = log_dir / f"{module.rpartition('.')[2]}-{port}.log"
    command = [sys.executable, "-m", module, "--port", str(port), *argv]
    return ListeningProcess(command, port=port, what=what, log_path=log_path, cwd=REPO_ROOT)


@contextlib.contextmanager
def started(process: RedisServer | GatewayProcess, what: str) -> Iterator:
    """Start one of tests.processes' servers; a failed start is one BenchError line, and it is always stopped."""
    try:
        process.start()
    except AssertionError as exc:  # how tests.processes reports a failed start, with the server's output
        process.__exit__(None, None, None)
        detail = [line for line in str(exc).strip().splitlines() if line.strip()]
        raise BenchError(f"{what} did not start: {detail[-1] if detail else 'no output'}") from None
    try:
        yield process
    finally:
        process.__exit__(None, None, None)


def make_private_dir() -> Path:
    """A temp dir for the run's scripts and logs, readable by nginx's workers."""
    path = Path(tempfile.mkdtemp(prefix="gateway-bench-"))
    os.chmod(path, 0o755)
    return path
