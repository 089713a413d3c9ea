"""The newer limit kinds where Redis is highly available or failing: concurrency leases
(`concurrency: N`), hot-key token leases (`lease: N`) and fixed-window quotas on a Redis
Cluster of 3 masters and 3 replicas, through a Sentinel failover, and behind the chaos
proxy (`tests.chaos_proxy`). The gateway runs as users start it, at the default
store.timeout (10 ms) with limits that fail open unless a test says otherwise, and its
upstream (`tests.upstream.CountingUpstream`) counts the requests in flight exactly.

A failover or a fault may hand some requests to the failure policy while it lasts; the
tests first wait for one request decided by Redis again, and from then on every count
is exact and nothing more fails open.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass

import aiohttp
import pytest

from gateway.limiter.keys import identity_digest, lease_key
from gateway.redis.cluster import key_slot
from tests.chaos_proxy import ChaosProxy
from tests.load.test_redis_cluster import PREFIX, SECRET, bucket, cluster_yaml, identities_in_slot_order, send
from tests.load.test_redis_sentinel import sentinel_url
from tests.processes import GatewayProcess, RedisCluster, RedisServer, eventually, gateway_fleet
from tests.scrape import decisions, scrape, settled_decisions, value
from tests.together import Together
from tests.upstream import CountingUpstream, serving

pytestmark = pytest.mark.timing  # measures time, load or memory: one such module runs at a time

CONCURRENCY = 5
CLIENTS = 120  # concurrent requests per round, far past CONCURRENCY
HOT_BURST = 60
LEASE = 10

LEASE_LIMITS = """
limits:
  conns: {{concurrency: {concurrency}, lease_ttl: {ttl}, key: {key}, on_store_error: open}}
  hot: {{rate: 1/hour, burst: {burst}, key: global, lease: {lease}, lease_lapse: 60s, on_store_error: {hot_policy}}}
routes:
  - {{match: {{path: /hot}}, upstream: "{upstream}", limits: [hot]}}
  - {{match: {{path: /}}, upstream: "{upstream}", limits: [conns]}}
"""


def lease_config(store: str, upstream: str, *, ttl: str, key: str = "global", hot_policy: str = "open") -> str:
    """/held (held by the upstream until its gate opens) and any other path but /hot take a
    lease of `conns`; /hot spends tokens leased from `hot`, a global bucket of HOT_BURST."""
    return f"listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\n{store}" + LEASE_LIMITS.format(
        concurrency=CONCURRENCY, ttl=ttl, key=key, burst=HOT_BURST, lease=LEASE, hot_policy=hot_policy, upstream=upstream
    )


async def get(http: aiohttp.ClientSession, url: str, key: str = "") -> int:
    async with http.get(url, headers={"X-API-Key": key} if key else {}) as response:
        await response.read()
        return response.status


async def held_round(http: aiohttp.ClientSession, url: str, upstream: CountingUpstream, count: int, key: str = ""):
    """`count` concurrent requests to /held: (how many the upstream held at once, the
    statuses of those refused), then every held one let go and its status added."""
    tasks = [asyncio.ensure_future(get(http, url + "/held", key)) for _ in range(count)]
    try:
        await eventually(
            lambda: sum(t.done() for t in tasks) + upstream.in_flight[key] == count,
            what="every request refused or held by the upstream",
            deadline=30,
        )
        held = upstream.in_flight[key]
        refused = collections.Counter(t.result() for t in tasks if t.done())
    finally:
        upstream.gate.set()
        statuses = collections.Counter(await asyncio.gather(*tasks))
        upstream.gate.clear()
    return held, refused, statuses


async def decided_by_redis(http: aiohttp.ClientSession, gateway: GatewayProcess, path: str, limit: str, key: str = ""):
    """One request to `path`, and whether `limit` decided it without its failure policy."""
    before = await decisions(http, gateway.admin_url)
    status = await get(http, gateway.url + path, key)
    after = await decisions(http, gateway.admin_url)
    failed = sum(after[limit, d] - before[limit, d] for d in ("fail_open", "fail_closed"))
    return status in (200, 429) and failed == 0


def failures(counts: dict[tuple[str, str], float]) -> float:
    return sum(counts[limit, d] for limit in ("conns", "hot") for d in ("fail_open", "fail_closed"))


# -- Redis Cluster ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    """At real-time priority, as Redis on hosts of its own: counts here are exact at the
    default 10 ms timeout. The failover test, last, changes which node is master."""
    with RedisCluster(dedicated=True) as running:
        yield running


TIGHT = 1
# The loose limit beside the tight one, keyed on X-User: a quota, or a bucket that admits
# past its burst by delaying (a debt of up to max_delay × rate = 1 token), and so is charged
# by every request until the tight one denies it. A minute per token: what refills while
# the test runs is negligible.
LOOSE = {
    "quota": "{quota: {limit: 8, per: day}, key: header:X-User, on_store_error: open}",
    "delay": "{rate: 1/minute, burst: 1, mode: delay, max_delay: 60s, key: header:X-User, on_store_error: open}",
}


@pytest.mark.parametrize("loose_first", [True, False], ids=["loose-slot-first", "loose-slot-last"])
@pytest.mark.parametrize("kind", ["quota", "delay"])
async def test_a_quota_or_a_delay_in_another_slot_is_charged_only_for_what_the_other_admits(
    cluster, upstream, client, kind, loose_first
):
    """A loose limit (a quota of 8 a day, or a delaying bucket) and a bucket of 1 keyed on
    X-API-Key, in different slots: of 100 concurrent requests, and one more through a second
    gateway, exactly 1 passes, and the loose limit ends charged for exactly that one, whether
    its slot is charged first (and refunded by lua/token_refund.lua) or last."""
    loose, tight = f"{kind}_{loose_first}", f"tight_{kind}_{loose_first}"
    limits = (
        f"  {loose}: {LOOSE[kind]}\n"
        f"  {tight}: {{rate: 1/hour, burst: {TIGHT}, key: header:X-API-Key, on_store_error: open}}"
    )
    user, key = identities_in_slot_order(loose, tight, a_first=loose_first)
    headers = {"X-User": user, "X-API-Key": key}
    redis = cluster.client()
    charged = bucket(loose, f"header:x-user={user}")

    def charged_for_tight() -> bool:
        if kind == "quota":
            return redis.hget(charged, "n") == str(TIGHT)
        # Its burst of 1 spent; a second charge would leave it in debt.
        tokens = redis.hget(charged, "tokens")
        return tokens is not None and abs(float(tokens)) < 0.1

    config = cluster_yaml(cluster.url, upstream, limits, f"[{loose}, {tight}]")
    with GatewayProcess(config) as gateway, GatewayProcess(config) as fresh:
        results = await asyncio.gather(*(send(client, gateway.url + "/", headers) for _ in range(100)))
        # A gateway that has seen no denial asks Redis, however the flood's requests raced.
        results.append(await send(client, fresh.url + "/", headers))
        counts = [await settled_decisions(client, g.admin_url) for g in (gateway, fresh)]
        # The refunds run after the denials are answered.
        await eventually(charged_for_tight, what=f"{loose} refunded down to {TIGHT} charges")
        stderr = "".join(gateway.stderr_lines + fresh.stderr_lines)
    assert collections.Counter(status for status, _, _ in results) == {200: TIGHT, 429: 101 - TIGHT}
    assert all(decided for _, decided, _ in results)
    assert sum(c[tight, "allow"] for c in counts) == TIGHT
    assert sum(c[limit, "fail_open"] for c in counts for limit in (loose, tight)) == 0
    assert counts[1][tight, "deny"] == 1
    assert "Traceback" not in stderr


def master_of(cluster: RedisCluster, key: str) -> int:
    slot = key_slot(key)
    return next(port for port, ranges in cluster.masters().items() if any(a <= slot <= b for a, b in ranges))


def concurrency_key(identity: str) -> str:
    return lease_key(PREFIX, "conns", identity_digest(SECRET.encode(), f"header:x-api-key={identity}"))


async def test_three_gateways_hold_each_client_to_its_concurrency_with_leases_on_every_master(cluster):
    """Six clients, two on each master (each client's lease set is one key in its slot), send
    300 requests at once through three gateways: exactly CONCURRENCY of each reach the upstream,
    none fails open. The admin API of one gateway reads each client's leases and resets them on
    the master holding them, and the client then has its room again, beside the requests going on."""
    counting = CountingUpstream()
    masters = sorted(cluster.masters())
    names = [f"client-{n}" for n in range(200)]
    clients = [name for port in masters for name in [n for n in names if master_of(cluster, concurrency_key(n)) == port][:2]]
    async with serving(counting.handle) as upstream_url, aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0)
    ) as http:
        store = f'store: {{url: "{cluster.url}", key_secret: {SECRET}}}\n'
        config = lease_config(store, upstream_url, ttl="60s", key="header:X-API-Key")
        with gateway_fleet(config, 3) as gateways:
            tasks = [
                asyncio.ensure_future(get(http, gateways[n % 3].url + "/held", clients[n % len(clients)])) for n in range(300)
            ]
            await eventually(
                lambda: sum(t.done() for t in tasks) + sum(counting.in_flight.values()) == 300,
                what="every request refused or held",
            )
            held = {name: counting.in_flight[name] for name in clients}
            sets = {name: cluster.node_client(master_of(cluster, concurrency_key(name))).zcard(concurrency_key(name))
                    for name in clients}
            admin = []
            for name in clients:
                async with http.get(f"{gateways[1].admin_url}/buckets/conns?value={name}") as response:
                    read = await response.json()
                async with http.delete(f"{gateways[2].admin_url}/buckets/conns?value={name}") as response:
                    reset = await response.json()
                admin.append((read["key"], read["in_flight"], reset["held"]))
            again = collections.Counter(await asyncio.gather(*(get(http, gateways[0].url + "/fast", n) for n in clients)))
            counting.gate.set()
            statuses = collections.Counter(await asyncio.gather(*tasks))
            counting.gate.clear()
            counts = [await settled_decisions(http, g.admin_url) for g in gateways]
            stderr = "".join(line for g in gateways for line in g.stderr_lines)
    assert held == sets == {name: CONCURRENCY for name in clients}
    assert {master_of(cluster, concurrency_key(name)) for name in clients} == set(masters)
    assert admin == [(concurrency_key(name), CONCURRENCY, True) for name in clients]
    assert again == {200: len(clients)}
    assert statuses == {200: CONCURRENCY * len(clients), 429: 300 - CONCURRENCY * len(clients)}
    assert sum(c["conns", "fail_open"] for c in counts) == 0
    assert "Traceback" not in stderr


async def test_leases_a_killed_master_held_are_released_on_its_replica_soon_after_the_promotion():
    """Five leases of a client whose slot is on one master end while that master is dead
    (kill -9), so their releases fail. Clients on the other masters keep being answered, and
    that must not use up the releases' early retries: once the replica is master, the releases
    find it within a second, not at the next step of their backoff (2 s), nor the TTL (60 s)."""
    counting = CountingUpstream()
    with RedisCluster(dedicated=True) as cluster:
        async with serving(counting.handle) as upstream_url, aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0)
        ) as http:
            store = f'store: {{url: "{cluster.url}", key_secret: {SECRET}}}\n'
            config = lease_config(store, upstream_url, ttl="60s", key="header:X-API-Key")
            victim_port = sorted(cluster.masters())[0]
            replica = cluster.replica_of(victim_port)
            names = [f"client-{n}" for n in range(200)]
            held = next(n for n in names if master_of(cluster, concurrency_key(n)) == victim_port)
            others = [n for n in names if master_of(cluster, concurrency_key(n)) != victim_port][:8]
            victim = next(node for node in cluster.nodes if node.port == victim_port)
            with GatewayProcess(config) as gateway:
                tasks = [asyncio.ensure_future(get(http, gateway.url + "/held", held)) for _ in range(CONCURRENCY)]
                await eventually(lambda: counting.in_flight[held] == CONCURRENCY, what="the leases held")
                stop = asyncio.Event()

                async def load(who: str) -> None:
                    while not stop.is_set():
                        await get(http, gateway.url + "/fast", who)

                workers = [asyncio.ensure_future(load(who)) for who in others]
                victim.stop()
                counting.gate.set()
                completed = await asyncio.gather(*tasks)
                await eventually(lambda replica=replica: replica in cluster.masters(), what="the replica promoted")
                promoted = time.monotonic()
                key = concurrency_key(held)
                await eventually(lambda: cluster.node_client(replica).zcard(key) == 0, what="the leases released")
                gone_after = time.monotonic() - promoted
                stop.set()
                await asyncio.gather(*workers)
                stderr = "".join(gateway.stderr_lines)
    print(f"kill -9: leases gone {gone_after * 1000:.0f} ms after the promotion")
    assert completed == [200] * CONCURRENCY
    assert gone_after < 1.0, f"the client's room came back {gone_after:.2f} s after the promotion"
    assert "Traceback" not in stderr


def lease_keys(cluster: RedisCluster, pattern: str) -> list[str]:
    return [key for port in cluster.masters() for key in cluster.node_client(port).keys(pattern)]


async def test_concurrency_and_token_leases_stay_exact_after_a_script_flush_and_a_failover_of_every_master(cluster):
    """A global concurrency limit of 5 and a global bucket of 60 leased 10 tokens at a time.
    Three times (as started, after SCRIPT FLUSH on every node, after CLUSTER FAILOVER of every
    master, whose promoted replicas hold no script): 120 concurrent requests get exactly 5
    into the upstream at once and 115 refused, and the token floods admit exactly the bucket,
    60 in all, none by the failure policy once Redis decided a request again."""
    upstream = CountingUpstream()
    async with serving(upstream.handle) as upstream_url, aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0)
    ) as http:
        store = f'store: {{url: "{cluster.url}"}}\n'
        with GatewayProcess(lease_config(store, upstream_url, ttl="60s")) as gateway:
            rounds, hot = [], collections.Counter()

            async def one_round(tokens: int) -> None:
                rounds.append(await held_round(http, gateway.url, upstream, CLIENTS))
                # Leases are released in the background once each response has ended.
                await eventually(lambda: not lease_keys(cluster, "rl:conns:leases:*"), what="every lease released")
                hot.update(await asyncio.gather(*(get(http, gateway.url + "/hot", "hot") for _ in range(tokens))))

            await one_round(20)
            for node in cluster.nodes:
                cluster.node_client(node.port).script_flush()
            await one_round(20)
            unfailed = await settled_decisions(http, gateway.admin_url)
            old_masters = list(cluster.masters())
            for master in old_masters:
                replica = cluster.replica_of(master)
                cluster.node_client(replica).execute_command("CLUSTER FAILOVER")
                await eventually(lambda replica=replica: replica in cluster.masters(), what="the replica promoted")
            # The failover window: requests the failure policy answered, until Redis decides again.
            await eventually(lambda: decided_by_redis(http, gateway, "/fast", "conns"), what="conns decided again")
            await eventually(lambda: decided_by_redis(http, gateway, "/hot", "hot", "hot"), what="hot decided again")
            after_window = await settled_decisions(http, gateway.admin_url)
            await one_round(100)
            counts = await settled_decisions(http, gateway.admin_url)
            stderr = "".join(gateway.stderr_lines)
    assert not set(old_masters) & set(cluster.masters())
    for held, refused, statuses in rounds:
        assert (held, refused, statuses) == (CONCURRENCY, {429: CLIENTS - CONCURRENCY}, {200: CONCURRENCY, 429: CLIENTS - CONCURRENCY})
    assert upstream.most[""] == CONCURRENCY
    assert failures(unfailed) == 0  # as started and after the script flush
    assert failures(counts) == failures(after_window)  # after the failover window
    # Never more than the bucket: every token charged was spent (no lease lapsed).
    assert counts["hot", "allow"] == HOT_BURST
    # The floods' share: the bucket less what the probe after the failover took (40 went before).
    assert hot[200] == HOT_BURST - (after_window["hot", "allow"] - 40) and hot[429] == 140 - hot[200]
    assert "Traceback" not in stderr and "NOSCRIPT" not in stderr


# -- faults (chaos proxy) -----------------------------------------------------------------


def all_expired(redis) -> bool:
    """Whether every concurrency lease in `redis` has expired, by Redis's clock."""
    seconds, micros = redis.time()
    now_ms = seconds * 1000 + micros // 1000
    return all(
        expiry <= now_ms for key in redis.keys("rl:conns:leases:*") for _, expiry in redis.zrange(key, 0, -1, withscores=True)
    )


@dataclass
class Released:
    """What one network failure did to five held leases (see the test below)."""

    completed: list[int]
    during: collections.Counter
    failed_releases: float
    held: int
    refused: collections.Counter
    failures: tuple[float, float]  # failure-policy decisions, before and after the last round
    gone_after: float
    stderr: str


async def release_fails(mode: str) -> Released:
    ttl = 1.0
    upstream = CountingUpstream()
    async with serving(upstream.handle) as upstream_url, aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0)
    ) as http:
        with RedisServer(dedicated=True) as redis, ChaosProxy(redis.port) as proxy:
            store = f'store: {{url: "{proxy.url}"}}\n'
            config = lease_config(store, upstream_url, ttl=f"{ttl}s", key="header:X-API-Key", hot_policy="closed")
            with GatewayProcess(config) as gateway:
                tasks = [asyncio.ensure_future(get(http, gateway.url + "/held", "k")) for _ in range(CONCURRENCY)]
                await eventually(lambda: upstream.in_flight["k"] == CONCURRENCY, what="the leases held")
                await asyncio.to_thread(proxy.set_mode, mode)
                during = collections.Counter(await asyncio.gather(*(get(http, gateway.url + "/hot") for _ in range(10))))
                # Held until the leases expired in Redis: every renewal meanwhile failed.
                await eventually(lambda: all_expired(redis.client()), what="the unrenewed leases expired", deadline=ttl + 1)
                upstream.gate.set()
                completed = await asyncio.gather(*tasks)
                upstream.gate.clear()

                async def release_failures() -> float:
                    return value((await scrape(http, gateway.admin_url))[1], "gateway_concurrency_lease_release_failures_total")

                async def every_release_failed() -> bool:
                    return await release_failures() == CONCURRENCY

                await eventually(every_release_failed, what="the failed releases counted")
                await asyncio.to_thread(proxy.set_mode, "pass")
                healed = time.monotonic()
                await eventually(lambda: not redis.client().keys("rl:conns:leases:*"), what="the leases gone", deadline=ttl + 1)
                gone_after = time.monotonic() - healed
                await eventually(lambda: decided_by_redis(http, gateway, "/fast", "conns", "probe"), what="Redis deciding again")
                before = await settled_decisions(http, gateway.admin_url)
                held, refused, _ = await held_round(http, gateway.url, upstream, CONCURRENCY + 1, "k")
                after = await settled_decisions(http, gateway.admin_url)
                failed_releases = await release_failures()
                stderr = "".join(gateway.stderr_lines)
    return Released(completed, during, failed_releases, held, refused, (failures(before), failures(after)), gone_after, stderr)


# Each mode mostly waits out a TTL of 1 s, with parts of its own: the three run at once.
RELEASE_MODES = Together[Released]([("blackhole", "reset", "refuse")])


@pytest.mark.parametrize("mode", ["blackhole", "reset", "refuse"])
async def test_a_release_the_store_fails_is_counted_and_left_to_the_ttl(mode):
    """Five requests hold leases when the network to Redis fails, and outlive them, as every
    renewal fails: each still completes with 200, each release that fails is counted once,
    a token lease call the store fails is answered by its policy (closed: 503), and once the
    network is back the leases are gone within the TTL: exactly 5 are admitted again."""
    run = await RELEASE_MODES.result(mode, lambda modes: asyncio.gather(*(release_fails(m) for m in modes)))
    print(f"{mode}: leases gone {run.gone_after * 1000:.0f} ms after the network came back")
    assert run.completed == [200] * CONCURRENCY
    assert run.during == {503: 10}
    assert run.failed_releases == CONCURRENCY
    assert (run.held, run.refused) == (CONCURRENCY, {429: 1})
    assert run.failures[1] == run.failures[0]
    assert "Traceback" not in run.stderr


# -- Sentinel -------------------------------------------------------------------------------


async def test_leases_held_when_the_master_dies_are_gone_within_the_ttl_on_the_promoted_one(sentinel_group):
    """Five leases held when the master is killed: once the replica is master, the requests
    complete and their leases are released on the promoted master. The releases sent while
    the gateway had not yet reconnected fail and are tried again, so the leases are gone
    seconds after the requests ended, not the TTL (30 s) later; exactly 5 are admitted again."""
    master, replica, sentinels = sentinel_group
    ttl = 30.0
    upstream = CountingUpstream()
    async with serving(upstream.handle) as upstream_url, aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0)
    ) as http:
        store = f'store: {{url: "{sentinel_url(sentinels)}"}}\n'
        config = lease_config(store, upstream_url, ttl=f"{ttl}s", key="header:X-API-Key")
        with GatewayProcess(config) as gateway:
            tasks = [asyncio.ensure_future(get(http, gateway.url + "/held", "k")) for _ in range(CONCURRENCY)]
            await eventually(lambda: upstream.in_flight["k"] == CONCURRENCY, what="the leases held")
            leases = master.client().keys("rl:conns:leases:*")
            assert len(leases) == 1 and master.client().zcard(leases[0]) == CONCURRENCY
            await eventually(lambda: replica.client().zcard(leases[0]) == CONCURRENCY, what="the leases replicated")
            master.stop()
            await eventually(lambda: replica.client().info("replication")["role"] == "master", what="the promotion", deadline=15)
            upstream.gate.set()
            completed = await asyncio.gather(*tasks)
            upstream.gate.clear()
            released = time.monotonic()
            await eventually(lambda: not replica.client().exists(leases[0]), what="the leases released", deadline=10)
            gone_after = time.monotonic() - released
            await eventually(lambda: decided_by_redis(http, gateway, "/fast", "conns", "probe"), what="Redis deciding again")
            before = await settled_decisions(http, gateway.admin_url)
            held, refused, _ = await held_round(http, gateway.url, upstream, 3 * CONCURRENCY, "k")
            after = await settled_decisions(http, gateway.admin_url)
            stderr = "".join(gateway.stderr_lines)
    print(f"sentinel: leases gone {gone_after * 1000:.0f} ms after their requests ended")
    assert completed == [200] * CONCURRENCY
    assert gone_after < ttl / 3  # released, not expired
    assert (held, refused) == (CONCURRENCY, {429: 2 * CONCURRENCY})
    assert failures(after) == failures(before)
    assert "Traceback" not in stderr
