import pytest

from tests.processes import RedisServer
from tests.upstream import running_upstream


@pytest.fixture
async def upstream():
    """The URL of a real aiohttp upstream running in the test's event loop."""
    async with running_upstream() as url:
        yield url


@pytest.fixture
def redis_server():
    with RedisServer() as server:
        yield server
