"""The Redis store end to end: bucket keys, what reaches Redis, one script call
per request, TTLs, all-or-nothing charging, and the client's connection kinds
(TCP, unix socket, TLS, ACL user). Every test runs its own redis-server and a
real gateway in front of the real upstream."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import gc
import re
import subprocess
import tempfile
import threading
import time
import weakref
from pathlib import Path

import aiohttp
import pytest
import redis
import redis.asyncio
import trustme
from redis.crc import key_slot

from gateway.limiter.keys import identity_digest
from gateway.limiter.store import LimitCheck
from gateway.testing import config_from_yaml, running_gateway
from tests.helpers import redis_store
from tests.processes import RedisServer, eventually, free_port, wait_until

SECRET_KEY = "rl:identity-secret"


def gateway_yaml(store_url: str, upstream: str, limits: str, route_limits: str, *, prefix: str = "rl:") -> str:
    return f"""
store:
  url: {store_url}
  timeout: 2s
  prefix: '{prefix}'
limits:
{limits}
routes:
  - match: {{path: /}}
    upstream: {upstream}
    limits: {route_limits}
"""


def digest(client: redis.Redis, identity: str) -> str:
    """The digest the gateway uses for `identity`, from the secret the fleet shares in Redis."""
    return identity_digest(client.get(SECRET_KEY).encode(), identity)


def bucket_tokens(client: redis.Redis, key: str) -> float | None:
    value = client.hget(key, "tokens")
    return None if value is None else float(value)


def bucket_keys(client: redis.Redis) -> set[str]:
    return {k for k in client.scan_iter(count=1000) if k != SECRET_KEY}


class Monitor:
    """`redis-cli MONITOR` in the background: every command Redis executes, as text."""

    def __init__(self, port: int) -> None:
        self._port = port
        self.lines: list[str] = []

    def __enter__(self) -> Monitor:
        self._process = subprocess.Popen(
            ["redis-cli", "-p", str(self._port), "monitor"], stdout=subprocess.PIPE, text=True
        )
        threading.Thread(target=self._read, daemon=True).start()
        wait_until(lambda: self.lines[:1] == ["OK\n"], deadline=10, what="MONITOR to start")
        return self

    def _read(self) -> None:
        for line in self._process.stdout:
            self.lines.append(line)

    def drain(self, client: redis.Redis) -> str:
        """Everything seen so far, up to a marker command sent after the work under test."""
        marker = f"monitor-end-{time.monotonic_ns()}"
        client.echo(marker)
        wait_until(lambda: any(marker in line for line in self.lines), deadline=10, what="MONITOR to catch up")
        return "".join(self.lines)

    def __exit__(self, *exc: object) -> None:
        self._process.terminate()
        self._process.wait(timeout=10)


PER_CLIENT = """
  per_client:
    rate: 1/day
    burst: 50
    key: header:X-API-Key
"""
PER_SECOND = """
  per_second:
    rate: 20/second
    burst: 10
    key: header:X-API-Key
"""


async def test_bucket_key_is_prefix_limit_and_hash_tagged_identity_digest(redis_server, upstream):
    limits = PER_CLIENT + """
  per_client_hourly:
    rate: 100/hour
    key: header:X-API-Key
"""
    config = gateway_yaml(redis_server.url, upstream, limits, "[per_client, per_client_hourly]")
    async with running_gateway(config) as gw, aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/a", headers={"X-API-Key": "key-123"}) as response:
            assert response.status == 200
    client = redis_server.client()
    hex_digest = digest(client, "header:x-api-key=key-123")
    assert re.fullmatch(r"[0-9a-f]{32}", hex_digest)
    assert bucket_keys(client) == {f"rl:per_client:{{{hex_digest}}}", f"rl:per_client_hourly:{{{hex_digest}}}"}
    # The braces are a Redis Cluster hash tag: one identity's buckets share a slot.
    assert key_slot(f"rl:per_client:{{{hex_digest}}}".encode()) == key_slot(hex_digest.encode())
    assert key_slot(f"rl:per_client_hourly:{{{hex_digest}}}".encode()) == key_slot(hex_digest.encode())


async def test_configured_prefix_is_used_for_every_key(redis_server, upstream):
    config = gateway_yaml(redis_server.url, upstream, PER_CLIENT, "[per_client]", prefix="team-a:")
    async with running_gateway(config) as gw, aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/a", headers={"X-API-Key": "k"}) as response:
            assert response.status == 200
    client = redis_server.client()
    secret = client.get("team-a:identity-secret")
    assert secret is not None
    expected = f"team-a:per_client:{{{identity_digest(secret.encode(), 'header:x-api-key=k')}}}"
    assert set(client.scan_iter()) == {"team-a:identity-secret", expected}


async def test_raw_client_identities_never_reach_redis(redis_server, upstream):
    """Not in any key, not in any value, not in any command Redis executed."""
    api_key = "sk_live_DISTINCTIVE_api_key_7f3a9c"
    query_token = "QTOKEN_distinctive_55e1"
    cookie_session = "COOKIE_distinctive_b07d"
    limits = PER_CLIENT + """
  per_token:
    rate: 1/day
    burst: 50
    key: query:token
  per_session:
    rate: 1/day
    burst: 50
    key: cookie:session
"""
    config = gateway_yaml(redis_server.url, upstream, limits, "[per_client, per_token, per_session]")
    client = redis_server.client()
    with Monitor(redis_server.port) as monitor:
        async with running_gateway(config) as gw, aiohttp.ClientSession() as http:
            for _ in range(3):
                async with http.get(
                    gw.url + f"/a?token={query_token}",
                    headers={"X-API-Key": api_key, "Cookie": f"session={cookie_session}"},
                ) as response:
                    assert response.status == 200
        commands = monitor.drain(client)
    assert commands.lower().count('"evalsha"') == 3, "MONITOR did not see the gateway's checks"
    stored: list[str] = []
    for key in client.scan_iter(count=1000):
        stored.append(key)
        kind = client.type(key)
        if kind == "hash":
            stored += [f"{f}={v}" for f, v in client.hgetall(key).items()]
        else:
            assert kind == "string", f"unexpected {kind} at {key}"
            stored.append(client.get(key))
    assert len(bucket_keys(client)) == 3
    everything = "\n".join(stored).lower() + commands.lower()
    for raw in (api_key, query_token, cookie_session):
        assert raw.lower() not in everything


async def test_one_script_call_per_request_even_across_identities(redis_server, upstream):
    """Three limits keyed on an API key, the client IP and a tenant header: one EVALSHA each request."""
    limits = PER_CLIENT + """
  per_ip:
    rate: 1/day
    burst: 50
    key: ip
  per_tenant:
    rate: 1/day
    burst: 50
    key: header:X-Tenant
"""
    config = gateway_yaml(redis_server.url, upstream, limits, "[per_client, per_ip, per_tenant]")
    client = redis_server.client()
    async with running_gateway(config) as gw, aiohttp.ClientSession() as http:
        client.config_resetstat()
        with Monitor(redis_server.port) as monitor:
            for i in range(10):
                headers = {"X-API-Key": f"key-{i}", "X-Tenant": f"t-{i % 3}"}
                async with http.get(gw.url + "/a", headers=headers) as response:
                    assert response.status == 200
            commands = monitor.drain(client)
        stats = client.info("commandstats")
    # What clients sent, as opposed to what the script called inside Redis ("[0 lua]").
    sent = [line for line in commands.splitlines()[1:] if "[0 lua]" not in line and "monitor-end-" not in line]
    assert len(sent) == 10 and all(re.search(r'\] "evalsha" "[0-9a-f]{40}" "3" ', line, re.IGNORECASE) for line in sent), sent
    assert stats["cmdstat_evalsha"]["calls"] == 10
    assert "cmdstat_eval" not in stats
    # 10 API keys, 1 address, 3 tenants: the one call did reach every identity's bucket.
    assert len(bucket_keys(client)) == 10 + 1 + 3


async def test_concurrent_requests_share_one_pipelined_connection(redis_server, upstream):
    config = gateway_yaml(redis_server.url, upstream, PER_CLIENT, "[per_client]")
    async with running_gateway(config) as gw, aiohttp.ClientSession() as http:

        async def one(i: int) -> int:
            async with http.get(gw.url + "/a", headers={"X-API-Key": f"k{i % 7}"}) as response:
                return response.status

        statuses = await asyncio.gather(*(one(i) for i in range(300)))
        clients = [c for c in redis_server.client().client_list() if c["cmd"] != "client|list"]
    assert collections.Counter(statuses) == {200: 300}
    assert len(clients) == 1, clients


async def test_bucket_ttl_is_the_full_refill_time(redis_server, upstream):
    config = gateway_yaml(redis_server.url, upstream, PER_CLIENT + PER_SECOND, "[per_client, per_second]")
    client = redis_server.client()
    async with running_gateway(config) as gw, aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/a", headers={"X-API-Key": "k"}) as response:
            assert response.status == 200
        hex_digest = digest(client, "header:x-api-key=k")
        slow_ttl = client.pttl(f"rl:per_client:{{{hex_digest}}}")
        fast_ttl = client.pttl(f"rl:per_second:{{{hex_digest}}}")
        # Refilling 50 tokens at 1/day takes 50 days; 10 at 20/s takes 500 ms.
        # The script adds up to a second of margin so a bucket never expires before it is full.
        assert 50 * 86400_000 - 1000 <= slow_ttl <= 50 * 86400_000 + 1000
        assert 400 <= fast_ttl <= 1500
        assert client.ttl(SECRET_KEY) == -1, "the fleet's identity secret must not expire"


async def test_idle_bucket_keys_vanish(redis_server, upstream):
    config = gateway_yaml(redis_server.url, upstream, PER_SECOND, "[per_second]")
    client = redis_server.client()
    async with running_gateway(config) as gw, aiohttp.ClientSession() as http:
        for i in range(5):
            async with http.get(gw.url + "/a", headers={"X-API-Key": f"k{i}"}) as response:
                assert response.status == 200
        assert len(bucket_keys(client)) == 5
        assert all(client.pttl(key) > 0 for key in bucket_keys(client))
        await eventually(lambda: not bucket_keys(client), deadline=10, what="idle buckets to expire")
        # An expired bucket comes back full: the next request sees the whole burst.
        async with http.get(gw.url + "/a", headers={"X-API-Key": "k0"}) as response:
            assert response.status == 200
            assert response.headers["RateLimit"] == '"per_second";r=9;t=1'


MULTI_LIMITS = """
  per_key:
    rate: 1/day
    burst: 5
    key: header:X-API-Key
  per_tenant:
    rate: 1/day
    burst: 2
    key: header:X-Tenant
  per_key_daily:
    rate: 1/day
    burst: 100
    key: header:X-API-Key
"""


async def test_request_denied_by_one_limit_charges_no_other(redis_server, upstream):
    config = gateway_yaml(redis_server.url, upstream, MULTI_LIMITS, "[per_key, per_tenant, per_key_daily]")
    client = redis_server.client()

    def tokens(limit: str, identity: str) -> float | None:
        return bucket_tokens(client, f"rl:{limit}:{{{digest(client, identity)}}}")

    async with running_gateway(config) as gw, aiohttp.ClientSession() as http:

        async def get(key: str, tenant: str) -> int:
            async with http.get(gw.url + "/a", headers={"X-API-Key": key, "X-Tenant": tenant}) as response:
                return response.status

        assert [await get("A", "T1"), await get("A", "T1")] == [200, 200]
        # Denied by the tenant's limit: B's buckets, on another identity, are not touched.
        assert await get("B", "T1") == 429
        assert tokens("per_key", "header:x-api-key=B") is None
        assert tokens("per_key_daily", "header:x-api-key=B") is None
        assert tokens("per_key", "header:x-api-key=A") == pytest.approx(3, abs=0.01)
        assert tokens("per_key_daily", "header:x-api-key=A") == pytest.approx(98, abs=0.01)

        assert [await get("A", "T2"), await get("A", "T2"), await get("A", "T3")] == [200, 200, 200]
        assert tokens("per_key", "header:x-api-key=A") == pytest.approx(0, abs=0.01)
        # Denied by A's own per_key limit: neither T3's bucket nor A's daily bucket is charged.
        assert await get("A", "T3") == 429
        assert tokens("per_tenant", "header:x-tenant=T3") == pytest.approx(1, abs=0.01)
        assert tokens("per_key_daily", "header:x-api-key=A") == pytest.approx(95, abs=0.01)
        assert tokens("per_tenant", "header:x-tenant=T1") == pytest.approx(0, abs=0.01)


async def test_unix_socket_url(upstream):
    with tempfile.TemporaryDirectory(prefix="gw-redis-sock-") as directory:
        socket_path = str(Path(directory) / "redis.sock")
        with RedisServer("--unixsocket", socket_path, "--unixsocketperm", "700") as server:
            config = gateway_yaml(f"unix://{socket_path}", upstream, PER_CLIENT, "[per_client]")
            async with running_gateway(config) as gw, aiohttp.ClientSession() as http:
                async with http.get(gw.url + "/a", headers={"X-API-Key": "k"}) as response:
                    assert response.status == 200
                    assert response.headers["RateLimit"] == '"per_client";r=49;t=86400'
                client = server.client()
                # 'U': a connection over the unix socket; this test's own client uses TCP.
                assert any("U" in c["flags"] for c in client.client_list())
            assert len(bucket_keys(client)) == 1


ACL_LIMITS = """
  per_client:
    rate: 1/day
    burst: 50
    key: header:X-API-Key
    on_store_error: closed
"""


@pytest.fixture
def acl_redis():
    """A Redis where only user `gateway` (password `right-pw`, keys rl:*) may do anything."""
    with RedisServer() as server:
        admin = server.client()
        admin.acl_setuser("gateway", enabled=True, passwords=["+right-pw"], keys=["rl:*"], commands=["+@all"])
        admin.acl_setuser("default", enabled=False)
        yield server


async def test_acl_user_and_password_from_the_url(acl_redis, upstream):
    url = f"redis://gateway:right-pw@127.0.0.1:{acl_redis.port}/0"
    config = gateway_yaml(url, upstream, ACL_LIMITS, "[per_client]")
    async with running_gateway(config) as gw, aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/a", headers={"X-API-Key": "k"}) as response:
            assert response.status == 200
            assert response.headers["RateLimit"] == '"per_client";r=49;t=86400'
        async with http.get(gw.admin_url + "/readyz") as response:
            body = await response.json()
            assert body["store_state"] == "ok"
            assert "right-pw" not in body["store"]
    admin = redis.Redis(port=acl_redis.port, username="gateway", password="right-pw", decode_responses=True)
    assert len([k for k in admin.scan_iter() if k != SECRET_KEY]) == 1


async def test_wrong_acl_password_fails_the_check_per_policy(acl_redis, upstream):
    url = f"redis://gateway:wrong-pw@127.0.0.1:{acl_redis.port}/0"
    limits = ACL_LIMITS + """
  fair:
    rate: 1/day
    burst: 50
    on_store_error: open
"""
    config = f"""
store:
  url: {url}
  timeout: 2s
limits:
{limits}
routes:
  - match: {{path: /closed}}
    upstream: {upstream}
    limits: [per_client]
  - match: {{path: /open}}
    upstream: {upstream}
    limits: [fair]
"""
    async with running_gateway(config) as gw, aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/closed", headers={"X-API-Key": "k"}) as response:
            assert response.status == 503
            assert response.content_type == "application/problem+json"
        async with http.get(gw.url + "/open") as response:
            assert response.status == 200
            assert "RateLimit" not in response.headers
        async with http.get(gw.admin_url + "/readyz") as response:
            body = await response.json()
            assert response.status == 503
            assert body["store_state"] == "refused"  # WRONGPASS: refused, not away
            assert "wrong-pw" not in body["store"] and "wrong-pw" not in body["detail"]


@pytest.fixture(scope="module")
def tls_files():
    """A self-signed certificate for 127.0.0.1 that also serves as its own CA."""
    with tempfile.TemporaryDirectory(prefix="gw-redis-tls-") as directory:
        cert, key = Path(directory) / "cert.pem", Path(directory) / "key.pem"
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
             "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
            check=True, capture_output=True,
        )
        yield cert, key


@pytest.fixture
def tls_redis(tls_files):
    cert, key = tls_files
    tls_port = free_port()
    with RedisServer(
        "--tls-port", str(tls_port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
        "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no",
    ) as server:
        yield server, tls_port


async def test_rediss_url_speaks_tls_and_verifies_the_server(tls_redis, tls_files, upstream, monkeypatch):
    server, tls_port = tls_redis
    url = f"rediss://127.0.0.1:{tls_port}/0"
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    # Untrusted certificate: the check fails, and this limit fails closed.
    async with running_gateway(gateway_yaml(url, upstream, ACL_LIMITS, "[per_client]")) as gw:
        async with aiohttp.ClientSession() as http, http.get(gw.url + "/a", headers={"X-API-Key": "k"}) as response:
            assert response.status == 503
    # Trusted through store.tls_ca_file: the check runs over TLS.
    trusted = gateway_yaml(url, upstream, ACL_LIMITS, "[per_client]").replace(
        "  timeout: 2s\n", f"  timeout: 2s\n  tls_ca_file: {tls_files[0]}\n"
    )
    async with running_gateway(trusted) as gw, aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/a", headers={"X-API-Key": "k"}) as response:
            assert response.status == 200
            assert response.headers["RateLimit"] == '"per_client";r=49;t=86400'
    # And through the system's default verify paths (SSL_CERT_FILE) without it.
    monkeypatch.setenv("SSL_CERT_FILE", str(tls_files[0]))
    async with running_gateway(gateway_yaml(url, upstream, ACL_LIMITS, "[per_client]")) as gw:
        async with aiohttp.ClientSession() as http, http.get(gw.url + "/a", headers={"X-API-Key": "k"}) as response:
            assert response.status == 200
            assert response.headers["RateLimit"] == '"per_client";r=48;t=86400'
    assert len(bucket_keys(server.client())) == 1


async def test_each_reloads_new_limits_are_charged_as_configured_and_old_ones_are_not_kept(redis_server):
    """A reload makes new limit objects, and the plans it compiles prepare their script
    arguments anew: each is charged at its own burst, and the store keeps none of them once
    no check refers to it (nothing is cached by limit)."""
    base = config_from_yaml(
        "limits:\n  per_client: {rate: 1/day, burst: 5, key: header:X-API-Key}\n"
        "routes:\n  - match: {path: /}\n    upstream: http://127.0.0.1:1\n    limits: [per_client]\n"
    ).limits[0]
    async with redis_store(redis_server.url) as store:
        gone = []
        for reload in range(200):
            limit = dataclasses.replace(base, burst=1 + reload % 50)  # what a reload's loader makes
            prepared = store.prepare(limit, 1)
            decision = await store.check([LimitCheck(limit=limit, identity=f"client-{reload}", cost=1, prepared=prepared)])
            assert decision.allowed and decision.remaining == (limit.burst - 1,)
            gone.append(weakref.ref(limit))
            del limit, prepared
        gc.collect()
        assert not [ref for ref in gone if ref() is not None]


async def test_a_check_whose_limit_was_replaced_is_charged_by_its_own_limit_not_the_prepared_one(redis_server):
    """A check changed after it was built (a tier's limit, a read at cost 0) derives its own
    arguments: what was prepared for another limit or cost is never sent for it."""
    config = config_from_yaml(
        "limits:\n  per_client: {rate: 1/day, burst: 5, key: header:X-API-Key}\n"
        "routes:\n  - match: {path: /}\n    upstream: http://127.0.0.1:1\n    limits: [per_client]\n"
    )
    five = config.limits[0]
    nine = dataclasses.replace(five, burst=9)
    async with redis_store(redis_server.url) as store:
        prepared = store.prepare(five, 1)
        check = LimitCheck(limit=five, identity="a", cost=1, prepared=prepared)

        async def left(check: LimitCheck) -> int:
            (remaining,) = (await store.check([check])).remaining
            return int(remaining)  # whole tokens: a second's refill at 5 a day adds a fraction

        assert await left(check) == 4
        assert await left(dataclasses.replace(check, limit=nine, identity="b")) == 8
        assert await left(dataclasses.replace(check, cost=3)) == 1
        assert await left(dataclasses.replace(check, cost=0)) == 1


async def test_a_rediss_server_another_ca_signed_fails_per_policy_and_readyz_says_why(tls_redis, upstream, tmp_path):
    _, tls_port = tls_redis
    other_ca = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other_ca))
    config = gateway_yaml(f"rediss://127.0.0.1:{tls_port}/0", upstream, ACL_LIMITS, "[per_client]").replace(
        "  timeout: 2s\n", f"  timeout: 2s\n  tls_ca_file: {other_ca}\n"
    )
    async with running_gateway(config) as gw, aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/a", headers={"X-API-Key": "k"}) as response:
            assert response.status == 503  # per_client fails closed
        async with http.get(gw.admin_url + "/readyz") as response:
            body = await response.json()
            assert response.status == 503
    assert body["store_state"] == "unreachable"
    assert "cannot connect: [SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed" in body["detail"], body


async def test_the_checks_of_one_iteration_go_in_one_script_call_each_all_or_nothing(redis_server):
    """Thirty checks at once, as thirty concurrent requests make them, ride one EVALSHA.
    Three clients send ten each, against a burst of 4 and a roomy second limit: exactly the
    first four of each client pass, in order, the second limit is charged for those four
    only, and every denied check reports its buckets as found."""
    config = config_from_yaml(
        "limits:\n"
        "  tight: {rate: 1/day, burst: 4, key: header:X-API-Key}\n"
        "  roomy: {rate: 1/day, burst: 100, key: header:X-API-Key}\n"
        "routes:\n  - match: {path: /}\n    upstream: http://127.0.0.1:1\n    limits: [tight, roomy]\n"
    )
    tight, roomy = config.limits
    async with redis_store(redis_server.url) as store:
        client = redis_server.client()
        client.config_resetstat()
        clients = [f"header:x-api-key=k{i % 3}" for i in range(30)]
        decisions = await asyncio.gather(
            *(store.check([LimitCheck(tight, identity, 1), LimitCheck(roomy, identity, 1)]) for identity in clients)
        )
    assert client.info("commandstats")["cmdstat_evalsha"]["calls"] == 1
    for n in range(3):
        mine = decisions[n::3]
        assert [d.allowed for d in mine] == [True] * 4 + [False] * 6
        assert [d.remaining for d in mine[:4]] == [(3.0, 99.0), (2.0, 98.0), (1.0, 97.0), (0.0, 96.0)]
        assert all(d.remaining == (0.0, 96.0) and d.retry_after > 0 for d in mine[4:])
    roomy_keys = [k for k in bucket_keys(client) if k.startswith("rl:roomy:")]
    assert len(roomy_keys) == 3 and all(bucket_tokens(client, k) == 96.0 for k in roomy_keys)
