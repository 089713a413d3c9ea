"""Shadow mode: a limit with `shadow: true` is checked and charged like
any other, shows in gateway_limiter_decisions_total as `shadow_limited` when it would
have denied, and in the RateLimit fields, but never rejects a request. A shadow limit
that is short never keeps the enforced limits of the same request from being charged:
the shadow limits go to the store in checks of their own, one per limit (see
gateway.limiter.limiter), so the enforced limits' all-or-nothing check never sees them."""

from __future__ import annotations

import aiohttp
import pytest

from gateway.config import ConfigError
from gateway.config.model import FailurePolicy, IdentitySource, Limit
from gateway.config.units import parse_rate
from gateway.limiter.limiter import Limiter
from gateway.limiter.memory_store import MemoryStore
from gateway.limiter.outcomes import ALLOW, DENY, SHADOW_LIMITED
from gateway.limiter.store import LimitCheck
from gateway.testing import config_from_yaml, running_gateway
from tests.scrape import decisions


def shadow_yaml(upstream: str, store: str = "") -> str:
    return f"""
trusted_proxies: [127.0.0.1/32]
{store}
limits:
  enforced: {{rate: 1/hour, burst: 3}}
  trial: {{rate: 1/hour, burst: 1, shadow: true}}
  trial2: {{rate: 1/hour, burst: 2, shadow: true}}
routes:
  - match: {{path: /only-shadow}}
    upstream: {upstream}
    strip_prefix: true
    limits: [trial2]
  - match: {{path: /both-shadows}}
    upstream: {upstream}
    strip_prefix: true
    limits: [trial, trial2]
  - match: {{path: /mixed}}
    upstream: {upstream}
    strip_prefix: true
    limits: [trial, enforced]
"""


async def statuses_and_fields(http: aiohttp.ClientSession, url: str, n: int) -> list[tuple[int, str | None]]:
    seen = []
    for _ in range(n):
        async with http.get(url) as response:
            await response.read()
            seen.append((response.status, response.headers.get("RateLimit")))
    return seen


async def test_an_exhausted_shadow_limit_never_rejects_but_is_counted_and_reported(upstream):
    async with running_gateway(shadow_yaml(upstream)) as gw, aiohttp.ClientSession() as http:
        seen = await statuses_and_fields(http, gw.url + "/only-shadow/x", 4)
        assert seen == [(200, '"trial2";r=1;t=3600'), (200, '"trial2";r=0;t=3600'),
                        (200, '"trial2";r=0;t=3600'), (200, '"trial2";r=0;t=3600')]
        counts = await decisions(http, gw.admin_url)
    assert counts[("trial2", "allow")] == 2
    assert counts[("trial2", "shadow_limited")] == 2
    assert ("trial2", "deny") not in counts


async def check_a_short_shadow_limit_leaves_the_enforced_one_charged(gw, http) -> None:
    seen = await statuses_and_fields(http, gw.url + "/mixed/x", 5)
    # `trial` is short from the second request on; `enforced` is still charged each time.
    assert [status for status, _ in seen] == [200, 200, 200, 429, 429]
    assert seen[0][1] == '"trial";r=0;t=3600'  # the most restrictive, shadow or not
    counts = await decisions(http, gw.admin_url)
    assert counts[("enforced", "allow")] == 3
    assert counts[("enforced", "deny")] == 2
    assert counts[("trial", "allow")] == 1
    assert counts[("trial", "shadow_limited")] == 4


async def test_a_short_shadow_limit_leaves_the_enforced_one_charged_in_process(upstream):
    async with running_gateway(shadow_yaml(upstream)) as gw, aiohttp.ClientSession() as http:
        await check_a_short_shadow_limit_leaves_the_enforced_one_charged(gw, http)


async def test_a_short_shadow_limit_leaves_the_enforced_one_charged_in_redis(upstream, dedicated_redis):
    store = f"store: {{url: {dedicated_redis.url}}}"  # the default store.timeout, as users run it
    async with running_gateway(shadow_yaml(upstream, store)) as gw, aiohttp.ClientSession() as http:
        await check_a_short_shadow_limit_leaves_the_enforced_one_charged(gw, http)


async def test_a_short_shadow_limit_does_not_keep_another_shadow_limit_from_being_charged(upstream):
    async with running_gateway(shadow_yaml(upstream)) as gw, aiohttp.ClientSession() as http:
        seen = await statuses_and_fields(http, gw.url + "/both-shadows/x", 3)
        counts = await decisions(http, gw.admin_url)
    assert [status for status, _ in seen] == [200, 200, 200]
    # The second request finds `trial` short, and `trial2` is charged all the same.
    assert counts[("trial", "allow")] == 1 and counts[("trial", "shadow_limited")] == 2
    assert counts[("trial2", "allow")] == 2 and counts[("trial2", "shadow_limited")] == 1


def test_shadow_is_parsed_and_defaults_to_false():
    config = config_from_yaml(shadow_yaml("http://127.0.0.1:1"))
    assert {limit.name: limit.shadow for limit in config.limits} == {"enforced": False, "trial": True, "trial2": True}


def test_a_shadow_that_is_not_a_boolean_is_refused():
    with pytest.raises(ConfigError, match="shadow: expected true or false"):
        config_from_yaml(shadow_yaml("http://127.0.0.1:1").replace("shadow: true", 'shadow: "yes"', 1))


async def test_a_fail_closed_shadow_limit_rejects_nothing_while_the_store_is_down(upstream, redis_server):
    store = f"store: {{url: {redis_server.url}}}"
    config = shadow_yaml(upstream, store).replace("burst: 1, shadow: true", "burst: 1, shadow: true, on_store_error: closed")
    async with running_gateway(config) as gw, aiohttp.ClientSession() as http:
        redis_server.stop()
        seen = await statuses_and_fields(http, gw.url + "/mixed/x", 2)
        counts = await decisions(http, gw.admin_url)
    assert [status for status, _ in seen] == [200, 200]  # `enforced` fails open; `trial` fails closed, in shadow
    assert counts[("trial", "fail_closed")] == 2


# --- the limiter alone, on the in-process store -----------------------------------------


def a_limit(name: str, burst: float, *, shadow: bool) -> Limit:
    return Limit(
        name=name, rate=parse_rate("1/hour"), burst=burst, key=(IdentitySource(kind="ip"),),
        on_store_error=FailurePolicy.OPEN, shadow=shadow,
    )


async def test_the_limiter_keeps_statuses_in_order_and_only_enforced_limits_decide():
    limiter = Limiter(MemoryStore(clock=lambda: 1000.0))  # a clock that stands still: no refill
    checks = [
        LimitCheck(limit=a_limit("s1", 1, shadow=True), identity="ip=192.0.2.1", cost=1),
        LimitCheck(limit=a_limit("e", 2, shadow=False), identity="ip=192.0.2.1", cost=1),
        LimitCheck(limit=a_limit("s2", 5, shadow=True), identity="ip=192.0.2.1", cost=1),
    ]
    outcomes = []
    for _ in range(3):
        decision = await limiter.check_with_shadow(checks)
        outcomes.append((decision.allowed, [(s.limit.name, s.outcome, s.remaining) for s in decision.statuses]))
    assert outcomes == [
        (True, [("s1", ALLOW, 0.0), ("e", ALLOW, 1.0), ("s2", ALLOW, 4.0)]),
        (True, [("s1", SHADOW_LIMITED, 0.0), ("e", ALLOW, 0.0), ("s2", ALLOW, 3.0)]),
        (False, [("s1", SHADOW_LIMITED, 0.0), ("e", DENY, 0.0), ("s2", ALLOW, 2.0)]),
    ]
    assert decision.retry_after > 0  # the enforced limit's wait
