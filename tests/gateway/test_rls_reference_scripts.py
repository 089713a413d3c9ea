"""envoyproxy/ratelimit's integration-test/scripts/*.sh (commit f2fb157) as the RPCs Envoy
sends for them, and its quota-mode `ShouldRateLimit` vectors, against the gateway over
gRPC (tests/gateway/test_rls_reference_answers.py has the rest, and the helpers).

Each script curls examples/envoy/proxy.yaml's routes; a route's rate-limit actions turn the
request's headers into descriptors (`request_headers`: a descriptor is sent only when every
header it names is present), and curl -f fails on the 429 Envoy answers OVER_LIMIT with.
So each step here is the descriptors that route sends, and the overall code expected.

Envoy's charge after the response (token-quota.sh): a read with `hits_addend: 0` before the
request, and the hits when the stream is done (`apply_on_stream_done`). It runs on Redis
and on the in-process store, with the gateway's `charge: always`, and with the reference's
own example.yaml, whose `quota_mode` descriptors are charged so too.
"""

from __future__ import annotations

import time

import pytest

from tests import rls_reference_answers_data as data
from tests.gateway.test_rls_reference_answers import HOUR, OK, OVER, Asker, d, serving, statuses, stub_of, written
from tests.processes import RedisServer, eventually

# examples/envoy/proxy.yaml: each route's rate-limit actions, as the headers they read (in order).
ROUTES = {
    "/twoheader": (("foo", "bar"), ("foo", "baz")),
    "/fourheader": (("foo", "bar"), ("source_cluster", "destination_cluster")),
    "/fiveheader": (("foo", "bar"), ("source_cluster", "destination_cluster"), ("category",)),
    "/unspec": (("unspec",),),
}


def envoy_sends(route: str, headers: dict[str, str]):
    """The descriptors Envoy sends for a request to `route` with `headers`."""
    return [d(*((h, headers[h]) for h in action)) for action in ROUTES[route] if all(h in headers for h in action)]


@pytest.fixture(scope="module")
def redis():
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module", params=["redis", "in-process"])
def token_quota_gateway(request, tmp_path_factory):
    """The gateway on Redis, or on the in-process store, with the token-quota rules."""
    directory = written(tmp_path_factory.mktemp("token-quota"), {"token_quota.yaml": data.SERVICE["token_quota.yaml"]})
    store_url = request.getfixturevalue("redis").url if request.param == "redis" else None
    with serving(directory, store_url) as gw:
        yield gw


@pytest.fixture
async def store_rls(token_quota_gateway):
    channel, stub = await stub_of(token_quota_gateway)
    async with channel:
        yield Asker(stub)


@pytest.fixture(scope="module")
def example_gateway(redis, tmp_path_factory):
    """examples/ratelimit/config/example.yaml, the quota-mode domain and share_threshold.yaml, as written."""
    files = {"example.yaml": data.EXAMPLE, "quota.yaml": data.QUOTA_MODE, "share_threshold.yaml": data.SHARE_THRESHOLD}
    with serving(written(tmp_path_factory.mktemp("example"), files), redis.url) as gw:
        yield gw


@pytest.fixture
async def example(example_gateway):
    channel, stub = await stub_of(example_gateway)
    async with channel:
        yield Asker(stub)


async def curl(ask: Asker, route: str, **headers: str) -> int:
    return (await ask("rl", *envoy_sends(route, headers))).overall_code


# --- the charge after the response -------------------------------------------------------


async def test_token_quota_a_read_then_the_hits_empties_the_bucket(store_rls):
    """token-quota.sh on `charge: always`: 2 per minute, a read of 0 then 1 hit after each
    response. Three requests pass (the third finds the bucket at 0, as the reference's count
    at its limit passes), their charges take it to -1, and the fourth read is refused."""
    service_2 = ("service", "service_2")
    for _ in range(3):
        read = await store_rls("tokenquota", d(service_2, hits=0))
        assert read.overall_code == OK
        await store_rls("tokenquota", d(service_2, hits=1))  # apply_on_stream_done: Envoy ignores the answer
    refused = await store_rls("tokenquota", d(service_2, hits=0))
    assert refused.overall_code == OVER and statuses(refused)[0][3] == 0
    assert refused.statuses[0].duration_until_reset.seconds == 30  # one token owed, at one per 30 s


async def test_token_quota_the_next_read_passes_once_the_debt_is_repaid(store_rls):
    """The same at 2 per second: after three charges the bucket owes 1 token, and a read
    passes again no sooner than the half second that token takes to refill."""
    fast = ("service", "fast")
    # Taken before the charges: the debt starts at the third, however late its answer arrives.
    owing_since = time.monotonic()
    for _ in range(3):
        await store_rls("tokenquota", d(fast, hits=1))
    assert (await store_rls("tokenquota", d(fast, hits=0))).overall_code == OVER

    async def read_passes() -> bool:
        return (await store_rls("tokenquota", d(fast, hits=0))).overall_code == OK

    await eventually(read_passes, what="the debt repaid")
    assert time.monotonic() - owing_since >= 0.5 - 0.01  # the store's clock against ours: 10 ms of slack


async def test_token_quota_a_charge_larger_than_the_bucket_is_owed_in_full(store_rls):
    """A response that cost more than the whole limit (an LLM's tokens, say): 10 hits on 2
    per minute leave the bucket owing 8, refused for the 4 minutes they take to refill."""
    llm = ("llm", "a-large-response")
    descriptor = d(llm, hits=10)
    await store_rls("tokenquota", d(llm, hits=0))
    charge = await store_rls("tokenquota", descriptor)
    assert charge.overall_code == OVER  # the charge is taken; Envoy ignores this answer
    read = await store_rls("tokenquota", d(llm, hits=0))
    assert read.overall_code == OVER and read.statuses[0].duration_until_reset.seconds == pytest.approx(240, abs=1)


# --- integration-test/scripts on examples/ratelimit/config/example.yaml -------------------


async def test_script_simple_get(example):
    """simple-get.sh: foo and baz=shady (a shadow rule) pass."""
    assert await curl(example, "/twoheader", foo="test", baz="shady") == OK


async def test_script_trigger_ratelimit(example):
    """trigger-ratelimit.sh: (foo: *), (baz: not-so-shady) has 3 a minute."""
    codes = [await curl(example, "/twoheader", foo="pelle", baz="not-so-shady") for _ in range(5)]
    assert codes == [OK, OK, OK, OVER, OVER]


async def test_script_trigger_shadow_mode_key(example):
    """trigger-shadow-mode-key.sh: (foo: *), (baz: shady) in shadow mode never refuses."""
    codes = [await curl(example, "/twoheader", foo="pelle-shadow", baz="shady") for _ in range(6)]
    assert codes == [OK] * 6


async def test_script_value_included_in_stats_key_when_unspecified(example):
    """value-included-in-stats-key-when-unspecified.sh: (unspec: *) has 2 a minute (its
    detailed_metric statsd name has no counterpart: the gateway's metrics are Prometheus)."""
    codes = [await curl(example, "/unspec", unspec="unspecified_value") for _ in range(3)]
    assert codes == [OK, OK, OVER]


async def test_script_replaces(example):
    """replaces.sh, step by step."""
    banned = {"foo": "bkthomps", "bar": "banned"}
    assert await curl(example, "/twoheader", **banned) == OVER  # banned_limit: 0 a minute
    assert await curl(example, "/fourheader", **banned, source_cluster="proxy", destination_cluster="mock") == OVER
    override = {**banned, "source_cluster": "proxy", "destination_cluster": "override"}  # replaces banned_limit, 2/min
    assert [await curl(example, "/fourheader", **override) for _ in range(3)] == [OK, OK, OVER]
    bk = {"foo": "my_foo", "bar": "bkthomps", "source_cluster": "proxy"}
    assert [await curl(example, "/fourheader", **bk, destination_cluster="bkthomps") for _ in range(3)] == [OK, OK, OVER]
    not_bk = [await curl(example, "/fourheader", **bk, destination_cluster="not_bkthomps") for _ in range(2)]
    assert not_bk == [OK, OVER]  # bkthomps (1/min) counts again: not replaced here
    assert await curl(example, "/fourheader", **bk, destination_cluster="bkthomps") == OVER
    five = {**bk, "destination_cluster": "fake", "category": "account"}  # replaces bkthomps and fake_name, 4/min
    assert [await curl(example, "/fiveheader", **five) for _ in range(5)] == [OK, OK, OK, OK, OVER]
    assert [await curl(example, "/twoheader", foo="foo_2", bar="bkthomps") for _ in range(2)] == [OK, OVER]
    fake = {"foo": "foo_3", "bar": "bar_3", "source_cluster": "proxy", "destination_cluster": "fake"}
    assert [await curl(example, "/fourheader", **fake) for _ in range(3)] == [OK, OK, OVER]
    assert await curl(example, "/fiveheader", **five) == OVER


async def test_script_quota(example):
    """quota.sh: /quota sends (service: service_1) and (service: service_2), both quota_mode
    (1 and 2 a minute): charged on every request, refused once both are over, the third."""
    both = (d(("service", "service_1")), d(("service", "service_2")))
    assert [(await example("rl", *both)).overall_code for _ in range(3)] == [OK, OK, OVER]


async def test_script_token_quota_on_the_reference_example(tmp_path):
    """token-quota.sh on example.yaml as written: service_2 (2/min) is quota_mode, whose
    hits are owed as with `charge: always`, so only the fourth request is refused. On a
    gateway of its own (the in-process store): quota.sh spent service_2's bucket, where the
    reference's script waits out the minute."""
    directory = written(tmp_path, {"example.yaml": data.EXAMPLE})
    with serving(directory, None) as fresh:
        channel, stub = await stub_of(fresh)
        async with channel:
            ask = Asker(stub)
            service_2 = ("service", "service_2")
            reads = []
            for _ in range(4):
                reads.append((await ask("rl", d(service_2, hits=0))).overall_code)
                if reads[-1] == OK:
                    await ask("rl", d(service_2, hits=1))
    assert reads == [OK, OK, OK, OVER]


# --- test/service/ratelimit_test.go: quota mode -------------------------------------------


async def test_service_per_descriptor_quota_mode(example):
    """TestServicePerDescriptorQuotaMode and TestServiceMixedPerDescriptorModes(UnderLimit):
    a regular limit over it refuses whatever the quota-mode one says; the only quota-mode
    descriptor over its limit refuses too; neither over: OK."""
    regular, quota = d(("regular", "limit")), d(("quota", "limit"))
    response = await example("quota-domain", regular, quota)
    assert response.overall_code == OK and [s[0] for s in statuses(response)] == [OK, OK]
    await example("quota-domain", quota, hits=2)  # quota: 3 a minute, now spent
    response = await example("quota-domain", regular, quota)
    assert response.overall_code == OVER and [s[0] for s in statuses(response)] == [OK, OVER]
    await example("quota-domain", regular, hits=3)
    response = await example("quota-domain", regular, d(("quota2", "limit")))
    assert response.overall_code == OVER and [s[0] for s in statuses(response)] == [OVER, OK]


async def test_service_quota_mode_refuses_only_when_every_quota_descriptor_is_over(example):
    """TestServiceQuotaModeOnlySomeOverTheLimit and TestServiceQuotaModeOnlyAllOverTheLimit."""
    quota1, quota2 = d(("quota1", "limit")), d(("quota2", "limit"))
    await example("quota-domain", quota1, hits=5)  # 5 a minute: spent
    some = await example("quota-domain", quota1, quota2)
    assert some.overall_code == OK and [s[0] for s in statuses(some)] == [OVER, OK]
    await example("quota-domain", quota2, hits=3)
    every = await example("quota-domain", quota1, quota2)
    assert every.overall_code == OVER and [s[0] for s in statuses(every)] == [OVER, OVER]


# --- test/integration/integration_test.go: TestShareThreshold ---------------------------------


async def test_integration_share_threshold(example):
    """Ten requests of files/a.pdf spend files/*'s one shared bucket (10 an hour), so
    files/b.csv is over; values of files_no_share/* have a bucket each, 9 left after one."""
    for _ in range(10):
        await example("share-threshold-test", d(("files", "files/a.pdf")))
    shared = await example("share-threshold-test", d(("files", "files/b.csv")))
    assert shared.overall_code == OVER and [s[:4] for s in statuses(shared)] == [(OVER, 10, HOUR, 0)]
    for n in range(10):
        apart = await example("share-threshold-test", d(("files_no_share", f"files_no_share/{n}")))
        assert apart.overall_code == OK and statuses(apart) == [(OK, 10, HOUR, 9)]

