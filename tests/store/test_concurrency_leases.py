"""Concurrency leases: the pure model (gateway.limiter.leases), and the stores that carry it
out (the in-process store, one Redis, a Redis Cluster) held to the same answers through the
Store interface, on real redis-server processes.

The module is one xdist group, so that under `--dist loadgroup` one worker starts the Cluster
and the redis-server, not each worker that draws one of its tests. The tests that wait for a
lease to expire (its TTL is at least 1 s, as the config requires) wait in all three stores at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from gateway.limiter import leases
from gateway.limiter.concurrency import Concurrency
from gateway.limiter.memory_store import MemoryStore
from gateway.limiter.store import LeaseCheck, LeaseDecision, Store
from gateway.redis.store import RedisStore
from gateway.testing import config_from_yaml
from tests.helpers import open_store, redis_store, store_config
from tests.processes import RedisCluster, RedisServer, eventually, free_port

LIMITS_YAML = """
limits:
  two:   {concurrency: 2, key: header:x-api-key}
  one:   {concurrency: 1, lease_ttl: 1s}
routes:
  - match: {path: /}
    upstream: http://127.0.0.1:1
    limits: [two, one]
"""
LIMITS = {limit.name: limit for limit in config_from_yaml(LIMITS_YAML).concurrency_limits}
STORES = ["memory", "redis", "cluster"]

# A Redis Cluster takes about 2 s to start: one for the module, not one per worker.
pytestmark = pytest.mark.xdist_group("concurrency_leases")


# -- the model ---------------------------------------------------------------


def test_leases_are_admitted_up_to_the_capacity_and_the_next_is_refused():
    held: dict[str, float] = {}
    outcomes = []
    for lease in ("a", "b", "c"):
        outcome, held = leases.acquire(held, lease, capacity=2, ttl=10, now=0)
        outcomes.append(outcome)
    assert outcomes == [
        leases.LeaseOutcome(admitted=True, in_flight=1),
        leases.LeaseOutcome(admitted=True, in_flight=2),
        leases.LeaseOutcome(admitted=False, in_flight=2),
    ]
    assert held == {"a": 10, "b": 10}


def test_a_released_lease_makes_room_and_releasing_an_unknown_one_changes_nothing():
    held = {"a": 10.0, "b": 10.0}
    assert leases.release(held, "zzz", now=1) == held
    held = leases.release(held, "a", now=1)
    outcome, held = leases.acquire(held, "c", capacity=2, ttl=10, now=1)
    assert outcome.admitted and held == {"b": 10, "c": 11}


def test_an_expired_lease_counts_for_nothing_from_the_moment_it_expires():
    held = {"a": 10.0, "b": 12.0}
    assert not leases.acquire(held, "c", capacity=2, ttl=10, now=9.999)[0].admitted
    outcome, held = leases.acquire(held, "c", capacity=2, ttl=10, now=10)  # "a" expires at 10 exactly
    assert outcome == leases.LeaseOutcome(admitted=True, in_flight=2)
    assert held == {"b": 12, "c": 20}


def test_renewing_a_held_lease_extends_it_without_counting_it_twice():
    held = {"a": 10.0, "b": 10.0}
    outcome, held = leases.acquire(held, "a", capacity=2, ttl=10, now=5)
    assert outcome == leases.LeaseOutcome(admitted=True, in_flight=2)
    assert held == {"a": 15, "b": 10}


def test_a_lease_that_expired_before_its_renewal_is_refused_if_others_took_the_room():
    held = {"a": 10.0, "b": 30.0, "c": 30.0}  # "c" came in once "a" had expired
    outcome, held = leases.acquire(held, "a", capacity=2, ttl=10, now=20)
    assert outcome == leases.LeaseOutcome(admitted=False, in_flight=2)
    assert "a" not in held


def test_the_in_process_store_follows_its_clock():
    now = [0.0]
    store = MemoryStore(clock=lambda: now[0])
    one = LIMITS["one"]  # concurrency 1, lease_ttl 1s
    first, second = (LeaseCheck(limit=one, identity="ip=192.0.2.1", lease=lease) for lease in ("x", "y"))
    assert store.acquire_now(first).admitted
    assert not store.acquire_now(second).admitted
    assert store.acquire_now(LeaseCheck(limit=one, identity="ip=192.0.2.2", lease="y")).admitted  # another identity
    now[0] = 0.999
    assert not store.acquire_now(second).admitted
    now[0] = 1.0
    assert store.acquire_now(second) == LeaseDecision(admitted=True, in_flight=1)


# -- the stores, held to the model -------------------------------------------


@pytest.fixture(scope="module")
def redis_for_leases():
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def cluster_for_leases():
    with RedisCluster() as cluster:
        yield cluster


def emptied_store_url(request: pytest.FixtureRequest, kind: str) -> str | None:
    """The URL of the module's store of `kind` (None: the in-process store), emptied."""
    if kind == "redis":
        server = request.getfixturevalue("redis_for_leases")
        with server.client() as client:
            client.flushall()
        return server.url
    if kind == "cluster":
        cluster = request.getfixturevalue("cluster_for_leases")
        for node in cluster.nodes[:3]:
            with cluster.node_client(node.port) as client:
                if client.info("replication")["role"] == "master":
                    client.flushall()
        return cluster.url
    return None


@pytest.fixture(params=STORES)
async def store(request):
    async with open_store(emptied_store_url(request, request.param)) as opened:
        yield opened


@pytest.fixture
async def every_store(request):
    """The three stores at once, by name, for the tests that wait out a TTL in each."""
    async with contextlib.AsyncExitStack() as stack:
        yield {kind: await stack.enter_async_context(open_store(emptied_store_url(request, kind))) for kind in STORES}


async def in_each(stores: dict[str, Store], check) -> None:
    """`check(store)` in every store at once; a failure names its store."""

    async def named(kind: str, store: Store) -> None:
        try:
            await check(store)
        except AssertionError as error:
            raise AssertionError(f"{kind}: {error}") from error

    await asyncio.gather(*(named(kind, store) for kind, store in stores.items()))


def lease(name: str, lease_id: str, identity: str = "header:x-api-key=k") -> LeaseCheck:
    return LeaseCheck(limit=LIMITS[name], identity=identity, lease=lease_id)


async def test_every_store_admits_refuses_renews_and_releases_as_the_model_does(store: Store):
    answers = [
        await store.acquire(lease("two", "a")),
        await store.acquire(lease("two", "b")),
        await store.acquire(lease("two", "c")),
        await store.acquire(lease("two", "a")),  # a renewal
        await store.acquire(lease("two", "c", identity="header:x-api-key=other")),
    ]
    assert answers == [
        LeaseDecision(admitted=True, in_flight=1),
        LeaseDecision(admitted=True, in_flight=2),
        LeaseDecision(admitted=False, in_flight=2),
        LeaseDecision(admitted=True, in_flight=2),
        LeaseDecision(admitted=True, in_flight=1),
    ]
    await store.release(lease("two", "a"))
    await store.release(lease("two", "a"))  # twice: the second finds nothing
    await store.release(lease("two", "nobody"))
    assert await store.acquire(lease("two", "c")) == LeaseDecision(admitted=True, in_flight=2)
    assert not (await store.acquire(lease("two", "d"))).admitted


async def test_every_store_frees_an_unreleased_lease_after_its_ttl_and_not_before(every_store: dict[str, Store]):
    async def frees(store: Store) -> None:
        before = time.monotonic()  # the lease is taken no earlier than this
        assert (await store.acquire(lease("one", "dead"))).admitted  # lease_ttl 1s, never released
        assert not (await store.acquire(lease("one", "next"))).admitted
        admitted_at = [0.0]

        async def admitted() -> bool:
            if (await store.acquire(lease("one", "next"))).admitted:
                admitted_at[0] = time.monotonic()
                return True
            return False

        await eventually(admitted, what="the dead lease to expire", deadline=5)
        # Not before the TTL, from a moment no later than the take (Redis counts whole
        # milliseconds, so its clock may read up to 1 ms behind at the take).
        assert admitted_at[0] - before >= 1.0 - 0.001

    await in_each(every_store, frees)


async def test_redis_times_a_lease_by_its_own_clock_to_the_millisecond(redis_for_leases):
    """The lease's expiry, as Redis keeps it, is its TIME at the take plus the TTL: read
    from Redis's clock before and after, not from how long the test waited."""
    with redis_for_leases.client() as client:
        client.flushall()
    async with redis_store(redis_for_leases.url) as store:
        client = redis_for_leases.client()
        dead = lease("one", "dead", identity="header:x-api-key=timed")  # lease_ttl 1s
        before = _millis(client.time())
        assert (await store.acquire(dead)).admitted
        after = _millis(client.time())
        expires = client.zscore(await store._lease_key(dead), "dead")
        client.close()
        assert before + 1000 <= expires <= after + 1000


def _millis(time_reply: tuple[int, int]) -> int:
    seconds, micros = time_reply
    return seconds * 1000 + micros // 1000


async def test_many_concurrent_takes_admit_exactly_the_capacity(store: Store):
    answers = await asyncio.gather(*(store.acquire(lease("two", f"l{i}")) for i in range(50)))
    assert sum(answer.admitted for answer in answers) == 2


async def test_every_store_reads_and_forgets_an_identitys_leases_for_the_admin_api(store: Store):
    assert (await store.acquire(lease("two", "a"))).admitted
    assert (await store.acquire(lease("two", "b"))).admitted
    for _ in range(2):  # reading twice changes nothing
        held = await store.read_leases(LIMITS["two"], "header:x-api-key=k")
        assert held.in_flight == 2 and ":leases:{" in held.key and "x-api-key" not in held.key
        assert 59 < held.next_expiry_in <= held.last_expiry_in <= 60  # the default lease_ttl
    other = await store.read_leases(LIMITS["two"], "header:x-api-key=other")
    assert (other.in_flight, other.next_expiry_in, other.last_expiry_in) == (0, None, None)
    assert other.key != held.key
    assert await store.delete_leases(LIMITS["two"], "header:x-api-key=k") is True
    assert await store.delete_leases(LIMITS["two"], "header:x-api-key=k") is False
    assert (await store.read_leases(LIMITS["two"], "header:x-api-key=k")).in_flight == 0
    # The requests that held them go on: a release finds nothing, a renewal takes its lease afresh.
    await store.release(lease("two", "a"))
    assert await store.acquire(lease("two", "b")) == LeaseDecision(admitted=True, in_flight=1)
    assert await store.acquire(lease("two", "c")) == LeaseDecision(admitted=True, in_flight=2)
    assert (await store.read_leases(LIMITS["two"], "header:x-api-key=k")).in_flight == 2


async def test_an_expired_lease_is_read_as_gone_and_a_reset_finds_none_live(every_store: dict[str, Store]):
    async def read_as_gone(store: Store) -> None:
        assert (await store.acquire(lease("one", "dead"))).admitted  # lease_ttl 1s, never released or renewed
        held = await store.read_leases(LIMITS["one"], "header:x-api-key=k")
        assert held.in_flight == 1 and 0 < held.next_expiry_in <= 1

        async def expired() -> bool:
            return (await store.read_leases(LIMITS["one"], "header:x-api-key=k")).in_flight == 0

        await eventually(expired, what="the lease to expire", deadline=5)
        assert await store.delete_leases(LIMITS["one"], "header:x-api-key=k") is False

    await in_each(every_store, read_as_gone)


async def test_a_lease_set_lives_no_longer_than_its_last_lease(redis_for_leases):
    with redis_for_leases.client() as client:
        client.flushall()
        async with redis_store(redis_for_leases.url) as shared:
            await shared.acquire(lease("one", "a"))
        (key,) = client.keys("rl:one:leases:*")
        assert 0 < client.pttl(key) <= 1000
        assert client.zcard(key) == 1


# -- the request side: all of a route's leases, or none ------------------------


async def test_leases_taken_before_a_refusal_are_given_back():
    store = MemoryStore()
    concurrency = Concurrency(store)
    two, one = LIMITS["two"], LIMITS["one"]
    first = await concurrency.acquire([two, one], ["ip=192.0.2.1", "ip=192.0.2.1"])
    assert first.admitted
    refused = await concurrency.acquire([two, one], ["ip=192.0.2.1", "ip=192.0.2.1"])
    assert not refused.admitted and not refused.store_failed
    assert [s.outcome for s in refused.statuses] == ["skipped", "concurrency_limited"]
    # `two` holds only the first request's lease: one more fits, then no more.
    assert (await concurrency.acquire([two], ["ip=192.0.2.1"])).admitted
    assert not (await concurrency.acquire([two], ["ip=192.0.2.1"])).admitted
    first.release()
    assert (await concurrency.acquire([one], ["ip=192.0.2.1"])).admitted


async def test_a_store_that_cannot_be_reached_leaves_each_limit_to_its_policy():
    down = RedisStore(store_config(f"redis://127.0.0.1:{free_port()}/0"))  # nothing listens there
    concurrency = Concurrency(down, local_divisor=2)
    yaml = """
limits:
  open:   {concurrency: 1}
  closed: {concurrency: 1, on_store_error: closed}
  local:  {concurrency: 4, on_store_error: local}
routes:
  - {match: {path: /}, upstream: "http://127.0.0.1:1", limits: [open, closed, local]}
"""
    limits = {limit.name: limit for limit in config_from_yaml(yaml).concurrency_limits}
    try:
        opened = [await concurrency.acquire([limits["open"]], ["ip=x"]) for _ in range(3)]
        assert all(a.admitted and a.statuses[0].outcome == "fail_open" for a in opened)
        closed = await concurrency.acquire([limits["closed"]], ["ip=x"])
        assert not closed.admitted and closed.store_failed and closed.statuses[0].outcome == "fail_closed"
        # 4 across the fleet, local_divisor 2: 2 here.
        local = [await concurrency.acquire([limits["local"]], ["ip=x"]) for _ in range(3)]
        assert [a.admitted for a in local] == [True, True, False]
        assert {a.statuses[0].outcome for a in local} == {"fail_local"}
        local[0].release()
        assert (await concurrency.acquire([limits["local"]], ["ip=x"])).admitted
        # As the plans compile it: the share is carried by the lease, and counts the same leases.
        prepared = concurrency.prepare(limits["local"])
        assert prepared.local is not None and prepared.local.concurrency == 2
        assert concurrency.prepare(limits["open"]).local is None
        carried = await concurrency.acquire([limits["local"]], ["ip=x"], prepared=[prepared])
        assert not carried.admitted and carried.statuses[0].outcome == "fail_local"
        local[1].release()
        carried = await concurrency.acquire([limits["local"]], ["ip=x"], prepared=[prepared])
        assert carried.admitted
        carried.release()  # through the carried share: the room is back
        assert (await concurrency.acquire([limits["local"]], ["ip=x"], prepared=[prepared])).admitted
    finally:
        await down.close()
