"""One gateway run with `workers: N`: what each worker keeps in process (stand-in
buckets, cached denials) must add up to what one process would do."""

import collections

import aiohttp

from gateway.limiter.worker_resets import SLOT_BYTES, SLOTS, WorkerResets
from tests.processes import GatewayProcess, RedisServer, eventually, free_port
from tests.upstream import CountingUpstream, serving


def workers_yaml(upstream: str, workers: int, store: str, limits: str) -> str:
    return (
        f"listen: 127.0.0.1:{free_port()}\nadmin_listen: 127.0.0.1:{free_port()}\n"
        f"workers: {workers}\nstore: {store}\nlimits:\n{limits}"
        f"routes:\n  - match: {{path: /}}\n    upstream: {upstream}\n    limits: [l]\n"
    )


async def all_listening(gw: GatewayProcess, workers: int) -> None:
    await eventually(lambda: sum("listening on" in line for line in gw.stderr_lines) == workers, what="every worker to start")


async def test_the_local_stand_in_divides_by_the_workers_too():
    # store.local_divisor counts gateway instances. With workers: 2 and a divisor of 1, each
    # worker kept the whole burst in its stand-in bucket: one instance admitted 40 of a
    # burst of 20 while the store was down.
    async with serving(CountingUpstream().handle) as url:
        dead_store = f"{{url: 'redis://127.0.0.1:{free_port()}/0', local_divisor: 1}}"
        limit = "  l: {rate: 1/hour, burst: 20, key: [header:X-API-Key], on_store_error: local}\n"
        with GatewayProcess(workers_yaml(url, 2, dead_store, limit)) as gw:
            await all_listening(gw, 2)
            statuses: collections.Counter[int] = collections.Counter()
            policies = set()
            # A connection each, so the kernel spreads them over both workers (each gets
            # at least 10 of 60 but with odds below 1e-7).
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as client:
                for _ in range(60):
                    async with client.get(gw.url + "/x", headers={"X-API-Key": "k"}) as response:
                        statuses[response.status] += 1
                        policies.add(response.headers["RateLimit-Policy"])
            assert statuses == {200: 20, 429: 40}
            assert policies == {'"l";q=10;w=72000'}  # each worker's share: 20 / (1 instance x 2 workers)


async def test_a_bucket_reset_through_one_worker_frees_the_client_on_every_worker():
    # An admin request reaches one worker. The others kept their cached denial of the
    # client: after each of 8 resets, the next request was refused in about half of them
    # with workers: 2 (429, 200, 429, 429, 200, 429, 200, 200), until a 1/hour refill.
    async with serving(CountingUpstream().handle) as url:
        with RedisServer() as redis_server:
            store = f"{{url: '{redis_server.url}'}}"
            limit = "  l: {rate: 1/hour, burst: 1, key: [header:X-API-Key]}\n"
            with GatewayProcess(workers_yaml(url, 4, store, limit)) as gw:
                await all_listening(gw, 4)
                # A connection each, so the kernel spreads requests over the workers.
                async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as client:

                    async def status() -> int:
                        async with client.get(gw.url + "/x", headers={"X-API-Key": "k"}) as response:
                            return response.status

                    firsts = []
                    for _ in range(8):
                        # Denied 40 times: every worker has cached the denial (its odds of
                        # seeing none of them, 1 in 10^5).
                        assert sorted([await status() for _ in range(41)])[-40:] == [429] * 40
                        async with client.delete(gw.admin_url + "/buckets/l?value=k") as response:
                            assert response.status == 200
                            assert (await response.json())["held"] is True
                        firsts.append(await status())
                    assert firsts == [200] * 8


def test_the_reset_log_names_each_reset_once_and_says_when_some_were_lost():
    writer, reader = WorkerResets(), WorkerResets()
    reader._memory = writer._memory  # two workers' views of the memory the supervisor mapped
    assert reader.unseen() == []
    writer.publish("per_client", "header:x-api-key=k")
    writer.publish("per_client", "ip=10.0.0.1")
    assert reader.unseen() == [("per_client", "header:x-api-key=k"), ("per_client", "ip=10.0.0.1")]
    assert reader.unseen() == []
    for n in range(SLOTS + 1):  # more than the ring holds between two looks: some are lost
        writer.publish("per_client", f"ip=10.0.{n // 256}.{n % 256}")
    assert reader.unseen() is None
    assert reader.unseen() == []
    writer.publish("per_client", "header:x-api-key=" + "k" * SLOT_BYTES)  # too long to name
    assert reader.unseen() is None
