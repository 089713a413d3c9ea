"""What the plans compile for a check (`Store.prepare`, `Limiter.prepare`): the store's
arguments and, under `on_store_error: local`, the stand-in's share, carried by each check
and kept by nothing else. The store is a real RedisStore; one with no server behind it is
how a store fails here, as it does when Redis is down."""

from __future__ import annotations

import gc
import logging
import weakref

from gateway.config.model import FailurePolicy
from gateway.limiter.limiter import Limiter
from gateway.limiter.memory_store import MemoryStore
from gateway.limiter.outcomes import FAIL_LOCAL
from gateway.limiter.store import LimitCheck
from gateway.redis.store import RedisStore
from gateway.testing import config_from_yaml
from tests.helpers import redis_store, store_config
from tests.processes import free_port

LIMITS = """
limits:
  local: {rate: 1/hour, burst: 8, key: header:X-API-Key, on_store_error: local}
  open: {rate: 1/hour, burst: 8, key: header:X-API-Key, on_store_error: open}
routes:
  - match: {path: /}
    upstream: http://127.0.0.1:1
    limits: [local, open]
"""


def limits():
    config = config_from_yaml(LIMITS)
    return {limit.name: limit for limit in config.limits}


async def test_a_local_limits_share_is_compiled_once_and_carried_to_the_stand_in():
    """Prepared with the limiter's divisor: the stand-in charges the share the check carries
    (8 / 4 = 2), and a check made without the plans is held to the same share."""
    store = RedisStore(store_config(f"redis://127.0.0.1:{free_port()}/0", timeout=0.05))
    limiter = Limiter(store, local_divisor=4)
    limit = limits()["local"]
    prepared = limiter.prepare(limit, 1)
    assert prepared.local is not None and prepared.local.limit.burst == 2
    assert limiter.prepare(limits()["open"], 1).local is None  # only `local` has a stand-in
    try:
        carried = LimitCheck(limit=limit, identity="a", cost=1, prepared=prepared)
        remaining = []
        for _ in range(3):
            decision = await limiter.check([carried])
            assert decision.statuses[0].outcome == FAIL_LOCAL
            remaining.append(int(decision.statuses[0].remaining))  # a second's refill adds a fraction
        assert remaining == [1, 0, 0]  # the third is short, and refused
        assert not decision.allowed
        bare = await limiter.check([LimitCheck(limit=limit, identity="b", cost=1)])
        assert int(bare.statuses[0].remaining) == 1
    finally:
        await store.close()


async def test_the_limiter_and_the_stores_keep_no_limit_once_no_check_names_it(redis_server, caplog):
    """Nothing is cached by limit (nor by its id()): each reload's limit objects go once its
    plans and their checks are gone, on the store's path and on the stand-in's."""
    # The failure's log line would hold its exception, and through it the check, in caplog.
    caplog.set_level(logging.ERROR, logger="gateway.limiter.limiter")
    base = limits()["local"]
    gone = []
    async with redis_store(redis_server.url) as store:
        down = RedisStore(store_config(f"redis://127.0.0.1:{free_port()}/0", timeout=0.05))
        try:
            limiters = (Limiter(store, local_divisor=2), Limiter(down, local_divisor=2), Limiter(MemoryStore()))
            for limiter in limiters:  # all alive to the end, with whatever they hold
                for reload in range(20):
                    limit = config_from_yaml(LIMITS.replace("burst: 8", f"burst: {8 + reload}")).limits[0]
                    assert limit.on_store_error is FailurePolicy.LOCAL and limit.burst == base.burst + reload
                    check = LimitCheck(limit=limit, identity=f"c{reload}", cost=1, prepared=limiter.prepare(limit, 1))
                    decision = await limiter.check([check])
                    assert decision.allowed
                    gone.append(weakref.ref(limit))
                    del limit, check, decision
        finally:
            await down.close()
        gc.collect()
        assert [ref for ref in gone if ref() is not None] == []
