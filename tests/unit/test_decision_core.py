"""The decision core (gateway.decision) on its own: a route's limits compiled into a
DecisionPlan, decided on the in-process store with an injected clock, and the verdicts it
returns, with no listener, no aiohttp and no socket.

What the tests prove: an allowed verdict carries the RateLimit fields; a refusal carries its
whole answer prebuilt, status, body and fields, and two refusals differ only in what varies
(Retry-After and the fields); a concurrency limit is taken only for a caller that holds its
lease, and skipped and counted otherwise; each decision is observed once; time is the
injected clock's."""

from __future__ import annotations

import json

from gateway.decision.core import Decider
from gateway.decision.plan import DecisionPlan
from gateway.limiter.limiter import Limiter
from gateway.limiter.memory_store import MemoryStore
from gateway.metrics import Metrics
from gateway.testing import config_from_yaml

KEY = "header:x-api-key=k"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Observed:
    def __init__(self) -> None:
        self.values: list[float] = []

    def observe(self, value: float) -> None:
        self.values.append(value)


def plan_and_decider(limits: str, route_limits: str, clock: Clock) -> tuple[DecisionPlan, Decider, Observed, Metrics]:
    config = config_from_yaml(
        f"""
limits:
{limits}
routes:
  - match: {{path: /}}
    upstream: http://127.0.0.1:1
    limits: {route_limits}
"""
    )
    metrics = Metrics()
    route = config.routes[0]
    limiter = Limiter(MemoryStore(clock=clock), clock=clock)
    plan = DecisionPlan.of(route.limits, route.concurrency, "r", metrics, config.local_divisor, limiter)
    latency = Observed()
    return plan, Decider(limiter, latency, Observed(), clock=clock), latency, metrics


async def test_allowed_then_refused_with_the_answer_prebuilt():
    clock = Clock()
    plan, decider, latency, _ = plan_and_decider("  per_key: {rate: 1/second, burst: 2, key: header:X-API-Key}", "[per_key]", clock)
    verdicts = [await decider.decide(plan, [KEY]) for _ in range(3)]
    assert [v.refusal is None for v in verdicts] == [True, True, False]
    assert verdicts[0].fields == {"RateLimit-Policy": '"per_key";q=2;w=2', "RateLimit": '"per_key";r=1;t=1'}
    refusal = verdicts[2].refusal
    assert refusal is not None and refusal.status == 429 and not refusal.store_failed
    assert refusal.headers == {
        "RateLimit-Policy": '"per_key";q=2;w=2',
        "RateLimit": '"per_key";r=0;t=1',
        "Retry-After": "1",
        "Content-Type": "application/problem+json; charset=utf-8",
        "Content-Length": str(len(refusal.body)),
    }
    assert json.loads(refusal.body)["violated-policies"] == ["per_key"]
    assert len(latency.values) == 3  # each decision observed once


async def test_refusals_differ_only_in_what_varies_and_time_is_the_clocks():
    clock = Clock()
    plan, decider, _, _ = plan_and_decider("  slow: {rate: 1/minute, burst: 1, key: header:X-API-Key}", "[slow]", clock)
    assert (await decider.decide(plan, [KEY])).refusal is None
    first = (await decider.decide(plan, [KEY])).refusal
    clock.now += 30
    second = (await decider.decide(plan, [KEY])).refusal
    assert first is not None and second is not None
    assert (first.headers["Retry-After"], second.headers["Retry-After"]) == ("60", "30")
    assert first.body.replace(b"60", b"30") == second.body
    clock.now += 30
    assert (await decider.decide(plan, [KEY])).refusal is None  # exactly a minute later


async def test_a_concurrency_limit_is_taken_only_for_a_caller_that_holds_the_lease():
    clock = Clock()
    plan, decider, latency, metrics = plan_and_decider(
        "  one: {concurrency: 1, key: header:X-API-Key}", "[one]", clock
    )
    held = await decider.decide(plan, (), lease_identities=[KEY])
    assert held.refusal is None and held.admission is not None and held.admission.admitted
    refused = await decider.decide(plan, (), lease_identities=[KEY])
    assert refused.refusal is not None and refused.refusal.status == 429
    assert refused.refusal.headers["RateLimit-Policy"] == '"one";q=1;qu="concurrent-requests"'
    asked = await decider.decide(plan, ())  # a decision listener: the lease is skipped, and counted
    assert asked.refusal is None and asked.admission is None
    assert metrics.decision_concurrency_skipped.labels(route="r", limit="one").value == 1
    held.admission.release()
    assert len(latency.values) == 2  # the two admissions; the skipped one decided nothing
