"""Real processes for tests: redis-server and the gateway CLI, each a context
manager that always stops what it started. Nothing here talks to the shared
Redis on port 6379."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import redis
import yaml

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
START_DEADLINE = 15.0
CLUSTER_DEADLINE = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(predicate, *, deadline: float = START_DEADLINE, what: str) -> None:
    """Poll `predicate` until it holds; fail the test with `what` if it never does."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def eventually(predicate, *, what: str, deadline: float = START_DEADLINE) -> None:
    """`wait_until` for async tests: polls without blocking the event loop, so an
    in-process gateway or upstream keeps serving. `predicate` may be async."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def terminate(process: subprocess.Popen, *, grace: float = 10) -> None:
    """SIGTERM `process` if it still runs, and SIGKILL it if it has not ended `grace` seconds later."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class PortTaken(AssertionError):
    """A redis-server could not bind the free port chosen for it."""


class RedisServer:
    """A private redis-server on a free port, with no persistence.

    `dedicated=True` runs it at real-time CPU priority, as if it had a host of its
    own as in production. On this 2-core machine a load test's gateway and wrk
    keep both cores busy, and a redis-server that waits for a core answers a
    PING in 10-30 ms: a genuine store timeout, but one a real deployment does
    not have. Load tests that count fail_open at the 10 ms default use it."""

    def __init__(
        self, *extra_args: str, dedicated: bool = False, password: str | None = None, env: dict[str, str] | None = None
    ) -> None:
        """`password`: the one `--requirepass` in `extra_args` sets, for this helper's own clients.
        `env`: added to the server's environment (libfaketime's, to shift its clock)."""
        self.port = free_port()
        self._extra = extra_args
        self._password = password
        self._dedicated = dedicated
        self._env = {**os.environ, **env} if env else None
        self._dir = tempfile.mkdtemp(prefix="gateway-test-redis-")
        self._log = os.path.join(self._dir, "redis.log")
        self._pick_port = free_port
        self._started = False
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, password=self._password, socket_timeout=5, decode_responses=True)

    def start(self) -> RedisServer:
        """Start it; the first start moves to another free port while the chosen one was
        taken meanwhile (free ports are picked by closing a socket, so another test's
        process can take one first). A restart keeps its port, as a restarted Redis does."""
        for attempt in itertools.count():
            self.process = subprocess.Popen(
                [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", self._dir, "--logfile", self._log, "--daemonize", "no", *self._extra],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=self._env,
            )
            if self._dedicated:
                os.sched_setscheduler(self.process.pid, os.SCHED_FIFO, os.sched_param(10))
            try:
                wait_until(self._answers, what=f"redis-server on port {self.port}")
                break
            except PortTaken:
                if self._started or attempt >= 4:
                    raise
                self.port = self._pick_port()
        self._started = True
        return self

    def _answers(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            with open(self._log, errors="replace") as log:
                if "Address already in use" in log.read():
                    raise PortTaken(f"port {self.port} was taken before redis-server bound it")
            raise AssertionError(f"redis-server on port {self.port} exited with {self.process.returncode}")
        try:
            return bool(redis.Redis(port=self.port, password=self._password, socket_timeout=0.2).ping())
        except redis.RedisError:
            return False

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None

    def pause(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)


def free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    while True:
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


class RedisCluster:
    """A private Redis Cluster of `masters` masters with one replica each, made of
    redis-server processes and joined by `redis-cli --cluster create`, as operators do."""

    NODE_TIMEOUT_MS = 1000

    def __init__(self, masters: int = 3, *, dedicated: bool = False, password: str | None = None) -> None:
        self.password = password
        auth = ("--requirepass", password, "--masterauth", password) if password else ()
        self.nodes: list[RedisServer] = []
        for _ in range(masters * 2):
            node = RedisServer(
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.NODE_TIMEOUT_MS), "--repl-diskless-sync-delay", "0",
                *auth, dedicated=dedicated, password=password,
            )
            node.port = free_cluster_port()
            node._pick_port = free_cluster_port
            self.nodes.append(node)
        self._masters = masters

    @property
    def url(self) -> str:
        login = f":{self.password}@" if self.password else ""
        return f"redis+cluster://{login}" + ",".join(f"127.0.0.1:{node.port}" for node in self.nodes[:2])

    def client(self) -> redis.RedisCluster:
        return redis.RedisCluster(
            host="127.0.0.1", port=self.nodes[0].port, password=self.password, socket_timeout=5, decode_responses=True
        )

    def node_client(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, password=self.password, socket_timeout=5, decode_responses=True)

    def __enter__(self) -> RedisCluster:
        try:
            for node in self.nodes:
                node.start()
            subprocess.run(
                ["redis-cli", *(("-a", self.password, "--no-auth-warning") if self.password else ()),
                 "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                 "--cluster-replicas", "1", "--cluster-yes"],
                check=True, capture_output=True, timeout=60,
            )
            # Six processes gossiping and three full syncs: 2.6 s alone, but past 15 s once in a
            # full suite run on two busy cores. Setup, not a measure: a roomier deadline.
            wait_until(self.settled, deadline=CLUSTER_DEADLINE, what="the cluster to agree on its slots and sync its replicas")
        except BaseException:
            self.__exit__()
            raise
        return self

    def settled(self) -> bool:
        """Every node sees every slot served and every node known, and every replica is in sync."""
        for node in self.nodes:
            client = self.node_client(node.port)
            info = client.cluster("info")
            if info["cluster_state"] != "ok" or int(info["cluster_slots_ok"]) != 16384:
                return False
            if int(info["cluster_known_nodes"]) != len(self.nodes):
                return False
            replication = client.info("replication")
            if replication["role"] == "slave" and replication.get("master_link_status") != "up":
                return False
        return True

    def masters(self) -> dict[int, list[tuple[int, int]]]:
        """Each master's port and the slot ranges it serves, as the cluster says now."""
        owners: dict[int, list[tuple[int, int]]] = {}
        alive = next(node for node in self.nodes if node.process is not None and node.process.poll() is None)
        for first, last, master, *_ in self.node_client(alive.port).execute_command("CLUSTER SLOTS"):
            owners.setdefault(int(master[1]), []).append((int(first), int(last)))
        return owners

    def node_id(self, port: int) -> str:
        return self.node_client(port).execute_command("CLUSTER MYID")

    def replica_of(self, master_port: int) -> int:
        master_id = self.node_id(master_port)
        for node in self.nodes:
            replication = self.node_client(node.port).info("replication")
            if replication["role"] == "slave" and self.node_client(node.port).execute_command(
                "CLUSTER MYID"
            ) != master_id and int(replication["master_port"]) == master_port:
                return node.port
        raise AssertionError(f"no replica of {master_port}")

    def __exit__(self, *exc: object) -> None:
        for node in self.nodes:
            node.__exit__()


class SentinelServer:
    """A private Redis Sentinel on a free port, monitoring `master_port` as `service`,
    with short failure timers so a failover takes about a second."""

    DOWN_AFTER_MS = 500
    FAILOVER_TIMEOUT_MS = 3000

    def __init__(self, master_port: int, *, service: str = "mymaster", quorum: int = 2) -> None:
        self.port = free_port()
        self._dir = tempfile.mkdtemp(prefix="gateway-test-sentinel-")
        self._config = Path(self._dir) / "sentinel.conf"
        self._config.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndaemonize no\ndir {self._dir}\n"
            f"sentinel monitor {service} 127.0.0.1 {master_port} {quorum}\n"
            f"sentinel down-after-milliseconds {service} {self.DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {service} {self.FAILOVER_TIMEOUT_MS}\n"
        )
        self.process: subprocess.Popen | None = None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5, decode_responses=True)

    def __enter__(self) -> SentinelServer:
        self.process = subprocess.Popen(
            [REDIS_SERVER, str(self._config), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_until(self._answers, what=f"redis sentinel on port {self.port}")
        return self

    def _answers(self) -> bool:
        try:
            return bool(redis.Redis(port=self.port, socket_timeout=0.2).ping())
        except redis.RedisError:
            return False

    def __exit__(self, *exc: object) -> None:
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        shutil.rmtree(self._dir, ignore_errors=True)


_LISTENING_RE = re.compile(r"listening on (https?)://(\S+):(\d+) \(admin http://(\S+):(\d+)\)")


def on_free_ports(config_text: str) -> str:
    """`config_text` with `listen` and `admin_listen` on ports the kernel picks (127.0.0.1:0)
    where it names none: the defaults, 8080 and 9090, may be taken on the machine (by a
    demo, or another suite), and a test must not depend on them. Text that is no mapping
    (a test of a broken file) is left as it is."""
    try:
        parsed = yaml.safe_load(config_text)
    except yaml.YAMLError:
        return config_text
    if not isinstance(parsed, dict) or config_text.lstrip().startswith("{"):
        return config_text
    missing = "".join(f"{key}: 127.0.0.1:0\n" for key in ("listen", "admin_listen") if key not in parsed)
    return missing + config_text


class GatewayProcess:
    """`python -m gateway run -c FILE`, started as a user starts it. Listens on ports
    chosen by the kernel (port 0) and learns them from the startup line.

    `module` runs another entry point with the same command line: a test launcher
    such as `tests.instrumented_gateway`. With `read_stdout=False` nothing reads its
    stdout, a consumer that stalled, until the test calls `read_stdout()`; with
    `read_stderr=False` nothing reads its stderr past the startup line until the
    test calls `read_stderr()`."""

    def __init__(
        self,
        config_text: str | None,
        *,
        args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        command: str = "run",
        module: str = "gateway",
        read_stdout: bool = True,
        read_stderr: bool = True,
    ) -> None:
        # Kept past the with: the gateway reads it, and a reload test rewrites it. None: no
        # -c (`gateway demo` then runs the config shipped in the package).
        self.config_path: Path | None = None
        if config_text is not None:
            handle = tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="gateway-test-", delete=False)  # noqa: SIM115
            with handle:
                handle.write(on_free_ports(config_text))
            self.config_path = Path(handle.name)
        self._cwd = cwd
        self._args = args
        self._command = command  # "run", or "demo" for the quick start
        self._module = module
        self._read_stdout = read_stdout
        self._env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen | None = None
        self.stderr_lines: list[str] = []
        self.stdout_lines: list[str] = []
        self._readers: list[threading.Thread] = []
        self._listening = threading.Event()
        self._stderr_read = threading.Event()
        if read_stderr:
            self._stderr_read.set()
        self.url = self.admin_url = ""

    def start(self) -> GatewayProcess:
        self.process = subprocess.Popen(
            [sys.executable, "-m", self._module, self._command, *self._config_args(), *self._args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self._env, cwd=self._cwd,
        )
        self._start_reader(self.process.stderr, self.stderr_lines, True)
        if self._read_stdout:
            self.read_stdout()
        if not self._listening.wait(START_DEADLINE) or not self.url:
            self.stop()
            raise AssertionError("gateway did not start:\n" + "".join(self.stderr_lines))
        return self

    def _config_args(self) -> tuple[str, ...]:
        return ("-c", str(self.config_path)) if self.config_path is not None else ()

    def read_stdout(self) -> None:
        """Start collecting stdout into `stdout_lines`."""
        assert self.process is not None
        self._start_reader(self.process.stdout, self.stdout_lines, False)

    def read_stderr(self) -> None:
        """Read stderr on past the startup line (see read_stderr=False)."""
        self._stderr_read.set()

    def _start_reader(self, stream, lines: list[str], watch: bool) -> None:
        reader = threading.Thread(target=self._read, args=(stream, lines, watch), daemon=True)
        self._readers.append(reader)
        reader.start()

    def _read(self, stream, lines: list[str], watch: bool) -> None:
        for line in stream:
            lines.append(line)
            match = _LISTENING_RE.search(line) if watch else None
            if match:
                self.url = f"{match.group(1)}://{match.group(2)}:{match.group(3)}"
                self.admin_url = f"http://{match.group(4)}:{match.group(5)}"
                self._listening.set()
                self._stderr_read.wait()
        if watch:
            self._listening.set()

    def signal(self, signum: int) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    def wait(self, timeout: float = 30) -> int:
        assert self.process is not None
        return self.process.wait(timeout=timeout)

    def stop(self) -> int | None:
        if self.process is None:
            return None
        terminate(self.process, grace=30)
        self._stderr_read.set()
        for reader in self._readers:
            reader.join(timeout=5)  # they end at EOF, once the process and its children are gone
        for pipe in (self.process.stdout, self.process.stderr):
            if pipe:
                pipe.close()
        return self.process.returncode

    def rss_bytes(self) -> int:
        assert self.process is not None
        with open(f"/proc/{self.process.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def __enter__(self) -> GatewayProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        if self.config_path is not None:
            self.config_path.unlink(missing_ok=True)


@contextlib.contextmanager
def store_block_for(kind: str) -> Iterator[str]:
    """The config's `store:` block for a test run on each store: none for "in-process",
    else a dedicated redis-server's, which runs for as long as the block is in use."""
    if kind == "in-process":
        yield ""
        return
    with RedisServer(dedicated=True) as server:
        yield f"store: {{url: '{server.url}'}}"


@contextlib.contextmanager
def gateway_fleet(config_text: str, count: int, **kwargs: Any) -> Iterator[list[GatewayProcess]]:
    """`count` gateway processes of one config (a fleet sharing its store), started in
    parallel; every one is stopped at the end, however the block ends. `kwargs` go to each
    GatewayProcess."""
    gateways = [GatewayProcess(config_text, **kwargs) for _ in range(count)]
    with contextlib.ExitStack() as stack:
        for gateway in gateways:
            stack.callback(gateway.__exit__, None, None, None)
        with concurrent.futures.ThreadPoolExecutor(count) as starting:
            for started in [starting.submit(gateway.start) for gateway in gateways]:
                started.result()
        yield gateways


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 30, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})}, cwd=cwd,
    )


class PeakRss:
    """Samples a process's RSS (`read`, in bytes) from a thread every `interval` seconds
    while entered; `peak` is the largest seen, `samples` how many were taken."""

    def __init__(self, read: Callable[[], int], *, interval: float) -> None:
        self._read = read
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.peak = 0
        self.samples = 0

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._read())
            self.samples += 1
            self._stop.wait(self._interval)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
