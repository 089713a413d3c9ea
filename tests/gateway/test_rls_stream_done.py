"""Envoy's charge when the stream is done (`apply_on_stream_done: true` with `hits_addend`
from the response, as Envoy Gateway's cost from the response and Envoy AI Gateway's token
usage send it), against the gateway started as users start it, on a private redis-server,
over grpc.aio's client and a real socket.

Envoy sends that charge as an ordinary `ShouldRateLimit`: the request and its descriptors
carry nothing that tells it from a check before the request (RateLimitRequest has domain,
descriptors and hits_addend; a descriptor entries, limit and hits_addend), and Envoy ignores
its answer. So the rule says it: `charge: always` makes every hit of the rule owed, charged
whatever the bucket holds, into debt, as envoyproxy/ratelimit increments its count whatever
it answers. The request-time check of the same descriptor (hits_addend 0) is then refused
until the bucket has refilled past zero.

The day limit refills 1000/86400 of a token a second, so over the test its whole tokens and
seconds are exact; the per-second one shows the refill past the debt.
"""

from __future__ import annotations

import time

import pytest

from tests.gateway.test_rls_reference_answers import DAY, OK, OVER, Asker, d, serving, statuses, stub_of, written
from tests.processes import RedisServer, eventually

RULES = """
domain: llm
descriptors:
  - key: api_key
    rate_limit: {unit: day, requests_per_unit: 1000, charge: always}
  - key: fast_key
    rate_limit: {unit: second, requests_per_unit: 10, charge: always}
  - key: counted_key
    rate_limit: {unit: day, requests_per_unit: 1000}
"""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    with RedisServer() as redis, serving(written(tmp_path_factory.mktemp("rls"), {"llm.yaml": RULES}), redis.url) as gw:
        yield gw


@pytest.fixture
async def rls(gateway):
    channel, stub = await stub_of(gateway)
    async with channel:
        yield Asker(stub)


async def test_a_charge_after_the_stream_settles_its_cost_into_debt(rls):
    team = ("api_key", "team-a")
    before = await rls("llm", d(team, hits=0))  # the request: a read, hits_addend {number: 0}
    assert before.overall_code == OK and statuses(before) == [(OK, 1000, DAY, 1000)]
    done = await rls("llm", d(team, hits=400))  # stream done: hits_addend from the usage, 400 tokens
    assert statuses(done) == [(OK, 1000, DAY, 600)]
    assert statuses(await rls("llm", d(team, hits=0))) == [(OK, 1000, DAY, 600)]
    # An answer of 850 tokens with 600 left: owed in full, the bucket 250 below zero. Envoy
    # ignores this answer, which says the bucket could not pay.
    done = await rls("llm", d(team, hits=850))
    assert done.overall_code == OVER and statuses(done) == [(OVER, 1000, DAY, 0)]
    refused = await rls("llm", d(team, hits=0))
    assert refused.overall_code == OVER and statuses(refused) == [(OVER, 1000, DAY, 0)]
    # Until the 250 owed have refilled at 1000 a day: 21,600 s, less the moments since.
    assert refused.statuses[0].duration_until_reset.seconds == 21600
    # A second charge while in debt is owed too, on top: 350 owed, 30,240 s.
    await rls("llm", d(team, hits=100))
    assert (await rls("llm", d(team, hits=0))).statuses[0].duration_until_reset.seconds == 30240
    other = await rls("llm", d(("api_key", "team-b"), hits=0))  # each value its own bucket
    assert statuses(other) == [(OK, 1000, DAY, 1000)]


async def test_the_next_request_passes_once_the_bucket_has_refilled_past_zero(rls):
    fast = ("fast_key", "team-a")
    owing_since = time.monotonic()  # before the charge: the debt starts no earlier
    assert statuses(await rls("llm", d(fast, hits=0)))[0][0] == OK
    await rls("llm", d(fast, hits=25))  # 10 held, 25 charged: 15 owed at 10 a second
    assert (await rls("llm", d(fast, hits=0))).overall_code == OVER

    async def read_passes() -> bool:
        return (await rls("llm", d(fast, hits=0))).overall_code == OK

    await eventually(read_passes, what="the debt repaid")
    assert time.monotonic() - owing_since >= 1.5 - 0.01  # the store's clock against ours: 10 ms of slack


async def test_without_charge_always_a_charge_larger_than_what_is_left_charges_nothing(rls):
    """The default, all or nothing, refuses a hit the bucket cannot pay and charges none of
    it: after the stream, Envoy ignores that refusal, so the cost would be lost. This is why
    the rule Envoy sends on stream done says `charge: always`."""
    counted = ("counted_key", "team-a")
    await rls("llm", d(counted, hits=400))
    refused = await rls("llm", d(counted, hits=850))
    assert statuses(refused) == [(OVER, 1000, DAY, 0)]
    assert statuses(await rls("llm", d(counted, hits=0))) == [(OK, 1000, DAY, 600)]  # nothing charged
