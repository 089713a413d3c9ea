"""The `gateway` command and the process it runs: check, run, demo, --version, one-line
errors, uvloop, graceful drain on SIGTERM/SIGINT, the access log, and worker processes."""

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from gateway import __version__
from tests.examples import ALIAS_BOMBS, ISSUE_EXAMPLE
from tests.processes import GatewayProcess, eventually, free_port, run_cli, wait_until
from tests.scrape import until_in_flight

VENV_GATEWAY = Path(sys.executable).parent / "gateway"
DEADLINE = 15.0


def gateway_yaml(upstream: str, extra: str = "", *, listen: str = "127.0.0.1:0", admin: str = "127.0.0.1:0") -> str:
    return (
        f"listen: {listen}\nadmin_listen: {admin}\n{extra}"
        f"routes:\n  - match: {{path: /}}\n    upstream: {upstream}\n"
    )


def write(tmp_path: Path, text: str, name: str = "gw.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


async def metric(client: aiohttp.ClientSession, admin_url: str, name: str) -> float:
    """The sum of a metric's samples (all label sets) from /metrics on the admin listener."""
    async with client.get(admin_url + "/metrics") as response:
        assert response.status == 200
        text = await response.text()
    samples = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if re.match(rf"{name}(\{{| )", line)]
    return sum(samples)


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert result.stdout == ""
    return lines[0]


# --- --version and check ---------------------------------------------------------


def test_version_from_the_console_script_and_python_m():
    script = subprocess.run([str(VENV_GATEWAY), "--version"], capture_output=True, text=True, timeout=30, check=False)
    module = run_cli("--version")
    for result in (script, module):
        assert result.returncode == 0
        assert result.stdout.strip() == f"gateway {__version__}"


def test_check_prints_the_routes_and_limits_it_understood(tmp_path):
    # The reference example, with a password in the store URL that must not be printed.
    path = write(tmp_path, ISSUE_EXAMPLE.replace("redis://127.0.0.1", "redis://:hunter2@127.0.0.1"))
    result = run_cli("check", "-c", path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    assert lines[0] == f"{path}: OK"
    assert "listen 0.0.0.0:8080, admin 127.0.0.1:9090, workers 1, max in flight 1024 per worker, shutdown grace 20s, listen backlog 1024" in lines
    assert "store: redis://:***@127.0.0.1:6379/0 timeout=10ms prefix='rl:'" in lines
    assert "trusted proxies: 10.0.0.0/8" in lines
    assert "hunter2" not in result.stdout
    assert (
        "  per_client: rate 100/minute (1.66667/s), burst 20, key [header:x-api-key, ip], on_store_error open" in lines
    )
    assert "  reports: rate 1/second (1/s), burst 5, key [header:x-api-key], on_store_error closed" in lines
    assert lines[-3:] == [
        "routes (first match wins):",
        (
            "  [0] /api/reports POST -> http://127.0.0.1:9000: per_client (cost 1), reports (cost 2);"
            " timeout connect 5s read 60s"
        ),
        "  [1] / -> http://127.0.0.1:9000: per_client (cost 1); timeout connect 5s read 60s",
    ]


def test_check_prints_a_lease_and_a_response_style_that_are_not_the_defaults(tmp_path):
    text = ISSUE_EXAMPLE.replace(
        "on_store_error: closed}",
        "on_store_error: closed, lease: 4, response: {status: 503, headers: x-ratelimit, body: 'wait {retry_after}'}}",
    )
    result = run_cli("check", "-c", write(tmp_path, text))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert (
        "  reports: rate 1/second (1/s), burst 5, key [header:x-api-key], on_store_error closed, lease 4 (lapse 1s),"
        " response 503 headers x-ratelimit, body text/plain; charset=utf-8"
    ) in lines


def test_check_prints_each_limits_tiers_allowlist_and_the_concurrency_limits(tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text("gold: [k-1]\n")
    text = f"""
store: {{url: "redis://127.0.0.1:6379/0"}}
limits:
  api:
    rate: 2/second
    key: [header:X-API-Key]
    tiers: {{from: {{file: {keys}}}, gold: {{rate: 20/second, burst: 40}}}}
    allow: [10.0.0.0/8, header:X-API-Key=ops]
  conns: {{concurrency: 2, key: header:X-API-Key}}
routes:
  - match: {{path: /}}
    upstream: http://127.0.0.1:9000
    limits: [api, conns]
"""
    result = run_cli("check", "-c", write(tmp_path, text))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    api = lines.index("  api: rate 2/second (2/s), burst 2, key [header:x-api-key], on_store_error open")
    assert lines[api + 1 : api + 3] == [
        "    tier api/gold: rate 20/second (20/s), burst 40",
        "    allow: 1 network(s), 1 identit(ies), never limited",
    ]
    assert "  conns: concurrency 2 in flight, lease_ttl 60s, key [header:x-api-key], on_store_error open" in lines


def test_check_shows_route_options_host_and_the_in_process_store(tmp_path):
    path = write(
        tmp_path,
        "shutdown_grace: 1500ms\n"
        "routes:\n"
        "  - match: {path: /v1, host: api.example.com, methods: [GET, HEAD]}\n"
        "    upstream: https://backend:8443\n"
        "    strip_prefix: true\n"
        "    timeout: {connect: 250ms, read: 2m}\n",
    )
    result = run_cli("check", "-c", path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "listen 0.0.0.0:8080, admin 127.0.0.1:9090, workers 1, max in flight 1024 per worker, shutdown grace 1.5s, listen backlog 1024" in lines
    assert "store: in-process (one process only), 32 MiB, about 43,690 buckets" in lines
    assert "trusted proxies: none (X-Forwarded-For is ignored)" in lines
    assert lines[-1] == (
        "  [0] api.example.com/v1 GET,HEAD -> https://backend:8443: no limits; strip_prefix, timeout connect 0.25s read 120s"
    )


def test_check_warns_of_routes_an_earlier_route_shadows_and_still_exits_0(tmp_path):
    path = write(
        tmp_path,
        "routes:\n"
        "  - match: {path: /api, headers: {X-Version: '2'}}\n    upstream: http://h:1\n"
        "  - match: {path: /api/v2, headers: {X-Version: '2'}, methods: [GET]}\n    upstream: http://h:1\n"
        "  - match: {regex: '/api/v[0-9]+'}\n    upstream: http://h:1\n"
        "  - match: {exact: /api/v1}\n    upstream: http://h:1\n"
        "  - match: {path: /api, host: '*.example.com'}\n    upstream: http://h:1\n"
        "  - match: {path: /api/x, host: a.example.com}\n    upstream: http://h:1\n"
        "    request_headers: {set: {X-Env: prod}, remove: [X-Debug]}\n"
        "    response_headers: {add: {Cache-Control: no-store}}\n",
    )
    result = run_cli("check", "-c", path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    warnings = [line for line in lines if line.startswith("warning:")]
    assert warnings == [
        "warning: routes[1] (/api/v2 GET header:x-version=2) is never reached: routes[0] (/api header:x-version=2) "
        "comes first and matches every request it could",
        "warning: routes[3] (=/api/v1) is never reached: routes[2] (~/api/v[0-9]+) "
        "comes first and matches every request it could",
        "warning: routes[5] (a.example.com/api/x) is never reached: routes[4] (*.example.com/api) "
        "comes first and matches every request it could",
    ]
    assert (
        "  [5] a.example.com/api/x -> http://h:1: no limits; request headers: set X-Env remove x-debug, "
        "response headers: add Cache-Control, timeout connect 5s read 60s"
    ) in lines


def test_check_shows_the_forwarded_headers_setting_and_the_jwt_keys_never_the_secret(tmp_path):
    path = write(
        tmp_path,
        "forwarded_headers: append\n"
        "jwt: {secret_env: JWT_SECRET, issuer: auth.test, on_invalid: reject}\n"
        "limits: {per_user: {rate: 1/second, key: [jwt:sub, ip]}}\n"
        "routes: [{match: {path: /}, upstream: 'http://127.0.0.1:9000', limits: [per_user]}]\n",
    )
    secret = "a-secret-that-is-thirty-two-bytes-long"
    result = run_cli("check", "-c", path, env={"JWT_SECRET": secret})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "forwarded headers: append" in lines
    assert "jwt: HS256 (1 key), issuer 'auth.test', leeway 0s, on_invalid reject" in lines
    assert "  per_user: rate 1/second (1/s), burst 1, key [jwt:sub, ip], on_store_error open" in lines
    assert secret not in result.stdout


def test_check_shows_an_upstream_urls_password_as_stars(tmp_path):
    text = (
        "routes:\n  - match: {path: /}\n    upstream: 'http://svc:${UP_PASS}@127.0.0.1:9000'\n"
        "  - match: {path: /p}\n    upstream: {targets: ['http://svc:${UP_PASS}@127.0.0.1:9001']}\n"
    )
    result = run_cli("check", "-c", write(tmp_path, text), env={"UP_PASS": "s3cr3t"})
    assert result.returncode == 0, result.stderr
    assert "s3cr3t" not in result.stdout + result.stderr
    assert "http://svc:***@127.0.0.1:9000" in result.stdout
    assert "round_robin over http://svc:***@127.0.0.1:9001" in result.stdout


def test_check_interpolates_from_the_environment(tmp_path):
    path = write(tmp_path, gateway_yaml("http://127.0.0.1:9000", listen="${GW_LISTEN:-0.0.0.0:8080}"))
    result = run_cli("check", "-c", path, env={"GW_LISTEN": "127.0.0.1:8181"})
    assert result.returncode == 0, result.stderr
    assert "listen 127.0.0.1:8181," in result.stdout
    assert "store: in-process (one process only)" in result.stdout


def test_check_accepts_the_shipped_configs():
    repo = Path(__file__).resolve().parents[2]
    # The reference config names its files relative to the clone's root, and needs its admin token.
    env = {"REDIS_URL": "redis://127.0.0.1:1/0", "GATEWAY_ADMIN_TOKEN": "0123456789abcdef0123"}
    shipped = ("config/gateway.yaml", "config/demo-redis.yaml", "config/llm-tokens.yaml", "gateway/demo_config.yaml")
    for path in (repo / name for name in shipped):
        result = run_cli("check", "-c", str(path), env=env, cwd=repo)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"{path}: OK")


# --- one-line errors through the real CLI --------------------------------------------

CLI_ERRORS = {
    "malformed YAML": ("check", "routes: [\n", "malformed YAML: line 2"),
    "empty file": ("check", "", "the file is empty"),
    "unknown nested key": ("run", "store: {url: 'redis://127.0.0.1:1/0', timout: 5ms}\nroutes: [{match: {path: /}, upstream: 'http://h:1'}]\n",
        "store.timout: unknown key, did you mean `timeout`?"),
    "undefined limit": (
        "run",
        (
            "routes:\n  - match: {path: /}\n    upstream: http://127.0.0.1:9\n  - match: {path: /x}\n"
            "    upstream: http://127.0.0.1:9\n    limits: [{name: nope}]\n"
        ),
        "routes[1].limits[0].name: no limit named 'nope'",
    ),
    "cost greater than burst": (
        "run",
        (
            "limits:\n  a: {rate: 1/second, burst: 2}\nroutes:\n  - match: {path: /}\n    upstream: http://127.0.0.1:9\n"
            "    limits: [{name: a, cost: 3}]\n"
        ),
        "routes[0].limits[0].cost: cost 3 is greater than the burst 2",
    ),
    "store URL option": (
        "run", "store: {url: 'redis://127.0.0.1:1/0?ssl=true'}\nroutes: [{match: {path: /}, upstream: 'http://h:1'}]\n",
        "store.url: URL option 'ssl' is not supported",
    ),
    "workers with the in-process store": (
        "run", "workers: 4\nroutes: [{match: {path: /}, upstream: 'http://h:1'}]\n", "gw.yaml: workers: 4 needs a shared `store:`; with the in-process store each worker"),
    "missing environment variable": (
        "check", "store: {url: '${GATEWAY_TEST_UNSET_VAR}'}\nroutes: [{match: {path: /}, upstream: 'http://h:1'}]\n",
        "store.url: environment variable GATEWAY_TEST_UNSET_VAR is not set",
    ),
    "a rate whose period reads as inf": (
        "run", "limits:\n  a: {rate: 1/" + "9" * 400 + "s, burst: 1}\nroutes: [{match: {path: /}, upstream: 'http://h:1', limits: [a]}]\n",
        "limits.a.rate: expected a rate whose period is from 0.001ms to 365d"),
    "a denormal rate": (
        "run", "limits:\n  a: {rate: 0." + "0" * 315 + "1/second, burst: 1}\nroutes: [{match: {path: /}, upstream: 'http://h:1', limits: [a]}]\n",
        "limits.a.rate: expected a rate of at least 1/year"),
    "a 400-digit duration": (
        "check", "shutdown_grace: 1" + "0" * 400 + "s\nroutes: [{match: {path: /}, upstream: 'http://h:1'}]\n",
        "shutdown_grace: expected a duration from 0.001ms to 365d"),
    "bad listen address": ("run", "listen: localhost\nroutes: [{match: {path: /}, upstream: 'http://h:1'}]\n", "listen: expected HOST:PORT"),
}


@pytest.mark.parametrize(("command", "text", "expected"), CLI_ERRORS.values(), ids=CLI_ERRORS.keys())
def test_invalid_config_exits_2_with_one_line_naming_file_and_path(tmp_path, command, text, expected):
    path = write(tmp_path, text)
    line = assert_one_line_error(run_cli(command, "-c", path), expected)
    assert line.startswith(f"gateway: {path}: ")


@pytest.mark.parametrize("command", ["check", "run"])
@pytest.mark.parametrize("text", ALIAS_BOMBS.values(), ids=ALIAS_BOMBS.keys())
def test_an_alias_bomb_exits_2_with_one_line(tmp_path, command, text):
    assert_one_line_error(run_cli(command, "-c", write(tmp_path, text)), "aliases expand the document by more than")


@pytest.mark.parametrize("command", ["check", "run"])
def test_missing_config_file_exits_2_with_one_line(tmp_path, command):
    path = str(tmp_path / "absent.yaml")
    assert_one_line_error(run_cli(command, "-c", path), f"gateway: {path}: cannot read: No such file or directory")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((), "the following arguments are required: command"),
        (("run",), "the following arguments are required: -c/--config"),
        (("serve",), "invalid choice: 'serve'"),
        (("run", "-c", "x.yaml", "--access-log", "xml"), "invalid choice: 'xml'"),
    ],
)
def test_usage_errors_are_one_line_too(args, expected):
    assert_one_line_error(run_cli(*args), expected)


# Presses Ctrl-C (a real SIGINT to itself) the moment the gateway first imports MODULE,
# then runs the console script's `main`, as the `gateway` command does.
CTRL_C_ON_IMPORT = """
import os, signal, sys

signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even if started in the background

MODULE = sys.argv.pop(1)

class CtrlC:
    def find_spec(self, name, path=None, target=None):
        if name == MODULE:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, CtrlC())
from gateway.cli import main
raise SystemExit(main())
"""


@pytest.mark.parametrize("module", ["yaml", "aiohttp"], ids=["reading the config", "importing the server"])
def test_ctrl_c_during_startup_ends_quietly_with_130(tmp_path, module):
    path = write(tmp_path, gateway_yaml("http://127.0.0.1:9"))
    result = subprocess.run(
        [sys.executable, "-c", CTRL_C_ON_IMPORT, module, "run", "-c", path],
        capture_output=True, text=True, timeout=DEADLINE,
    )
    assert (result.returncode, result.stderr, result.stdout) == (130, "", "")


def test_port_in_use_exits_2_with_one_line(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        path = write(tmp_path, gateway_yaml("http://127.0.0.1:9", listen=f"127.0.0.1:{port}"))
        assert_one_line_error(run_cli("run", "-c", path), f"gateway: cannot listen on 127.0.0.1:{port}: Address already in use")


def test_workers_refuse_a_port_held_by_another_reuse_port_socket(tmp_path):
    # SO_REUSEPORT would let the workers share the port with a stranger's socket silently.
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        text = gateway_yaml("http://127.0.0.1:9", "workers: 2\nstore: {url: 'redis://127.0.0.1:1/0'}\n",
                            listen=f"127.0.0.1:{port}", admin=f"127.0.0.1:{free_port()}")
        path = write(tmp_path, text)
        assert_one_line_error(run_cli("run", "-c", path), f"cannot listen on 127.0.0.1:{port}: Address already in use")


def test_demo_with_a_bad_upstream_address_exits_2_with_one_line(tmp_path):
    path = write(tmp_path, gateway_yaml("http://127.0.0.1:9"))
    assert_one_line_error(run_cli("demo", "-c", path, "--upstream", "nowhere"), "gateway: --upstream: expected HOST:PORT")


def test_demo_with_its_upstream_port_in_use_exits_2_with_one_line(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        path = write(tmp_path, gateway_yaml(f"http://127.0.0.1:{port}"))
        assert_one_line_error(
            run_cli("demo", "-c", path, "--upstream", f"127.0.0.1:{port}"),
            f"gateway: cannot start the demo upstream on 127.0.0.1:{port}: Address already in use",
        )


# --- the running process -------------------------------------------------------------


def test_run_serves_on_uvloop_and_says_so(tmp_path):
    with GatewayProcess(gateway_yaml("http://127.0.0.1:9")) as gw:
        startup = next(line for line in gw.stderr_lines if "listening on" in line)
        assert "event loop: uvloop" in startup
        assert f"(pid {gw.process.pid})" in startup
        assert gw.stop() == 0
    assert any(line.rstrip().endswith("gateway: stopped") for line in gw.stderr_lines)
    assert not any("Traceback" in line for line in gw.stderr_lines)


@contextlib.asynccontextmanager
async def gated_upstream():
    """An upstream whose /gate requests wait until the test opens the gate."""
    entered, gate = asyncio.Event(), asyncio.Event()

    async def held(_: web.Request) -> web.Response:
        entered.set()
        await gate.wait()
        return web.Response(text="released")

    app = web.Application()
    app.router.add_get("/gate", held)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", entered, gate
    finally:
        gate.set()
        await runner.cleanup()


async def fetch(client: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with client.get(url) as response:
        return response.status, await response.text()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_signal_drains_the_in_flight_request_then_exits_0(signum):
    async with gated_upstream() as (upstream, entered, gate):
        with GatewayProcess(gateway_yaml(upstream, "shutdown_grace: 10s\n")) as gw:
            async with aiohttp.ClientSession() as client:
                request = asyncio.create_task(fetch(client, gw.url + "/gate"))
                await asyncio.wait_for(entered.wait(), DEADLINE)
                gw.signal(signum)

                async def draining() -> bool:
                    return any("draining in-flight requests" in line for line in gw.stderr_lines)

                await eventually(draining, what="the gateway to start draining")

                async def refuses_new_connections() -> bool:
                    try:
                        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as fresh:
                            await fetch(fresh, gw.url + "/gate")
                    except aiohttp.ClientConnectionError:
                        return True
                    except TimeoutError:
                        return False  # accepted and held at the gate: the listener was still open
                    return False

                # Draining: the listener is closed, while the held request is still open.
                await eventually(refuses_new_connections, what="the listener to close")
                assert not request.done()
                assert gw.process.poll() is None
                gate.set()
                assert await asyncio.wait_for(request, DEADLINE) == (200, "released")
                assert await asyncio.to_thread(gw.wait, DEADLINE) == 0
    assert not any("Traceback" in line for line in gw.stderr_lines)


async def test_sigterm_lets_a_slow_request_finish(upstream):
    with GatewayProcess(gateway_yaml(upstream, "shutdown_grace: 10s\n")) as gw:
        async with aiohttp.ClientSession() as client:
            request = asyncio.create_task(fetch(client, gw.url + "/slow?seconds=1"))
            await until_in_flight(client, gw.admin_url)
            gw.signal(signal.SIGTERM)
            assert await asyncio.wait_for(request, DEADLINE) == (200, "slow")
            assert await asyncio.to_thread(gw.wait, DEADLINE) == 0


async def test_request_slower_than_the_grace_is_cut_and_the_process_still_exits_0_promptly(upstream):
    with GatewayProcess(gateway_yaml(upstream, "shutdown_grace: 300ms\n")) as gw:
        async with aiohttp.ClientSession() as client:
            request = asyncio.create_task(fetch(client, gw.url + "/slow?seconds=30"))
            await until_in_flight(client, gw.admin_url)
            gw.signal(signal.SIGTERM)
            status = await asyncio.to_thread(gw.wait, DEADLINE)
            # The process is gone while the upstream's 30 s answer is still being written:
            # the drain waited out the grace once, then cut the request.
            cut_before_answered = not request.done() or request.exception() is not None
            outcome = await asyncio.gather(asyncio.wait_for(request, DEADLINE), return_exceptions=True)
    assert status == 0
    assert cut_before_answered
    assert isinstance(outcome[0], aiohttp.ClientError) or outcome[0][0] != 200, outcome


# --- the access log ------------------------------------------------------------------


async def make_requests(gw: GatewayProcess, *paths: str) -> list[int]:
    statuses = []
    async with aiohttp.ClientSession() as client:
        for path in paths:
            async with client.get(gw.url + path) as response:
                await response.read()
                statuses.append(response.status)
    return statuses


async def test_access_log_is_off_by_default(upstream):
    with GatewayProcess(gateway_yaml(upstream)) as gw:
        assert await make_requests(gw, "/echo/quiet-one", "/status/404") == [200, 404]
        assert await asyncio.to_thread(gw.stop) == 0
    output = gw.stdout_lines + gw.stderr_lines
    assert any("gateway: stopped" in line for line in output)  # the output was read to the end
    assert not any("quiet-one" in line or "/status/404" in line for line in output), output


async def test_access_log_text_gives_one_line_per_request(upstream):
    with GatewayProcess(gateway_yaml(upstream), args=("--access-log",)) as gw:
        assert await make_requests(gw, "/echo/one?x=1", "/status/404") == [200, 404]
        assert await asyncio.to_thread(gw.stop) == 0
    assert len(gw.stdout_lines) == 2, gw.stdout_lines
    first, second = gw.stdout_lines
    assert '"GET /echo/one?x=***" 200 ' in first  # query values are never logged
    assert '"GET /status/404" 404 ' in second
    assert not any("/echo/one" in line for line in gw.stderr_lines)


async def test_access_log_json_gives_one_object_per_line(upstream):
    with GatewayProcess(gateway_yaml(upstream), args=("--access-log", "json")) as gw:
        assert await make_requests(gw, "/echo/one", "/status/503", "/echo/two") == [200, 503, 200]
        assert await asyncio.to_thread(gw.stop) == 0
    records = [json.loads(line) for line in gw.stdout_lines]
    assert [(r["method"], r["path"], r["status"]) for r in records] == [
        ("GET", "/echo/one", 200), ("GET", "/status/503", 503), ("GET", "/echo/two", 200)
    ]
    assert all(r["remote"] == "127.0.0.1" and r["duration_ms"] >= 0 for r in records)


# --- worker processes ----------------------------------------------------------------


def listening_socket_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # 0A: LISTEN
                    inodes.add(fields[9])
    return inodes


def socket_inodes_of(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    return inodes


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return int(next(line for line in status if line.startswith("PPid:")).split()[1])


async def test_two_workers_share_the_port_share_metrics_and_stop_on_sigterm(upstream, redis_server):
    port, admin_port = free_port(), free_port()
    text = gateway_yaml(
        upstream,
        f"workers: 2\nstore: {{url: '{redis_server.url}'}}\n"
        "limits:\n  per_client: {rate: 1/minute, burst: 5, key: [ip]}\n",
        listen=f"127.0.0.1:{port}", admin=f"127.0.0.1:{admin_port}",
    ) + "    limits: [per_client]\n"
    with GatewayProcess(text) as gw:

        def startup_pids() -> list[int]:
            return [int(m.group(1)) for line in gw.stderr_lines if (m := re.search(r"\(pid (\d+)\) listening on", line))]

        async def both_started() -> bool:
            return len(startup_pids()) == 2

        await eventually(both_started, what="two workers to start")
        workers = startup_pids()
        assert len(set(workers)) == 2 and gw.process.pid not in workers
        assert all(parent_of(pid) == gw.process.pid for pid in workers)
        assert all(f"listening on http://127.0.0.1:{port} " in line for line in gw.stderr_lines if "listening on" in line)
        # SO_REUSEPORT: two listening sockets on the one port, one in each worker.
        listening = listening_socket_inodes(port)
        assert len(listening) == 2
        assert all(len(socket_inodes_of(pid) & listening) == 1 for pid in workers)

        # A new connection per request, so the kernel spreads them over both workers;
        # the bucket lives in Redis, so the limit holds across them.
        statuses = []
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as client:
            for _ in range(8):
                async with client.get(gw.url + "/echo") as response:
                    statuses.append(response.status)
            assert statuses == [200] * 5 + [429] * 3
            # Whichever worker answers /metrics counts every worker's requests.
            for _ in range(4):
                assert await metric(client, gw.admin_url, "gateway_requests_total") == 8
        gw.signal(signal.SIGTERM)
        assert await asyncio.to_thread(gw.wait, DEADLINE) == 0
    for pid in workers:
        assert not Path(f"/proc/{pid}").exists() or parent_of(pid) != gw.process.pid
    assert not any("Traceback" in line for line in gw.stderr_lines)


async def test_every_worker_shows_a_client_by_the_same_hash_in_buckets_and_top_limited(upstream, redis_server):
    # Each answer comes from whichever worker the connection reaches: a hash keyed per
    # worker would show one client under as many names as there are workers.
    text = gateway_yaml(
        upstream,
        f"workers: 2\nstore: {{url: '{redis_server.url}'}}\n"
        "limits:\n  per_client: {rate: 1/hour, burst: 1, key: [ip]}\n",
        listen=f"127.0.0.1:{free_port()}", admin=f"127.0.0.1:{free_port()}",
    ) + "    limits: [per_client]\n"
    with GatewayProcess(text) as gw:
        await eventually(lambda: sum("listening on" in line for line in gw.stderr_lines) == 2, what="two workers to start")
        shown = set()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as client:
            for _ in range(12):  # denied on both workers
                async with client.get(gw.url + "/echo") as response:
                    await response.read()
            for _ in range(12):
                async with client.get(gw.admin_url + "/buckets/per_client?value=127.0.0.1") as response:
                    shown.add((await response.json())["identity"])
                async with client.get(gw.admin_url + "/top-limited") as response:
                    shown.update(entry["identity"] for entry in (await response.json())["clients"])
        assert len(shown) == 1, shown
        assert gw.stop() == 0


def test_workers_whose_supervisor_was_killed_stop_and_free_the_ports(redis_server, tmp_path):
    # SIGKILL (or the OOM killer) passes nothing on: the workers notice their parent is
    # gone and stop, rather than serving on, orphaned, on ports the next run needs. The
    # supervisor cannot remove its metrics directory then: TMPDIR puts it in tmp_path.
    port, admin_port = free_port(), free_port()
    text = gateway_yaml(
        "http://127.0.0.1:9", f"workers: 2\nstore: {{url: '{redis_server.url}'}}\n",
        listen=f"127.0.0.1:{port}", admin=f"127.0.0.1:{admin_port}",
    )
    with GatewayProcess(text, env={"TMPDIR": str(tmp_path)}) as gw:

        def startup_pids() -> list[int]:
            return [int(m.group(1)) for line in gw.stderr_lines if (m := re.search(r"\(pid (\d+)\) listening on", line))]

        wait_until(lambda: len(startup_pids()) == 2, what="two workers to start")
        workers = startup_pids()
        gw.signal(signal.SIGKILL)
        gw.wait(DEADLINE)
        wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in workers), what="the orphaned workers to exit")
        wait_until(lambda: not listening_socket_inodes(port) and not listening_socket_inodes(admin_port),
                   what="the ports to be free")
    assert sum("the supervisor" in line and "is gone: stopping" in line for line in gw.stderr_lines) == 2
    # The killed supervisor's metrics directory is left; the next supervisor removes it, and
    # its own on a clean stop. Another live supervisor's is not touched.
    left = [path.name for path in tmp_path.glob("gateway-metrics-*")]
    assert left == [f"gateway-metrics-{gw.process.pid}-" + left[0].rsplit("-", 1)[1]]
    other = tmp_path / f"gateway-metrics-{os.getpid()}-live"
    other.mkdir()
    with GatewayProcess(text, env={"TMPDIR": str(tmp_path)}) as again:
        wait_until(lambda: sum("listening on" in line for line in again.stderr_lines) == 2, what="two workers to start")
        mine = [path.name for path in tmp_path.glob("gateway-metrics-*") if path != other]
        assert len(mine) == 1 and mine[0].startswith(f"gateway-metrics-{again.process.pid}-")
        assert again.stop() == 0
    assert [path.name for path in tmp_path.glob("gateway-metrics-*")] == [other.name]


# --- the quick start -----------------------------------------------------------------


async def test_demo_serves_the_demo_upstream_until_429_with_ratelimit_headers(tmp_path):
    upstream_port = free_port()
    text = gateway_yaml(
        f"http://127.0.0.1:{upstream_port}",
        "limits:\n  per_client: {rate: 10/minute, burst: 3, key: [header:X-API-Key, ip]}\n",
    ) + "    limits: [per_client]\n"
    with GatewayProcess(text, command="demo", args=("--upstream", f"127.0.0.1:{upstream_port}")) as gw:
        assert any("event loop: uvloop" in line for line in gw.stderr_lines)
        results = []
        async with aiohttp.ClientSession() as client:
            for _ in range(4):
                async with client.get(gw.url + "/api/things", headers={"X-API-Key": "demo"}) as response:
                    results.append((response.status, dict(response.headers), await response.read()))
            # Another client has its own bucket.
            async with client.post(gw.url + "/api/reports", data=b"abc", headers={"X-API-Key": "other"}) as response:
                assert response.status == 202
                assert await response.json() == {"report": "queued", "bytes": 3}
        assert [status for status, _, _ in results] == [200, 200, 200, 429]
        assert json.loads(results[0][2]) == {"hello": "world", "path": "/api/things"}
        for _, headers, _ in results:
            assert headers["RateLimit-Policy"] == '"per_client";q=3;w=18'
            assert headers["RateLimit"].startswith('"per_client";r=')
        assert results[0][1]["RateLimit"].startswith('"per_client";r=2;')
        assert results[3][1]["RateLimit"].startswith('"per_client";r=0;')
        assert int(results[3][1]["Retry-After"]) >= 1
        assert await asyncio.to_thread(gw.stop) == 0


async def test_demo_with_its_upstream_moved_proxies_to_it_with_the_shipped_config():
    """`gateway demo --upstream HOST:PORT` on its shipped config: the gateway follows the
    demo upstream to its new port (it proxied to 127.0.0.1:9000 regardless, so every
    request was a 502), and the listeners move with GATEWAY_LISTEN / GATEWAY_ADMIN_LISTEN."""
    ports = {"GATEWAY_LISTEN": "127.0.0.1:0", "GATEWAY_ADMIN_LISTEN": "127.0.0.1:0"}
    upstream = f"127.0.0.1:{free_port()}"
    with GatewayProcess(None, command="demo", args=("--upstream", upstream), env=ports) as gw:
        async with aiohttp.ClientSession() as client:
            async with client.get(gw.url + "/hello") as response:
                assert response.status == 200, await response.text()
                assert await response.json() == {"hello": "world", "path": "/hello"}
                assert response.headers["RateLimit-Policy"] == '"per_client";q=5;w=30'
        assert await asyncio.to_thread(gw.stop) == 0


def test_a_crashed_worker_stops_the_others_and_the_gateway_exits_1(redis_server):
    text = gateway_yaml(
        "http://127.0.0.1:9", f"workers: 2\nstore: {{url: '{redis_server.url}'}}\n",
        listen=f"127.0.0.1:{free_port()}", admin=f"127.0.0.1:{free_port()}",
    )
    with GatewayProcess(text) as gw:

        def startup_pids() -> list[int]:
            return [int(m.group(1)) for line in gw.stderr_lines if (m := re.search(r"\(pid (\d+)\) listening on", line))]

        wait_until(lambda: len(startup_pids()) == 2, what="two workers to start")
        crashed, survivor = startup_pids()
        os.kill(crashed, signal.SIGKILL)
        assert gw.wait(DEADLINE) == 1
        assert gw.stop() == 1
    assert any(f"exited with -{signal.SIGKILL.value}; stopping" in line for line in gw.stderr_lines), gw.stderr_lines
    assert not Path(f"/proc/{survivor}").exists() or parent_of(survivor) != gw.process.pid
