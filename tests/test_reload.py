"""Hot reload and the process's life: SIGHUP reloads (or keeps the old config when
the new one is bad), the shutdown grace is honoured, /readyz drops out while
draining, and `gateway check` into a closed pipe. Each test runs the gateway as a
user does, against real upstreams and a real redis-server."""

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from tests.processes import GatewayProcess, RedisServer, eventually, free_port
from tests.test_cli import DEADLINE, metric

RELOADED = "config reloaded from"


def limited_yaml(
    upstream: str, *, burst: int, extra: str = "", second_route: bool = False, listen: str = "127.0.0.1:0",
    admin: str = "127.0.0.1:0",
) -> str:
    """One route limited by `per_ip`, burst `burst` refilling once an hour, so nothing refills in a test."""
    other = f"  - match: {{path: /echo/other}}\n    upstream: {upstream}\n" if second_route else ""
    return (
        f"listen: {listen}\nadmin_listen: {admin}\n{extra}"
        f"limits:\n  per_ip: {{rate: 1/hour, burst: {burst}, key: [ip]}}\n"
        f"routes:\n{other}  - match: {{path: /}}\n    upstream: {upstream}\n    limits: [per_ip]\n"
    )


async def status(client: aiohttp.ClientSession, url: str) -> int:
    async with client.get(url) as response:
        await response.read()
        return response.status


def count(gw: GatewayProcess, fragment: str) -> int:
    return sum(fragment in line for line in gw.stderr_lines)


async def reload_with(gw: GatewayProcess, text: str, fragment: str) -> None:
    """Write `text` as the config, send SIGHUP, and wait for one more log line with `fragment`."""
    before = count(gw, fragment)
    gw.config_path.write_text(text)
    gw.signal(signal.SIGHUP)
    await eventually(lambda: count(gw, fragment) > before, what=f"a log line with {fragment!r}")


# --- §1 hot reload -----------------------------------------------------------------------


async def test_sighup_reloads_a_changed_limit_and_the_process_keeps_serving(upstream):
    with GatewayProcess(limited_yaml(upstream, burst=1)) as gw:
        async with aiohttp.ClientSession() as client:
            assert await status(client, gw.url + "/echo") == 200
            assert await status(client, gw.url + "/echo") == 429
            assert await metric(client, gw.admin_url, "gateway_config_last_reload_success_timestamp") == 0
            started = time.time()
            # A changed limit is a new bucket: burst 5 from a full bucket.
            await reload_with(gw, limited_yaml(upstream, burst=5).replace("per_ip", "per_client"), RELOADED)
            assert gw.process.poll() is None
            assert [await status(client, gw.url + "/echo") for _ in range(6)] == [200] * 5 + [429]
            assert await metric(client, gw.admin_url, "gateway_config_last_reload_success_timestamp") >= int(started)
            assert await metric(client, gw.admin_url, "gateway_config_reload_failures_total") == 0
            # The admin API answers from the new config too.
            async with client.get(gw.admin_url + "/buckets/per_client?source=ip&value=127.0.0.1") as response:
                assert response.status == 200, await response.text()
                assert (await response.json())["capacity"] == 5
            async with client.get(gw.admin_url + "/buckets/per_ip?source=ip&value=127.0.0.1") as response:
                assert response.status == 404
            async with client.get(gw.admin_url + "/config") as response:
                assert [limit["name"] for limit in (await response.json())["limits"]] == ["per_client"]


async def test_a_bad_config_on_sighup_keeps_the_old_one_logs_one_line_and_counts_a_failure(upstream):
    with GatewayProcess(limited_yaml(upstream, burst=2)) as gw:
        async with aiohttp.ClientSession() as client:
            assert await status(client, gw.url + "/echo") == 200
            lines_before = len(gw.stderr_lines)
            await reload_with(gw, "routes: [{match: {path: /}, upstream: 'not a url'}]\n", "config reload failed")
            failed = [line for line in gw.stderr_lines[lines_before:] if "reload" in line]
            assert len(failed) == 1, failed
            assert str(gw.config_path) in failed[0]
            assert not any("Traceback" in line for line in gw.stderr_lines)
            # The old config still serves, its bucket where it was: one token left of two.
            assert await status(client, gw.url + "/echo") == 200
            assert await status(client, gw.url + "/echo") == 429
            assert await metric(client, gw.admin_url, "gateway_config_reload_failures_total") == 1
            assert await metric(client, gw.admin_url, "gateway_config_last_reload_success_timestamp") == 0


async def test_an_unchanged_limit_keeps_its_bucket_across_a_reload(upstream):
    with GatewayProcess(limited_yaml(upstream, burst=2)) as gw:
        async with aiohttp.ClientSession() as client:
            assert [await status(client, gw.url + "/echo") for _ in range(3)] == [200, 200, 429]
            await reload_with(gw, limited_yaml(upstream, burst=2, second_route=True), RELOADED)
            assert await status(client, gw.url + "/echo/other") == 200  # the new route serves
            assert await status(client, gw.url + "/echo") == 429  # the unchanged limit's bucket is still empty


async def test_a_request_in_flight_finishes_on_the_config_it_started_with(upstream):
    with GatewayProcess(limited_yaml(upstream, burst=5)) as gw:
        async with aiohttp.ClientSession() as client:
            slow = asyncio.create_task(status(client, gw.url + "/slow?seconds=1"))

            async def in_flight() -> bool:
                return await metric(client, gw.admin_url, "gateway_requests_in_flight") == 1

            await eventually(in_flight, what="the request to be in flight")
            # The new config sends / nowhere: a request that started before still reaches the upstream.
            await reload_with(gw, limited_yaml("http://127.0.0.1:9", burst=5), RELOADED)
            assert await asyncio.wait_for(slow, DEADLINE) == 200
            assert await status(client, gw.url + "/echo") == 502


async def test_every_worker_reloads_on_sighup(upstream, redis_server):
    listen = {
        "extra": f"workers: 2\nstore: {{url: '{redis_server.url}'}}\n",
        "listen": f"127.0.0.1:{free_port()}",
        "admin": f"127.0.0.1:{free_port()}",
    }
    with GatewayProcess(limited_yaml(upstream, burst=1, **listen)) as gw:
        await eventually(lambda: count(gw, "listening on") == 2, what="both workers to listen")
        await reload_with(gw, limited_yaml(upstream, burst=1, second_route=True, **listen), RELOADED)
        await eventually(lambda: count(gw, RELOADED) == 2, what="both workers to reload")
        assert gw.process.poll() is None
        # Fresh connections land on either worker; every one serves the new route.
        for _ in range(10):
            async with aiohttp.ClientSession() as fresh:
                assert await status(fresh, gw.url + "/echo/other") == 200


async def test_watch_reloads_when_the_file_changes(upstream):
    with GatewayProcess(limited_yaml(upstream, burst=1), args=("--watch",)) as gw:
        async with aiohttp.ClientSession() as client:
            assert [await status(client, gw.url + "/echo") for _ in range(2)] == [200, 429]
            gw.config_path.write_text(limited_yaml(upstream, burst=1, second_route=True))
            await eventually(lambda: count(gw, RELOADED) == 1, what="the changed file to be reloaded")
            assert await status(client, gw.url + "/echo/other") == 200


# --- §7 shutdown ---------------------------------------------------------------------------


async def test_sigterm_exits_within_the_grace_with_a_slow_request_in_flight(upstream):
    grace = 2.0
    with GatewayProcess(limited_yaml(upstream, burst=5, extra=f"shutdown_grace: {grace:g}s\n")) as gw:
        async with aiohttp.ClientSession() as client:
            request = asyncio.create_task(status(client, gw.url + "/slow?seconds=30"))

            async def in_flight() -> bool:
                return await metric(client, gw.admin_url, "gateway_requests_in_flight") == 1

            await eventually(in_flight, what="the request to be in flight")
            signalled = time.monotonic()
            gw.signal(signal.SIGTERM)

            async def not_ready() -> bool:
                try:
                    return await status(client, gw.admin_url + "/readyz") == 503
                except aiohttp.ClientConnectionError:
                    return False

            # Load balancers are told at once, while the request is still being served.
            await eventually(not_ready, what="/readyz to answer 503 while draining", deadline=grace)
            assert gw.process.poll() is None
            code = await asyncio.to_thread(gw.wait, DEADLINE)
            elapsed = time.monotonic() - signalled
            await asyncio.gather(request, return_exceptions=True)
    assert code == 0
    assert grace <= elapsed < grace + 1.0, elapsed


def test_check_into_a_pipe_closed_early_prints_no_traceback(tmp_path):
    path = tmp_path / "gw.yaml"
    # More routes than a pipe buffers (64 KiB), so the rest surely meets a closed pipe.
    routes = "".join(f"  - match: {{path: /r{i}}}\n    upstream: http://127.0.0.1:9\n" for i in range(2000))
    path.write_text(f"routes:\n{routes}")
    # `gateway check -c F | head -1`: head exits after one line.
    result = subprocess.run(
        f"{sys.executable} -m gateway check -c {path} | head -1", shell=True, capture_output=True, text=True,
        timeout=DEADLINE,
    )
    assert result.stdout.endswith(": OK\n"), result.stdout
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, result.stderr


async def test_the_readme_step_more_gateways_against_the_same_redis_shares_the_counts(redis_server):
    """README, "Quick start with Redis": the demo, then a second gateway started with the
    README's own command (other ports, the demo's upstream), sharing one budget."""
    config = (Path(__file__).resolve().parent.parent / "config" / "demo-redis.yaml").read_text()
    upstream = f"127.0.0.1:{free_port()}"
    env = {"REDIS_URL": redis_server.url, "DEMO_UPSTREAM": upstream}
    ports = {"GATEWAY_LISTEN": "127.0.0.1:0", "GATEWAY_ADMIN_LISTEN": "127.0.0.1:0"}
    first = GatewayProcess(config, command="demo", args=("--upstream", upstream), env={**env, **ports})
    second = GatewayProcess(config, env={**env, **ports})
    with first, second:
        headers = {"X-API-Key": "shared"}
        async with aiohttp.ClientSession(headers=headers) as client:
            seen = [await status(client, gw.url + "/api/hello") for gw in (first, second, first, second, first, second)]
    assert seen == [200] * 5 + [429], seen  # burst 5, one budget across both


# --- §7 a store that refuses us ---------------------------------------------------------------


def wrong_password_store(redis: RedisServer, extra: str = "") -> str:
    return f"store: {{url: '{redis.url.replace('redis://', 'redis://:wrong@')}'{extra}}}\n"


async def test_a_store_that_refuses_our_password_is_not_ready_and_the_log_says_why(upstream):
    with RedisServer("--requirepass", "right-password", password="right-password") as redis:
        with GatewayProcess(limited_yaml(upstream, burst=5, extra=wrong_password_store(redis))) as gw:
            async with aiohttp.ClientSession() as client:
                async with client.get(gw.admin_url + "/readyz") as response:
                    body = await response.json()
                    assert response.status == 503, body
            assert body["store_state"] == "refused", body
            assert "WRONGPASS" in body["detail"], body
            assert count(gw, "store refuses the gateway") == 1, gw.stderr_lines
            assert not any("Traceback" in line for line in gw.stderr_lines)


def test_store_required_refuses_to_start_while_the_store_is_unreachable(tmp_path):
    with RedisServer("--requirepass", "right-password", password="right-password") as redis:
        path = tmp_path / "gw.yaml"
        path.write_text(limited_yaml("http://127.0.0.1:9", burst=5, extra=wrong_password_store(redis, ", required: true")))
        result = subprocess.run(
            [sys.executable, "-m", "gateway", "run", "-c", str(path)], capture_output=True, text=True, timeout=DEADLINE
        )
    assert result.returncode == 2, result
    errors = [line for line in result.stderr.splitlines() if line.startswith("gateway:")]
    assert len(errors) == 1 and "store.required" in errors[0] and "WRONGPASS" in errors[0], result.stderr
    assert "Traceback" not in result.stderr
