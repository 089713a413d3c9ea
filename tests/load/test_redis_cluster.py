"""The gateway on a Redis Cluster of 3 masters and 3 replicas, made by `redis-cli --cluster create`.

Every count here is exact. A request decided by Redis carries RateLimit
headers; one the failure policy let through (fail open) carries none, so a
client can tell which answered. The gateway hashes identities with a fixed
`key_secret` here, so the tests can name each client's bucket and its slot.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import random
import subprocess
import time

import aiohttp
import pytest
import redis

from gateway.limiter.keys import bucket_key, identity_digest
from gateway.limiter.store import LimitCheck
from gateway.redis.cluster import key_slot, parse_redirect
from gateway.redis.store import RedisStore
from gateway.testing import config_from_yaml
from tests.helpers import script_calls
from tests.processes import GatewayProcess, RedisCluster, eventually, free_cluster_port
from tests.scrape import settled_decisions

pytestmark = pytest.mark.timing  # measures time, load or memory: one such module runs at a time

SECRET = "cluster-test-secret"
PREFIX = "rl:"


def cluster_yaml(url: str, upstream: str, limits: str, route_limits: str) -> str:
    return f"""
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
store:
  url: {url}
  prefix: "{PREFIX}"
  key_secret: {SECRET}
limits:
{limits}
routes:
  - match: {{path: /}}
    upstream: {upstream}
    limits: {route_limits}
"""


def bucket(limit: str, identity: str) -> str:
    return bucket_key(PREFIX, limit, identity_digest(SECRET.encode(), identity))


def slot_of(limit: str, identity: str) -> int:
    return key_slot(bucket(limit, identity))


@pytest.fixture(scope="module")
def cluster():
    """Shared by the tests that leave its topology alone; each uses its own limit names.
    At real-time priority, as Redis on hosts of its own: these tests count answers
    decided by Redis at the default 10 ms timeout (see RedisServer)."""
    with RedisCluster(dedicated=True) as running:
        yield running


async def send(client: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> tuple[int, bool, float]:
    """(status, decided by Redis, when it finished)."""
    async with client.get(url, headers=headers) as response:
        await response.read()
        return response.status, "RateLimit-Policy" in response.headers, time.monotonic()


def test_key_slot_agrees_with_the_cluster(cluster):
    node = cluster.node_client(cluster.nodes[0].port)
    rng = random.Random(7)
    keys = ["", "{}", "{}x", "a{}b", "{a", "a}", "{{a}}", "123456789", "{user1000}.following", "foo{bar}{zap}"]
    keys += [bucket("limit", f"header:x-api-key=client-{n}") for n in range(200)]
    keys += ["".join(rng.choice("ab{}xy:") for _ in range(rng.randrange(1, 12))) for _ in range(300)]
    for key in keys:
        assert key_slot(key) == node.execute_command("CLUSTER KEYSLOT", key), key


def test_every_bucket_of_one_identity_shares_a_slot():
    for n in range(100):
        identity = f"header:x-api-key=client-{n}"
        assert len({slot_of(limit, identity) for limit in ("per_client", "reports", "a", "b-c")}) == 1


def test_redirections_name_a_slot_and_a_node():
    assert parse_redirect("MOVED 3999 127.0.0.1:6381", "x") == (3999, ("127.0.0.1", 6381))
    assert parse_redirect("ASK 1 [::1]:7000", "x") == (1, ("::1", 7000))
    assert parse_redirect("MOVED 5 :7000", "10.0.0.1") == (5, ("10.0.0.1", 7000))


async def test_the_first_requests_are_decided_by_the_cluster_and_land_on_every_master(cluster, upstream, client):
    limits = "  first: {rate: 1/hour, burst: 2, key: header:X-API-Key, on_store_error: open}"
    with GatewayProcess(cluster_yaml(cluster.url, upstream, limits, "[first]")) as gateway:
        keys = [f"client-{n}" for n in range(150)]
        # Sent the moment the gateway listens: the slot map was read before it did.
        results = await asyncio.gather(*(send(client, gateway.url + "/", {"X-API-Key": k}) for k in keys * 3))
        statuses = collections.Counter(status for status, _, _ in results)
        assert statuses == {200: 300, 429: 150}
        assert all(decided for _, decided, _ in results)
        counts = await settled_decisions(client, gateway.admin_url)
        assert counts[("first", "fail_open")] == 0
        async with client.get(gateway.admin_url + "/readyz") as response:
            assert response.status == 200, await response.text()
    masters = cluster.masters()
    holding = {port for port, ranges in masters.items() for key in keys for first, last in ranges
               if first <= slot_of("first", f"header:x-api-key={key}") <= last}
    assert holding == set(masters)


async def test_a_cluster_that_requires_a_password_is_logged_in_to_on_every_master(upstream, client):
    limits = "  authed: {rate: 1/hour, burst: 2, key: header:X-API-Key, on_store_error: closed}"
    with RedisCluster(password="cluster-pass") as cluster:
        assert cluster.url.startswith("redis+cluster://:cluster-pass@")
        with GatewayProcess(cluster_yaml(cluster.url, upstream, limits, "[authed]")) as gateway:
            keys = [f"client-{n}" for n in range(60)]
            results = await asyncio.gather(*(send(client, gateway.url + "/", {"X-API-Key": k}) for k in keys * 3))
            assert collections.Counter(status for status, _, _ in results) == {200: 120, 429: 60}
        used = {port for port in cluster.masters() if cluster.node_client(port).dbsize() > 0}
        assert used == set(cluster.masters())


async def test_a_cluster_that_cannot_be_reached_fails_open_and_readyz_says_why(upstream, client):
    dead = f"redis+cluster://127.0.0.1:{free_cluster_port()},127.0.0.1:{free_cluster_port()}"
    limits = "  unreachable: {rate: 1/hour, burst: 2, key: header:X-API-Key, on_store_error: open}"
    with GatewayProcess(cluster_yaml(dead, upstream, limits, "[unreachable]")) as gateway:
        results = [await send(client, gateway.url + "/", {"X-API-Key": "k"}) for _ in range(5)]
        assert [(status, decided) for status, decided, _ in results] == [(200, False)] * 5
        async with client.get(gateway.admin_url + "/readyz") as response:
            body = await response.json()
        # Ready all the same: the only limit fails open, so the gateway serves without its store.
        assert response.status == 200 and body["store_state"] == "unreachable"
        assert "slot" in body["detail"], body
        stderr = "".join(gateway.stderr_lines)
    assert "Traceback" not in stderr


async def test_one_key_under_300_concurrent_requests_gets_exactly_its_burst(cluster, upstream, client):
    limits = "  hot: {rate: 1/hour, burst: 25, key: header:X-API-Key, on_store_error: open}"
    with GatewayProcess(cluster_yaml(cluster.url, upstream, limits, "[hot]")) as gateway:
        results = await asyncio.gather(*(send(client, gateway.url + "/", {"X-API-Key": "hot"}) for _ in range(300)))
    assert collections.Counter(status for status, _, _ in results) == {200: 25, 429: 275}
    assert all(decided for _, decided, _ in results)


def identities_in_slot_order(limit_a: str, limit_b: str, *, a_first: bool) -> tuple[str, str]:
    """A user and an API key whose buckets (of limit_a and limit_b) lie in different slots,
    limit_a's slot first when `a_first`."""
    for n in range(1000):
        user, key = f"user-{n}", f"key-{n}"
        slot_a = slot_of(limit_a, f"header:x-user={user}")
        slot_b = slot_of(limit_b, f"header:x-api-key={key}")
        if slot_a != slot_b and (slot_a < slot_b) == a_first:
            return user, key
    raise AssertionError("no such pair")


@pytest.mark.parametrize("tight_first", [True, False], ids=["tight-slot-first", "tight-slot-last"])
async def test_limits_in_two_slots_admit_exactly_the_tighter_limit_and_refund_the_other(
    cluster, upstream, client, tight_first
):
    """per_user (burst 3) and per_key (burst 8) are keyed on different headers, so their
    buckets are in different slots. Whichever slot is charged first, 200 concurrent
    requests get exactly 3 through, and per_key ends charged for exactly those 3."""
    tight, loose = f"per_user_{tight_first}", f"per_key_{tight_first}"
    limits = (
        f"  {tight}: {{rate: 1/hour, burst: 3, key: header:X-User, on_store_error: open}}\n"
        f"  {loose}: {{rate: 1/hour, burst: 8, key: header:X-API-Key, on_store_error: open}}"
    )
    user, key = identities_in_slot_order(tight, loose, a_first=tight_first)
    headers = {"X-User": user, "X-API-Key": key}
    with GatewayProcess(cluster_yaml(cluster.url, upstream, limits, f"[{tight}, {loose}]")) as gateway:
        results = await asyncio.gather(*(send(client, gateway.url + "/", headers) for _ in range(200)))
        assert collections.Counter(status for status, _, _ in results) == {200: 3, 429: 197}
        redis = cluster.client()

        def tokens(limit: str, identity: str) -> float:
            return float(redis.hget(bucket(limit, identity), "tokens"))

        # The refunds run after the denials are answered; once they land, the loose
        # limit holds exactly what the 3 admitted requests cost (a 1/hour refill is
        # under 0.01 tokens over this test).
        await eventually(lambda: abs(tokens(loose, f"header:x-api-key={key}") - 5) < 0.01,
                         what=f"{loose} refunded down to 3 charges")
        assert abs(tokens(tight, f"header:x-user={user}")) < 0.01
        # The key's 5 remaining tokens are all there for another user. Denials this
        # gateway saw while refunds were in flight may be held up to 50 ms (the denial
        # cache's bound on a store that refunds); a cached denial charges nothing.
        others = ({"X-User": f"someone-else-{n}", "X-API-Key": key} for n in itertools.count())

        async def first_admitted() -> bool:
            return (await send(client, gateway.url + "/", next(others)))[0] == 200

        await eventually(first_admitted, what="the refunded key admitting again", deadline=1.0)
        results = [await send(client, gateway.url + "/", next(others)) for _ in range(5)]
        assert [status for status, _, _ in results] == [200, 200, 200, 200, 429]


class Load:
    """Concurrent clients sending requests with many API keys until stopped; every answer recorded."""

    def __init__(self, client: aiohttp.ClientSession, url: str, keys: list[str], concurrency: int) -> None:
        self.results: list[tuple[str, int, bool, float]] = []
        self._client, self._url, self._keys = client, url, keys
        self._stop = asyncio.Event()
        self._tasks = [asyncio.ensure_future(self._run(i)) for i in range(concurrency)]

    async def _run(self, worker: int) -> None:
        n = worker
        while not self._stop.is_set():
            key = self._keys[n % len(self._keys)]
            n += 7
            status, decided, at = await send(self._client, self._url, {"X-API-Key": key})
            self.results.append((key, status, decided, at))

    async def answered(self, count: int) -> None:
        target = len(self.results) + count
        await eventually(lambda: len(self.results) >= target, what=f"{count} more answers")

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


def assert_charges_match(cluster: RedisCluster, limit: str, burst: int, results: list[tuple[str, int, bool, float]]):
    """Every request Redis decided for a key was charged exactly once, on whichever node holds
    it now. A request the failure policy answered may or may not have been charged: its script
    can have run and replied after the timeout. So a key's charge lies between its decided
    admissions and those plus its undecided requests; outside that, a charge was lost or doubled."""
    redis = cluster.client()
    allowed = collections.Counter(key for key, status, decided, _ in results if decided and status == 200)
    undecided = collections.Counter(key for key, _, decided, _ in results if not decided)
    for key in {key for key, _, _, _ in results}:
        count, tokens = allowed[key], redis.hget(bucket(limit, f"header:x-api-key={key}"), "tokens")
        charged = burst - float(tokens if tokens is not None else burst)
        assert count - 0.05 < charged < count + undecided[key] + 0.05, (
            f"{key}: {count} admitted by Redis and {undecided[key]} by the failure policy, {charged:.3f} charged"
        )


def failure_window(results: list[tuple[str, int, bool, float]]) -> float:
    """From the first to the last answer that Redis did not decide; 0 when there were none."""
    undecided = [at for _, _, decided, at in results if not decided]
    return max(undecided) - min(undecided) if undecided else 0.0


async def test_manual_failover_under_load_loses_no_charge_and_confines_errors(upstream, client):
    limits = "  failover: {rate: 1/hour, burst: 1000, key: header:X-API-Key, on_store_error: open}"
    with RedisCluster(dedicated=True) as cluster:
        with GatewayProcess(cluster_yaml(cluster.url, upstream, limits, "[failover]")) as gateway:
            keys = [f"client-{n}" for n in range(300)]
            load = Load(client, gateway.url + "/", keys, concurrency=30)
            await load.answered(1000)
            old_master = next(iter(cluster.masters()))
            replica = cluster.replica_of(old_master)
            cluster.node_client(replica).execute_command("CLUSTER FAILOVER")
            await eventually(lambda: replica in cluster.masters(), what="the replica promoted")
            await load.answered(2000)
            await load.stop()
            stderr = "".join(gateway.stderr_lines)
        assert old_master not in cluster.masters()
        assert all(status == 200 for _, status, _, _ in load.results)
        window = failure_window(load.results)
        assert window < 2.0, f"answers not decided by Redis for {window:.2f} s"
        assert "Traceback" not in stderr and "NOSCRIPT" not in stderr and "READONLY" not in stderr
        assert_charges_match(cluster, "failover", 1000, load.results)
        print(f"failover: {len(load.results)} requests, "
              f"{sum(not d for _, _, d, _ in load.results)} failed open over {window * 1000:.0f} ms")


async def test_a_killed_master_is_followed_within_a_second_of_its_replica_taking_over(upstream, client):
    """kill -9: Redis needs its node timeout (1 s here) and an election before a replica
    takes over; until then the failure policy answers. The gateway's own part of the
    outage is the time from the promotion to its first decisions by the new master."""
    limits = "  killed: {rate: 1/hour, burst: 1000, key: header:X-API-Key, on_store_error: open}"
    with RedisCluster(dedicated=True) as cluster:
        with GatewayProcess(cluster_yaml(cluster.url, upstream, limits, "[killed]")) as gateway:
            load = Load(client, gateway.url + "/", [f"client-{n}" for n in range(300)], concurrency=30)
            await load.answered(1000)
            victim_port = next(iter(cluster.masters()))
            replica = cluster.replica_of(victim_port)
            victim = next(node for node in cluster.nodes if node.port == victim_port)
            killed_at = time.monotonic()
            victim.process.kill()
            victim.process.wait()
            await eventually(lambda: replica in cluster.masters(), what="the replica promoted")
            promoted_at = time.monotonic()
            await load.answered(2000)
            await load.stop()
            stderr = "".join(gateway.stderr_lines)
        assert all(status == 200 for _, status, _, _ in load.results)
        undecided = [at for _, _, decided, at in load.results if not decided]
        assert undecided and min(undecided) >= killed_at
        followed = max(undecided) - promoted_at
        assert followed < 1.0, f"still failing open {followed:.2f} s after the promotion"
        assert "Traceback" not in stderr
        print(f"kill -9: promoted {promoted_at - killed_at:.2f} s after the kill; "
              f"last answer by the failure policy {followed * 1000:.0f} ms after that")


async def test_resharding_under_load_follows_moved_and_ask_and_loses_no_charge(upstream, client):
    limits = "  reshard: {rate: 1/hour, burst: 1000, key: header:X-API-Key, on_store_error: open}"
    with RedisCluster(dedicated=True) as cluster:
        masters = cluster.masters()
        source, target = sorted(masters)[:2]
        first_slot = masters[source][0][0]
        moving = range(first_slot, first_slot + 400)  # redis-cli moves a source's lowest slots first
        keys = [k for k in (f"client-{n}" for n in range(20000))
                if slot_of("reshard", f"header:x-api-key={k}") in moving][:40]
        keys += [f"elsewhere-{n}" for n in range(40)]
        with GatewayProcess(cluster_yaml(cluster.url, upstream, limits, "[reshard]")) as gateway:
            load = Load(client, gateway.url + "/", keys, concurrency=30)
            await load.answered(1000)
            reshard = await asyncio.create_subprocess_exec(
                "redis-cli", "--cluster", "reshard", f"127.0.0.1:{source}",
                "--cluster-from", cluster.node_id(source), "--cluster-to", cluster.node_id(target),
                "--cluster-slots", str(len(moving)), "--cluster-yes", "--cluster-pipeline", "1",
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            )
            _, errors = await reshard.communicate()
            assert reshard.returncode == 0, errors.decode()
            await load.answered(1000)
            await load.stop()
            stderr = "".join(gateway.stderr_lines)
        owners = cluster.masters()
        assert all(any(a <= slot <= b for a, b in owners[target]) for slot in moving)
        assert all(status == 200 for _, status, _, _ in load.results)
        window = failure_window(load.results)
        assert window < 2.0, f"answers not decided by Redis for {window:.2f} s"
        assert "Traceback" not in stderr
        redirects = cluster.node_client(source).info("errorstats")
        followed = sum(redirects.get(f"errorstat_{kind}", {}).get("count", 0) for kind in ("MOVED", "ASK"))
        assert followed > 0, "the gateway was never redirected: the test moved no slot it used"
        assert_charges_match(cluster, "reshard", 1000, load.results)
        print(f"reshard: {len(load.results)} requests, "
              f"{sum(not d for _, _, d, _ in load.results)} failed open over {window * 1000:.0f} ms")


async def test_checks_sent_together_go_as_one_script_call_per_slot_on_every_master(cluster):
    """Five checks each of twelve clients at once: each slot's checks ride one EVALSHA on
    its master, and each client gets exactly its burst of 3, in order."""
    limits = "  batched: {rate: 1/hour, burst: 3, key: header:X-API-Key}"
    config = config_from_yaml(cluster_yaml(cluster.url, "http://127.0.0.1:1", limits, "[batched]"))
    assert config.store is not None
    (limit,) = config.limits
    store = RedisStore(config.store)
    await store.start()
    masters = [redis.Redis(port=port) for port in cluster.masters()]
    for master in masters:
        master.config_resetstat()
    identities = [f"header:x-api-key=batched-{n}" for n in range(12)]
    try:
        decisions = await asyncio.gather(*(store.check([LimitCheck(limit, identity, 1)]) for identity in identities * 5))
    finally:
        await store.close()
    for n in range(len(identities)):
        assert [d.allowed for d in decisions[n :: len(identities)]] == [True] * 3 + [False] * 2
    calls = [script_calls(master) for master in masters]
    assert sum(calls) == len({slot_of("batched", identity) for identity in identities}), calls
    assert all(calls), calls  # the slots of twelve clients span the three masters


@pytest.mark.parametrize("owed_first", [True, False], ids=["owed-slot-first", "owed-slot-last"])
async def test_an_owed_charge_in_another_slot_is_taken_and_never_refunded(cluster, owed_first):
    """A charge owed whatever the answer (LimitCheck.owed) beside a limit that refuses, their
    buckets in two slots: in either slot order the owed one is charged (2 held, 1 then 5
    owed: -4), is not given back when the later slot refuses, and is still sent when the
    earlier slot refused; the refusing bucket is not charged."""
    plain, owing = f"plain_{owed_first}", f"owing_{owed_first}"
    limits = f"  {plain}: {{rate: 1/hour, burst: 1, key: header:X-User}}\n  {owing}: {{rate: 1/hour, burst: 2, key: header:X-API-Key}}"
    config = config_from_yaml(cluster_yaml(cluster.url, "http://127.0.0.1:1", limits, f"[{plain}, {owing}]"))
    assert config.store is not None
    by_name = {limit.name: limit for limit in config.limits}
    # identities_in_slot_order keys its first limit by X-User and its second by X-API-Key.
    user, key = identities_in_slot_order(owing, plain, a_first=owed_first)
    owing_id, plain_id = f"header:x-user={user}", f"header:x-api-key={key}"
    store = RedisStore(config.store)
    await store.start()
    try:
        assert (await store.check([LimitCheck(by_name[plain], plain_id, 1)])).allowed  # plain: now empty
        # One it can pay: charged in its slot, the plain slot refuses, and it is not refunded.
        paid = await store.check([LimitCheck(by_name[plain], plain_id, 1), LimitCheck(by_name[owing], owing_id, 1, owed=True)])
        assert not paid.allowed and paid.remaining[1] == pytest.approx(1, abs=0.01)
        decision = await store.check([LimitCheck(by_name[plain], plain_id, 1), LimitCheck(by_name[owing], owing_id, 5, owed=True)])
    finally:
        await store.close()
    assert not decision.allowed
    # The owed charge could not be paid, so its slot refused: when it came first the plain
    # limit's slot was not asked (None).
    plain_left = None if owed_first else pytest.approx(0, abs=0.01)
    assert decision.remaining == (plain_left, pytest.approx(-4, abs=0.01))
    client = cluster.client()
    assert float(client.hget(bucket(owing, owing_id), "tokens")) == pytest.approx(-4, abs=0.01)
    assert float(client.hget(bucket(plain, plain_id), "tokens")) == pytest.approx(0, abs=0.01)
    assert client.pttl(bucket(owing, owing_id)) > 5.9 * 3600 * 1000  # from -4 back to 2 at 1 an hour
