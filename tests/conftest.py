"""Fixtures every test module may use: a real aiohttp upstream (one per test, or one per module
in a thread), a private redis-server, a master with a replica watched by three sentinels, an
HTTP client. And the hooks that keep the timing modules (tests/load/) in one xdist worker, one
at a time and ahead of the other workers."""

import contextlib
import os

import aiohttp
import pytest

from tests.processes import RedisServer, SentinelServer, wait_until
from tests.upstream import running_upstream, upstream_in_a_thread


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the group from the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules marked `timing`, exactly those in tests/load/, measure latency, load or
    exactness under load: under pytest-xdist they form one group, so one worker runs them one
    at a time while the others run the rest (whose processes run at normal priority, below the
    real-time Redis these tests start)."""
    for item in items:
        timing = item.get_closest_marker("timing") is not None
        if timing != (item.path.parent.name == "load"):
            raise pytest.UsageError(f"{item.nodeid}: tests/load/ holds the modules marked timing, and only they are")
        if timing:
            item.add_marker(pytest.mark.xdist_group("timing"))


# The timing modules' processes (the worker, and the gateways, wrk and nginx it starts) run
# ahead of the other workers' on a busy machine: weight 3121 against 1024 per CFS niceness.
TIMING_NICENESS = -5


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A timing test runs at TIMING_NICENESS, every thread of the worker (threads and children
    inherit it from the thread that starts them); any other test at the default, 0. Lowering
    niceness takes root, as scripts/test runs on CI; elsewhere the tests run at 0."""
    niceness = TIMING_NICENESS if item.get_closest_marker("timing") is not None else 0
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(PermissionError, ProcessLookupError):  # not root, or a thread just ended
            os.setpriority(os.PRIO_PROCESS, int(task), niceness)


def pytest_collection_finish(session: pytest.Session) -> None:
    """On a worker under `--dist loadgroup`, pytest-xdist names each grouped test `ID@timing`,
    and that name is what keeps the group on one worker; fail loudly if a pytest ignored it,
    rather than run the timing modules at once."""
    if getattr(session.config.option, "loadgroup", False):
        loose = [item.nodeid for item in session.items if item.get_closest_marker("timing") and not item.nodeid.endswith("@timing")]
        if loose:
            raise pytest.UsageError(f"the timing group was not applied ({loose[0]}): this pytest and pytest-xdist do not agree")


@pytest.fixture
async def upstream():
    """The URL of a real aiohttp upstream running in the test's event loop."""
    async with running_upstream() as url:
        yield url


@pytest.fixture(scope="module")
def module_upstream():
    """The URL of the same upstream as `upstream`'s, on an event loop of its own in a thread,
    for as long as the module runs: a gateway that the module's tests share can use it."""
    with upstream_in_a_thread() as url:
        yield url


@pytest.fixture
def redis_server():
    with RedisServer() as server:
        yield server


@pytest.fixture
def dedicated_redis():
    """A private redis-server at real-time CPU priority: a Redis with a host of its own."""
    with RedisServer(dedicated=True) as server:
        yield server


@pytest.fixture
async def client():
    """An HTTP client that shows bodies as sent (no automatic decompression) and sends
    Cookie headers as set (with a cookie jar, aiohttp re-parses and rewrites them)."""
    async with aiohttp.ClientSession(auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar()) as session:
        yield session


@pytest.fixture
def sentinel_group():
    """(master, replica, sentinels), the replica known to every sentinel."""
    with contextlib.ExitStack() as stack:
        # No 5 s wait before the replica's first sync (Redis's default for diskless sync).
        master = stack.enter_context(RedisServer("--repl-diskless-sync-delay", "0"))
        replica = stack.enter_context(RedisServer("--replicaof", "127.0.0.1", str(master.port)))
        sentinels = [stack.enter_context(SentinelServer(master.port)) for _ in range(3)]

        def replica_known() -> bool:
            if replica.client().info("replication").get("master_link_status") != "up":
                return False  # not synced yet: a failover now would lose everything
            return all(
                any(r["port"] == replica.port and "s_down" not in r["flags"] for r in s.client().sentinel_slaves("mymaster"))
                for s in sentinels
            ) and all(len(s.client().sentinel_sentinels("mymaster")) == 2 for s in sentinels)

        wait_until(replica_known, deadline=20, what="the sentinels to know the replica and each other")
        yield master, replica, sentinels
