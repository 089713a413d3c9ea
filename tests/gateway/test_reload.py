"""Hot reload and the process's life: SIGHUP reloads (or keeps the old config when
the new one is bad), the shutdown grace is honoured, /readyz drops out while
draining, and `gateway check` into a closed pipe. Each test runs the gateway as a
user does, against real upstreams and a real redis-server."""

import asyncio
import gc
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from gateway.config import load_config
from gateway.testing import running_gateway
from gateway.upstream.client import UpstreamClient
from tests.examples import ALIAS_BOMBS
from tests.gateway.test_cli import DEADLINE, metric
from tests.helpers import script_calls
from tests.processes import GatewayProcess, RedisServer, eventually, free_port
from tests.scrape import until_in_flight
from tests.upstream import running_upstream

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
                assert list((await response.json())["config"]["limits"]) == ["per_client"]


async def test_a_reload_names_the_settings_that_wait_for_a_restart_by_their_yaml_keys(upstream):
    """The warning named the config's attributes ("clients", "admin_token", "listen_tls"),
    which no one can find in their file; it names the keys they wrote."""
    restart_only = "admin_token_env: GW_RELOAD_TOKEN\nkeepalive_timeout: 30s\nmax_header_size: 64KiB\n"
    with GatewayProcess(limited_yaml(upstream, burst=2), env={"GW_RELOAD_TOKEN": "t" * 20}) as gw:
        await reload_with(gw, limited_yaml(upstream, burst=2, extra=restart_only), "only at restart")
        warned = [line for line in gw.stderr_lines if "only at restart" in line]
        assert warned[0].rstrip().endswith(
            "changed settings that take effect only at restart: admin_token_env, keepalive_timeout, max_header_size"
        ), warned


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


async def test_a_config_with_two_mistakes_on_sighup_logs_both_in_one_line(upstream):
    bad = "routes: [{match: {path: /}, upstream: 'not a url'}, {match: {path: /b}, upstrem: 'http://h:1'}]\n"
    with GatewayProcess(limited_yaml(upstream, burst=2)) as gw:
        lines_before = len(gw.stderr_lines)
        await reload_with(gw, bad, "config reload failed")
        failed = [line for line in gw.stderr_lines[lines_before:] if str(gw.config_path) in line]
        assert len(failed) == 1, failed
        assert ": routes[0].upstream: " in failed[0] and "; " in failed[0], failed
        assert failed[0].rstrip("\n").endswith(f"{gw.config_path}: routes[1].upstrem: unknown key, did you mean `upstream`? " + (
            "(expected one of: match, upstream, limits, strip_prefix, preserve_host, allow_path_parameters, timeout, "
            "max_body_size, request_headers, response_headers)"
        )), failed


async def refused_on_sighup(upstream: str, bad: str, logged: str) -> None:
    """A reload to `bad` fails with `logged` in the log and no traceback; the old config
    (burst 2, one token spent before the reload) serves on and the failure is counted."""
    with GatewayProcess(limited_yaml(upstream, burst=2)) as gw:
        async with aiohttp.ClientSession() as client:
            assert await status(client, gw.url + "/echo") == 200
            await reload_with(gw, bad, "config reload failed")
            assert any(logged in line for line in gw.stderr_lines)
            assert not any("Traceback" in line for line in gw.stderr_lines)
            assert await status(client, gw.url + "/echo") == 200
            assert await status(client, gw.url + "/echo") == 429
            assert await metric(client, gw.admin_url, "gateway_config_reload_failures_total") == 1


async def test_an_alias_bomb_on_sighup_is_refused_in_one_line_and_the_old_config_serves_on(upstream):
    await refused_on_sighup(upstream, ALIAS_BOMBS["eight levels"], "aliases expand the document by more than")


async def test_a_rate_outside_its_range_on_sighup_is_refused_in_one_line_and_counted(upstream):
    """A rate whose period reads as inf once made every plan's refill time a ZeroDivisionError:
    the reload logged a traceback and counted no failure."""
    bad = limited_yaml(upstream, burst=2).replace("rate: 1/hour", "rate: 1/" + "9" * 400 + "s")
    await refused_on_sighup(upstream, bad, "per_ip.rate: expected a rate whose period is")


async def test_an_unchanged_limit_keeps_its_bucket_across_a_reload(upstream):
    with GatewayProcess(limited_yaml(upstream, burst=2)) as gw:
        async with aiohttp.ClientSession() as client:
            assert [await status(client, gw.url + "/echo") for _ in range(3)] == [200, 200, 429]
            await reload_with(gw, limited_yaml(upstream, burst=2, second_route=True), RELOADED)
            assert await status(client, gw.url + "/echo/other") == 200  # the new route serves
            assert await status(client, gw.url + "/echo") == 429  # the unchanged limit's bucket is still empty


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_a_limit_whose_rate_a_reload_changes_is_charged_at_the_new_rate(upstream, store, request):
    """Its bucket is kept (same name), and the plans each reload compiles carry the new rate's
    script arguments: empty at 1/hour, it is full again at once at a million a second, and its
    RateLimit field counts from the new burst; back at 1/hour, it refills no more."""
    extra = f"store: {{url: '{request.getfixturevalue('redis_server').url}'}}\n" if store == "redis" else ""
    with GatewayProcess(limited_yaml(upstream, burst=2, extra=extra)) as gw:
        async with aiohttp.ClientSession() as client:
            assert [await status(client, gw.url + "/echo") for _ in range(3)] == [200, 200, 429]
            faster = limited_yaml(upstream, burst=3, extra=extra).replace("1/hour", "1000000/second")
            await reload_with(gw, faster, RELOADED)
            # Refilled within the reload (3 tokens take 3 µs at the new rate): 2 left after this one.
            async with client.get(gw.url + "/echo") as response:
                assert response.status == 200
                assert response.headers["RateLimit"].startswith('"per_ip";r=2;')
            await reload_with(gw, limited_yaml(upstream, burst=3, extra=extra), RELOADED)
            # Back at 1/hour: the 2 tokens left, refilled by nothing to speak of since.
            assert [await status(client, gw.url + "/echo") for _ in range(3)] == [200, 200, 429]


def reload_config(upstream: str, redis_url: str, *, denied_burst: int = 1, leased_burst: int = 100, extra_route: bool = False) -> str:
    other = f"  - match: {{path: /other}}\n    upstream: {upstream}\n" if extra_route else ""
    return f"""
store: {{url: '{redis_url}'}}
limits:
  denied: {{rate: 1/hour, burst: {denied_burst}, key: header:X-API-Key}}
  leased: {{rate: 1/hour, burst: {leased_burst}, key: [], lease: 10}}
routes:
{other}  - match: {{path: /denied}}
    upstream: {upstream}
    limits: [denied]
  - match: {{path: /leased}}
    upstream: {upstream}
    limits: [leased]
"""


async def test_an_unchanged_limit_keeps_its_cached_denials_and_unspent_leases_across_a_reload(
    upstream, dedicated_redis, tmp_path
):
    """Reproduction: every reload made new limit objects, and the denial cache and the token
    leases matched limits by identity, so a reload that changed nothing they used (here, a
    route added) sent the next denied request back to Redis and lapsed every unspent lease.
    A limit the reload changed starts afresh in both. Script calls counted by Redis."""
    path = tmp_path / "gateway.yaml"
    redis = dedicated_redis.client()

    path.write_text(reload_config(upstream, dedicated_redis.url))
    async with running_gateway(load_config(str(path))) as gw, aiohttp.ClientSession() as client:
        key = {"X-API-Key": "k"}

        async def statuses(route: str, n: int) -> list[int]:
            found = []
            for _ in range(n):
                async with client.get(gw.url + route, headers=key) as response:
                    found.append(response.status)
            return found

        assert await statuses("/denied", 2) == [200, 429]
        assert await statuses("/leased", 1) == [200]  # ten leased, one spent
        assert len(gw.gateway.limiter.denials) == 1
        calls = script_calls(redis)

        path.write_text(reload_config(upstream, dedicated_redis.url, extra_route=True))
        assert gw.gateway.reload()
        assert await statuses("/denied", 3) == [429] * 3
        assert await statuses("/leased", 9) == [200] * 9
        assert script_calls(redis) == calls  # all answered from this process's state

        path.write_text(reload_config(upstream, dedicated_redis.url, denied_burst=2, leased_burst=101, extra_route=True))
        assert gw.gateway.reload()
        assert await statuses("/denied", 1) == [429]  # the bucket keeps its 0 tokens, but Redis says so
        assert script_calls(redis) == calls + 1
        assert await statuses("/leased", 1) == [200]  # a fresh lease of the changed limit
        assert script_calls(redis) == calls + 2


async def test_a_request_in_flight_finishes_on_the_config_it_started_with(upstream):
    with GatewayProcess(limited_yaml(upstream, burst=5)) as gw:
        async with aiohttp.ClientSession() as client:
            slow = asyncio.create_task(status(client, gw.url + "/slow?seconds=1"))
            await until_in_flight(client, gw.admin_url)
            # The new config sends / nowhere: a request that started before still reaches the upstream.
            await reload_with(gw, limited_yaml("http://127.0.0.1:9", burst=5), RELOADED)
            assert await asyncio.wait_for(slow, DEADLINE) == 200
            assert await status(client, gw.url + "/echo") == 502


def two_workers(redis_url: str) -> dict[str, str]:
    """`limited_yaml`'s settings for two workers on one Redis, their ports picked here so
    that every version of the config a test writes keeps them."""
    return {
        "extra": f"workers: 2\nstore: {{url: '{redis_url}'}}\n",
        "listen": f"127.0.0.1:{free_port()}",
        "admin": f"127.0.0.1:{free_port()}",
    }


async def test_every_worker_reloads_on_sighup(upstream, redis_server):
    listen = two_workers(redis_server.url)
    with GatewayProcess(limited_yaml(upstream, burst=1, **listen)) as gw:
        await eventually(lambda: count(gw, "listening on") == 2, what="both workers to listen")
        await reload_with(gw, limited_yaml(upstream, burst=1, second_route=True, **listen), RELOADED)
        await eventually(lambda: count(gw, RELOADED) == 2, what="both workers to reload")
        assert gw.process.poll() is None
        # Fresh connections land on either worker; every one serves the new route.
        for _ in range(10):
            async with aiohttp.ClientSession() as fresh:
                assert await status(fresh, gw.url + "/echo/other") == 200


async def test_with_workers_a_bad_file_is_refused_once_and_watch_reloads_every_worker(upstream, redis_server):
    # The supervisor checks each reload for its workers: a bad file is one log line and one
    # count, not one per worker, whether a SIGHUP or an edit (--watch) brought it.
    listen = two_workers(redis_server.url)
    failed = "config reload failed, the old config serves on"
    with GatewayProcess(limited_yaml(upstream, burst=1, **listen), args=("--watch",)) as gw:
        await eventually(lambda: count(gw, "listening on") == 2, what="both workers to listen")
        gw.config_path.write_text("routes: [{match: {path: /}, upstream: 'not a url'}]\n")
        await eventually(lambda: count(gw, failed) == 1, what="the bad edit to be refused")
        gw.signal(signal.SIGHUP)
        await eventually(lambda: count(gw, failed) == 2, what="the bad file to be refused again")
        await asyncio.sleep(1)  # time for any worker's own line
        assert count(gw, failed) == 2 and count(gw, RELOADED) == 0
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as client:
            for _ in range(4):  # whichever worker answers sums every process's count
                assert await metric(client, gw.admin_url, "gateway_config_reload_failures_total") == 2
            assert await status(client, gw.url + "/echo/other") == 200  # the old config: the limited catch-all
            gw.config_path.write_text(limited_yaml(upstream, burst=1, second_route=True, **listen))
            await eventually(lambda: count(gw, RELOADED) == 2, what="both workers to reload the edit")
            for _ in range(6):
                assert await status(client, gw.url + "/echo/other") == 200
            assert await metric(client, gw.admin_url, "gateway_config_reload_failures_total") == 2
        assert gw.stop() == 0


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
            await until_in_flight(client, gw.admin_url)
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
    # Cut at the grace, not when the 30 s request would have ended; the margin is the scheduler's.
    assert grace <= elapsed < grace + 10.0, elapsed


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
    config = (Path(__file__).resolve().parents[2] / "config" / "demo-redis.yaml").read_text()
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
                seen = []

                async def refused() -> bool:
                    # Each /readyz pings the store at the 10 ms timeout; on a busy machine one
                    # ping can time out ("unreachable") before Redis answers WRONGPASS.
                    async with client.get(gw.admin_url + "/readyz") as response:
                        seen.append((response.status, await response.json()))
                    return seen[-1][1]["store_state"] == "refused"

                await eventually(refused, what="/readyz to report the refusal")
            status, body = seen[-1]
            assert status == 503 and all(s == 503 for s, _ in seen), seen
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


def open_client_sessions() -> int:
    """The gateway's upstream clients still open, one per upstream it may send to."""
    return sum(isinstance(o, UpstreamClient) and not o.closed for o in gc.get_objects())


def changing_pool_yaml(kept: str, i: int, held: str | None = None) -> str:
    """A pool of `kept` and a target that every reload replaces (a deploy's new host), and
    while `held` is given, a route /held to it."""
    route = f"  - match: {{path: /held}}\n    upstream: {held}\n" if held else ""
    return (
        "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\nroutes:\n" + route
        + f"  - match: {{path: /}}\n    upstream:\n      targets: [{kept}, http://127.0.0.1:{10000 + i}]\n"
    )


async def test_reloads_that_replace_pool_targets_close_the_dropped_targets_sessions(upstream, tmp_path):
    """Reproduction: a reload opened a session (its connector, its slots) for each new
    upstream and never closed one no config named any more, so 200 reloads that each
    replaced one pool target left 403 sessions open. A request in flight on a dropped
    upstream still finishes on its session, which closes once no such request is left."""
    path = tmp_path / "gateway.yaml"
    async with running_upstream() as kept:
        path.write_text(changing_pool_yaml(kept, 0, held=upstream))
        async with running_gateway(load_config(str(path))) as gw, aiohttp.ClientSession() as client:
            before = open_client_sessions()
            held = asyncio.create_task(status(client, gw.url + "/held"))

            async def arrived() -> bool:
                async with client.get(upstream + "/held/arrived") as response:
                    return (await response.json())["arrived"] == 1

            await eventually(arrived, what="the request to reach the held upstream")
            for i in range(1, 51):
                path.write_text(changing_pool_yaml(kept, i))
                assert gw.gateway.reload()
            async with client.post(upstream + "/held/release"):
                pass
            assert await asyncio.wait_for(held, DEADLINE) == 200
            assert await status(client, gw.url + "/echo") == 200
            # Two sessions for the two targets of the last config; /held's upstream and 50 replaced targets closed.
            await eventually(lambda: open_client_sessions() == before - 1, what="the dropped upstreams' sessions to close")
