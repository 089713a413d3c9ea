"""envoyproxy/ratelimit's own `ShouldRateLimit` vectors (commit f2fb157), each in the mode
it assumes, against the gateway started as users start it, over grpcio's client and a real
socket, on a private redis-server (and the in-process store where said). The vectors are
our own test data (tests/rls_reference_answers_data.py); nothing here reads that repository.

From test/integration/integration_test.go (testBasicBaseConfig, testConfigReload),
test/redis/fixed_cache_impl_test.go, test/service/ratelimit_test.go and
integration-test/scripts/*.sh (the descriptors examples/envoy/proxy.yaml's routes send).
Where the gateway deliberately answers otherwise, the test asserts the gateway's answer and
names the difference documented in docs/envoy-rls.md ("The reference's vectors"):

- all or nothing: a refused request charges none of its descriptors, as the reference
  does with STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT, not as its default;
- token buckets: duration_until_reset is until the bucket is full again (or until a refused
  request could pass), so a charge moves it later; in `algorithm: fixed_window` it counts
  down to the window's end as the reference's does;
- a count above the limit, which only charging every hit reaches, needs `charge: always`.

The per-second limits refill while a test runs, so a remaining count may be higher by
what the elapsed time refilled (`refilled`), never lower.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import time
from pathlib import Path

import pytest

from tests import rls_reference_answers_data as data
from tests.processes import GatewayProcess, RedisServer, eventually, free_port

grpc = pytest.importorskip("grpc")
from gateway.envoy.generated import ratelimit_pb2, rls_pb2, rls_pb2_grpc  # noqa: E402

Response = rls_pb2.RateLimitResponse
OK, OVER = Response.Code.OK, Response.Code.OVER_LIMIT
SECOND, MINUTE, HOUR, DAY = (Response.RateLimit.Unit.Value(u) for u in ("SECOND", "MINUTE", "HOUR", "DAY"))
MAX_UINT32 = 2**32 - 1
Descriptor = ratelimit_pb2.RateLimitDescriptor

GATEWAY = "{store}rls_listen: 127.0.0.1:{port}\nrls_config: {directory}\nroutes: [{{match: {{path: /}}, upstream: http://127.0.0.1:9}}]\n"


def d(*entries: tuple[str, str], hits: int | None = None) -> Descriptor:
    descriptor = Descriptor(entries=[Descriptor.Entry(key=k, value=v) for k, v in entries])
    if hits is not None:
        descriptor.hits_addend.value = hits
    return descriptor


def written(directory: Path, files: dict[str, str]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(text)
    return directory


@contextlib.contextmanager
def serving(directory: Path, store_url: str | None):
    store = f'store: {{url: "{store_url}"}}\n' if store_url else ""  # none: the in-process store
    port = free_port()
    with GatewayProcess(GATEWAY.format(store=store, port=port, directory=directory)) as gateway:
        gateway.rls_target = f"127.0.0.1:{port}"
        yield gateway


@pytest.fixture(scope="module")
def redis():
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def gateway(redis, tmp_path_factory):
    directory = written(tmp_path_factory.mktemp("reference"), {**data.INTEGRATION, **data.REDIS, **data.SERVICE})
    with serving(directory, redis.url) as gw:
        yield gw


@pytest.fixture(scope="module")
def memory_gateway(tmp_path_factory):
    with serving(written(tmp_path_factory.mktemp("memory"), data.SERVICE), None) as gw:
        yield gw


async def stub_of(gateway):
    channel = grpc.aio.insecure_channel(gateway.rls_target)
    return channel, rls_pb2_grpc.RateLimitServiceStub(channel)


@pytest.fixture
async def rls(gateway):
    channel, stub = await stub_of(gateway)
    async with channel:
        yield Asker(stub)


class Asker:
    """ShouldRateLimit, and the refill a per-second limit may show since the test began."""

    def __init__(self, stub) -> None:
        self.stub = stub
        self.started = time.monotonic()

    async def __call__(self, domain: str, *descriptors: Descriptor, hits: int = 0):
        return await self.stub.ShouldRateLimit(rls_pb2.RateLimitRequest(domain=domain, descriptors=descriptors, hits_addend=hits))

    def refilled(self, per_second: float) -> int:
        """Whole tokens a limit of `per_second` may have refilled since the test began."""
        return math.floor((time.monotonic() - self.started) * per_second)


def statuses(response) -> list[tuple]:
    """(code, requests_per_unit, unit, limit_remaining) per descriptor; no current_limit: (code, None, None, remaining)."""
    return [
        (s.code, s.current_limit.requests_per_unit, s.current_limit.unit, s.limit_remaining)
        if s.HasField("current_limit")
        else (s.code, None, None, s.limit_remaining)
        for s in response.statuses
    ]


def remaining_within(ask: Asker, response, index: int, expected: int, per_second: float, cap: int) -> None:
    actual = response.statuses[index].limit_remaining
    assert expected <= actual <= min(cap, expected + ask.refilled(per_second)), (actual, expected)


# --- test/integration/integration_test.go: testBasicBaseConfig -----------------------------


async def test_integration_an_unknown_domain_has_no_limit(rls):
    response = await rls("foo", d(("hello", "world")))
    assert response.overall_code == OK and statuses(response) == [(OK, None, None, 0)]


async def test_integration_fifty_per_second_leaves_49_and_says_when_it_resets(rls):
    response = await rls("basic", d(("key1", "foo")))
    assert statuses(response) == [(OK, 50, SECOND, 49)]
    assert response.statuses[0].HasField("duration_until_reset")


async def test_integration_twenty_per_minute_then_over_the_limit(rls):
    for i in range(25):
        response = await rls("another", d(("key2", "twenty-five")))
        if i < 20:
            assert statuses(response)[0][:3] == (OK, 20, MINUTE)
            remaining_within(rls, response, 0, 19 - i, 20 / 60, 20)
        else:
            assert response.overall_code == OVER and statuses(response) == [(OVER, 20, MINUTE, 0)]


async def test_integration_two_keys_of_a_domain_as_stop_cache_key_increment_when_overlimit(rls):
    """From the 11th request key3 (10/hour) is over. The reference's default charges key2
    anyway (limit_remaining 19 - i); with STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT it stays
    at 10, which is the gateway's all or nothing."""
    for i in range(15):
        response = await rls("another", d(("key2", "two-keys")), d(("key3", "two-keys")))
        if i < 10:
            assert response.overall_code == OK and [s[:3] for s in statuses(response)] == [(OK, 20, MINUTE), (OK, 10, HOUR)]
            remaining_within(rls, response, 0, 19 - i, 20 / 60, 20)
            assert response.statuses[1].limit_remaining == 9 - i
        else:
            assert response.overall_code == OVER and statuses(response)[1] == (OVER, 10, HOUR, 0)
            assert statuses(response)[0][:3] == (OK, 20, MINUTE)
            remaining_within(rls, response, 0, 10, 20 / 60, 20)


async def _straddling_a_second(ask, domain: str, *descriptors: Descriptor):
    """Two hits with a whole-second boundary of the wall clock between them."""
    first = await ask(domain, *descriptors)
    await asyncio.sleep(1.05 - time.time() % 1)  # past the next second: the time to measure, not a wait for a process
    return first, await ask(domain, *descriptors)


async def test_integration_duration_until_reset_counts_down_in_a_fixed_window(redis, tmp_path):
    with serving(written(tmp_path, data.INTEGRATION_FIXED_WINDOW), redis.url) as fixed:
        channel, stub = await stub_of(fixed)
        async with channel:
            first, second = await _straddling_a_second(Asker(stub), "another", d(("key4", "durTest")))
    assert [s[:4] for s in statuses(first) + statuses(second)] == [(OK, 20, DAY, 19), (OK, 20, DAY, 18)]
    assert second.statuses[0].duration_until_reset.seconds < first.statuses[0].duration_until_reset.seconds
    assert first.statuses[0].duration_until_reset.seconds == pytest.approx(86400 - time.time() % 86400, abs=3)


async def test_integration_duration_until_reset_of_a_token_bucket_is_until_it_is_full(rls):
    """Documented difference: a token bucket's reset is when it is full again, which each
    charge moves later (20/day: 4,320 s a token), where a window's end only comes closer."""
    first, second = await _straddling_a_second(rls, "another", d(("key4", "durTest")))
    assert first.statuses[0].duration_until_reset.seconds == 4320
    assert second.statuses[0].duration_until_reset.seconds == pytest.approx(2 * 4320, abs=2)


async def test_integration_a_reload_brings_a_new_domain(redis, tmp_path):
    """testConfigReload: before reload.yaml is added its domain is unknown (OK, no limit);
    after it, key1 counts 50 a second. reload.yaml has a `requests_per_unit: 0` rule."""
    directory = written(tmp_path / "config", data.INTEGRATION)
    with serving(directory, redis.url) as gw:
        channel, stub = await stub_of(gw)
        async with channel:
            ask = Asker(stub)
            assert statuses(await ask("reload", d(("block", "foo")))) == [(OK, None, None, 0)]
            (directory / "reload.yaml").write_text(data.RELOAD)
            gw.signal(signal.SIGHUP)
            answers = []

            async def reloaded() -> bool:
                answers.append(await ask("reload", d(("key1", "foo"))))
                return answers[-1].statuses[0].HasField("current_limit")

            await eventually(reloaded, what="the reloaded rls_config")
            assert statuses(answers[-1]) == [(OK, 50, SECOND, 49)]


# --- test/redis/fixed_cache_impl_test.go ----------------------------------------------------
# Its mocked Redis answers a count; here the bucket is first charged to that count.


async def test_redis_a_count_of_four_then_one_more_leaves_five(rls):
    """TestRedis (and TestRedisWithJitter): 10/second, found at 4, one hit: 5 left."""
    await rls("domain", d(("key", "value")), hits=4)
    response = await rls("domain", d(("key", "value")))
    assert statuses(response)[0][:3] == (OK, 10, SECOND)
    remaining_within(rls, response, 0, 5, 10, 10)


async def test_redis_an_unmatched_read_beside_a_limit_over_it(rls):
    """TestRedis: key2/value2 has no limit (hits 0); key2/subkey2 at 10 of 10/minute, one more: over."""
    sub = d(("key2", "value2"), ("subkey2", "subvalue2"))
    await rls("domain", sub, hits=10)
    response = await rls("domain", d(("key2", "value2"), hits=0), d(("key2", "value2"), ("subkey2", "subvalue2"), hits=1))
    assert response.overall_code == OVER and statuses(response) == [(OK, None, None, 0), (OVER, 10, MINUTE, 0)]


async def test_redis_a_read_of_a_limit_counted_past_it_is_over(rls):
    """TestRedis: key3 found at 11 of 10/hour is over for a read (hits 0), and key3/subkey3
    at 12 of 10/day is over for one more. A count past the limit is what charging every hit
    reaches: the gateway's `charge: always`, whose buckets go into debt."""
    await rls("domain", d(("key3", "value3")), hits=11)
    await rls("domain", d(("key3", "value3"), ("subkey3", "subvalue3")), hits=12)
    response = await rls("domain", d(("key3", "value3"), hits=0), d(("key3", "value3"), ("subkey3", "subvalue3"), hits=1))
    assert response.overall_code == OVER and statuses(response) == [(OVER, 10, HOUR, 0), (OVER, 10, DAY, 0)]
    # Until a read passes: the hour's bucket owes 1 token (360 s), the day's 3 (8,640 s a token).
    assert [s.duration_until_reset.seconds for s in response.statuses] == [360, pytest.approx(3 * 8640, abs=1)]


@pytest.mark.parametrize("domain", ["near_limit", "local_cache"])
async def test_redis_fifteen_an_hour_near_and_over_its_limit(rls, domain):
    """TestNearLimit and TestOverLimitWithLocalCache: found at 10, 12, 15 and again: 4, 2
    left, then over twice (the reference's local cache answers the last one itself, as the
    gateway's denial cache does)."""
    key4 = d(("key4", "value4"))
    await rls(domain, key4, hits=10)
    assert statuses(await rls(domain, key4)) == [(OK, 15, HOUR, 4)]
    await rls(domain, key4)
    assert statuses(await rls(domain, key4)) == [(OK, 15, HOUR, 2)]
    await rls(domain, key4, hits=2)
    for _ in range(2):
        response = await rls(domain, key4)
        assert response.overall_code == OVER and statuses(response) == [(OVER, 15, HOUR, 0)]


@pytest.mark.parametrize(
    ("key", "per_second", "found", "hits", "left"),
    [
        ("key5", 20, 2, 3, 15),
        ("key6", 8, 5, 2, 1),
        ("key7", 20, 16, 3, 1),
        ("key8", 20, 19, 3, None),  # the reference's 22 of 20: over
        ("key9", 20, 20, 7, None),  # 27 of 20
        ("key10", 10, 10, 3, None),  # 30 of 10: the gateway's bucket is empty at 10
    ],
)
async def test_redis_near_limit_with_a_request_hits_addend(rls, key, per_second, found, hits, left):
    """TestNearLimit: per-second limits with the request's hits_addend."""
    descriptor = d((key, key.replace("key", "value")))
    await rls("near_limit", descriptor, hits=found)
    response = await rls("near_limit", descriptor, hits=hits)
    if left is None:
        # Over unless the bucket refilled meanwhile (the test ran slower than 1 token's time).
        if rls.refilled(per_second) < 1:
            assert response.overall_code == OVER and statuses(response) == [(OVER, per_second, SECOND, 0)]
    else:
        assert statuses(response)[0][:3] == (OK, per_second, SECOND)
        remaining_within(rls, response, 0, left, per_second, per_second)


async def test_redis_a_shadow_rule_over_its_limit_answers_ok_with_nothing_left(rls):
    """TestOverLimitWithLocalCacheShadowRule: 4, 2, then OK with 0 left, twice."""
    key4 = d(("key4", "value4"))
    await rls("shadow_rule", key4, hits=10)
    assert statuses(await rls("shadow_rule", key4)) == [(OK, 15, HOUR, 4)]
    await rls("shadow_rule", key4)
    assert statuses(await rls("shadow_rule", key4)) == [(OK, 15, HOUR, 2)]
    await rls("shadow_rule", key4, hits=2)
    for _ in range(2):
        response = await rls("shadow_rule", key4)
        assert response.overall_code == OK and statuses(response) == [(OK, 15, HOUR, 0)]


async def test_redis_stop_cache_key_increment_when_overlimit(rls):
    """TestOverLimitWithStopCacheKeyIncrementWhenOverlimitConfig: 15/hour and 14/hour, both at
    10: one hit each leaves 4 and 3, two each 2 and 1, two more: key5 is over and key4, not
    charged, keeps 2. The gateway's all or nothing is this mode."""
    pair = (d(("key4", "value4"), hits=1), d(("key5", "value5"), hits=1))
    await rls("stop_increment", d(("key4", "value4")), d(("key5", "value5")), hits=10)
    assert statuses(await rls("stop_increment", *pair)) == [(OK, 15, HOUR, 4), (OK, 14, HOUR, 3)]
    twice = (d(("key4", "value4"), hits=2), d(("key5", "value5"), hits=2))
    assert statuses(await rls("stop_increment", *twice)) == [(OK, 15, HOUR, 2), (OK, 14, HOUR, 1)]
    response = await rls("stop_increment", *twice)
    assert response.overall_code == OVER and statuses(response) == [(OK, 15, HOUR, 2), (OVER, 14, HOUR, 0)]


# --- test/service/ratelimit_test.go -------------------------------------------------------


async def test_service_answers_in_the_order_of_the_descriptors(rls):
    """TestService: no limit; then a limit over it beside no limit, in either order."""
    assert statuses(await rls("test-domain", d(("hello", "world")))) == [(OK, None, None, 0)]
    await rls("different-domain", d(("foo", "bar")), hits=10)
    response = await rls("different-domain", d(("foo", "bar")), d(("hello", "world")))
    assert response.overall_code == OVER and statuses(response) == [(OVER, 10, MINUTE, 0), (OK, None, None, 0)]
    assert response.statuses[0].current_limit.name == "key_name"
    response = await rls("different-domain", d(("hello", "world")), d(("foo", "bar")))
    assert response.overall_code == OVER and statuses(response) == [(OK, None, None, 0), (OVER, 10, MINUTE, 0)]


async def test_service_rule_shadow_mode_answers_ok(rls):
    """TestRuleShadowMode: both descriptors' rules are in shadow mode and over: all OK."""
    await rls("rule-shadow", d(("foo", "bar")), d(("hello", "world")), hits=10)
    response = await rls("rule-shadow", d(("foo", "bar")), d(("hello", "world")))
    assert response.overall_code == OK and statuses(response) == [(OK, 10, MINUTE, 0), (OK, 10, MINUTE, 0)]


async def test_service_mixed_rule_shadow_mode(rls):
    """TestMixedRuleShadowMode: the shadow rule over its limit is OK, the other over it refuses."""
    await rls("mixed-shadow", d(("foo", "bar")), d(("hello", "world")), hits=10)
    response = await rls("mixed-shadow", d(("foo", "bar")), d(("hello", "world")))
    assert response.overall_code == OVER and statuses(response) == [(OK, 10, MINUTE, 0), (OVER, 10, MINUTE, 0)]


async def test_service_unlimited(rls):
    """TestUnlimited: a limit, no limit, and an unlimited one (no current_limit, 2^32 - 1 left)."""
    response = await rls("some-domain", d(("foo", "bar")), d(("hello", "world")), d(("baz", "qux")))
    assert response.overall_code == OK
    assert statuses(response) == [(OK, 10, MINUTE, 9), (OK, None, None, 0), (OK, None, None, MAX_UINT32)]


@pytest.mark.parametrize(
    ("domain", "descriptors", "detail"),
    [
        ("", [d(("hello", "world"))], "rate limit domain must not be empty"),
        ("test-domain", [], "rate limit descriptor list must not be empty"),
    ],
    ids=["TestEmptyDomain", "TestEmptyDescriptors"],
)
async def test_service_an_empty_domain_or_descriptor_list_is_an_error(rls, domain, descriptors, detail):
    """The reference's error text; its status is gRPC's UNKNOWN (a plain error), the gateway's INVALID_ARGUMENT."""
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await rls(domain, *descriptors)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and error.value.details() == detail
