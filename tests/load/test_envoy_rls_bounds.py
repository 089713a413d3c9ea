"""The bounds of Envoy's rate-limit service (gateway.envoy.bounds), against the gateway started
as users start it (`rls_listen`), on a private redis-server at the default 10 ms store timeout.

- A request at every cap is answered; one over a cap (descriptors, entries, a key or value,
  the frame's size) gets INVALID_ARGUMENT with a one-line reason, before any of it is
  checked, and the service goes on. Values the size of real tokens are counted.
- Two senders looping the 20,000-descriptor RPCs that used to stall the event loop leave
  the public listener's burst-3 limit admitting exactly 3, with no store failure counted.
- 2,000 concurrent RPCs on one channel against a fail-closed rule: every one answered, none
  an error status (grpcio's default pending-call limits cancelled some).
- Past `max_in_flight`, RPCs are answered by their rules' failure policies, the store unasked,
  and counted in gateway_rls_shed_total; a `local` rule's stand-in refuses once empty, shed
  or with the store down.
- A store failure on a request of 64 descriptors logs one bounded line.
"""

from __future__ import annotations

import asyncio
import textwrap

import aiohttp
import pytest

from gateway.envoy.bounds import MAX_DESCRIPTORS, MAX_ENTRIES, MAX_MESSAGE_BYTES, MAX_VALUE_BYTES, frame_fault, request_fault
from gateway.testing import running_gateway
from tests.processes import GatewayProcess, RedisServer, eventually, free_port
from tests.scrape import decisions, scrape, value

grpc = pytest.importorskip("grpc")  # the test extra has it; skipped only where it is truly missing
from gateway.envoy.generated import rls_pb2, rls_pb2_grpc  # noqa: E402
from tests.load.test_envoy_rls import OK, OVER_LIMIT, descriptor, request  # noqa: E402

pytestmark = pytest.mark.timing  # floods the service, and measures the public listener beside it

METHOD = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
RULES = """
domain: bounds
descriptors:
  - key: k
    rate_limit: {unit: hour, requests_per_unit: 1000000}
  - key: token
    rate_limit: {unit: hour, requests_per_unit: 10}
  - key: closed
    on_store_error: closed
    rate_limit: {unit: hour, requests_per_unit: 50}
  - key: open
    rate_limit: {unit: hour, requests_per_unit: 2}
  - key: local
    on_store_error: local
    rate_limit: {unit: hour, requests_per_unit: 2}
"""
GATEWAY = """
store: {store}
rls_listen: 127.0.0.1:{port}
rls_config: {directory}
limits:
  burst3: {{rate: 3/hour, burst: 3, key: "header:X-Key"}}
routes:
  - match: {{path: /limited}}
    upstream: {upstream}
    limits: [burst3]
  - match: {{path: /}}
    upstream: {upstream}
"""
# The request that stalled the event loop: 20,000 descriptors, each a bucket of its own.
# Public listener clients asked while the senders run.
ROUNDS = 30
OVERSIZE = request("bounds", *(descriptor(("k", f"v{i}")) for i in range(20_000))).SerializeToString()
# Five values of 60 KiB, each under the value cap, are over the frame's.
FIVE_TOKENS = request("bounds", *(descriptor(("token", "x" * 60 * 1024)) for _ in range(5))).SerializeToString()


def config(redis_url: str, port: int, directory, upstream: str = "http://127.0.0.1:9", extra: str = "") -> str:
    """`redis_url`, or a whole `store` mapping."""
    store = redis_url if redis_url.startswith("{") else f'{{url: "{redis_url}"}}'
    return extra + GATEWAY.format(store=store, port=port, directory=directory, upstream=upstream)


@pytest.fixture(scope="module")
def rules(tmp_path_factory):
    directory = tmp_path_factory.mktemp("rls-bounds")
    (directory / "bounds.yaml").write_text(textwrap.dedent(RULES))
    return directory


@pytest.fixture(scope="module")
def gateway(rules):
    port = free_port()
    with RedisServer(dedicated=True) as redis, GatewayProcess(config(redis.url, port, rules)) as gw:
        gw.rls_target = f"127.0.0.1:{port}"
        yield gw


@pytest.fixture
async def channel(gateway):
    async with grpc.aio.insecure_channel(gateway.rls_target, options=[("grpc.max_send_message_length", -1)]) as channel:
        yield channel


def at_caps() -> rls_pb2.RateLimitRequest:
    """MAX_DESCRIPTORS descriptors of MAX_ENTRIES entries, one value of MAX_VALUE_BYTES."""
    full = [descriptor(*((f"e{j}", f"d{i}") for j in range(MAX_ENTRIES))) for i in range(MAX_DESCRIPTORS - 1)]
    return request("bounds", descriptor(("token", "t" * MAX_VALUE_BYTES)), *full)


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (request("bounds", *(descriptor(("k", "v")) for _ in range(MAX_DESCRIPTORS + 1))), "65 descriptors is over the limit of 64"),
        (request("bounds", descriptor(*(("k", "v") for _ in range(MAX_ENTRIES + 1)))), "descriptors[0] has 17 entries, over the limit of 16"),
        (request("bounds", descriptor(("k", "v")), descriptor(("k", "v" * (MAX_VALUE_BYTES + 1)))),
         "descriptors[1].entries[0]: a key or value is over the 65536-byte limit"),
        (request("bounds", descriptor(("k" * (MAX_VALUE_BYTES + 1), "v"))), "descriptors[0].entries[0]: a key or value is over"),
        # 4-byte characters: 16,385 of them are 65,540 bytes.
        (request("bounds", descriptor(("k", "\U0001f600" * (MAX_VALUE_BYTES // 4 + 1)))), "a key or value is over the 65536-byte limit"),
        (request("d" * (MAX_VALUE_BYTES + 1), descriptor(("k", "v"))), "domain is over the 65536-byte limit"),
    ],
    ids=["descriptors", "entries", "value", "key", "utf-8 value", "domain"],
)
def test_a_request_over_a_cap_is_named_by_its_first_fault(bad, reason):
    assert reason in request_fault(bad, bad.ByteSize())


def test_a_request_at_every_cap_and_a_frame_at_the_size_cap_pass():
    assert request_fault(at_caps(), at_caps().ByteSize()) is None
    four_byte_characters = request("bounds", descriptor(("k", "\U0001f600" * (MAX_VALUE_BYTES // 4))))
    assert request_fault(four_byte_characters, four_byte_characters.ByteSize()) is None
    assert frame_fault(MAX_MESSAGE_BYTES) is None
    assert frame_fault(MAX_MESSAGE_BYTES + 1) == "request of 262145 bytes is over the 262144-byte limit"


async def test_a_request_at_every_cap_is_answered(channel):
    response = await rls_pb2_grpc.RateLimitServiceStub(channel).ShouldRateLimit(at_caps())
    assert response.overall_code == OK and len(response.statuses) == MAX_DESCRIPTORS
    assert response.statuses[0].limit_remaining == 9  # the 64 KiB value is a bucket, charged


async def test_values_the_size_of_real_tokens_are_counted(channel):
    stub = rls_pb2_grpc.RateLimitServiceStub(channel)
    for size in (1845, 8 * 1024, 60 * 1024):  # an Azure AD JWT; the HTTP side's identity cap; Envoy's header limit
        token = descriptor(("token", "x" * size))
        assert [(await stub.ShouldRateLimit(request("bounds", token))).statuses[0].limit_remaining for _ in range(2)] == [9, 8]


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        (request("bounds", *(descriptor(("k", "v")) for _ in range(MAX_DESCRIPTORS + 1))).SerializeToString(),
         "65 descriptors is over the limit of 64"),
        (request("bounds", descriptor(("k", "v" * (MAX_VALUE_BYTES + 1)))).SerializeToString(),
         "descriptors[0].entries[0]: a key or value is over the 65536-byte limit"),
        (FIVE_TOKENS, f"request of {len(FIVE_TOKENS)} bytes is over the 262144-byte limit"),
        (OVERSIZE, f"request of {len(OVERSIZE)} bytes is over the 262144-byte limit"),
    ],
    ids=["descriptors", "value", "frame", "20,000 descriptors"],
)
async def test_an_rpc_over_a_cap_gets_invalid_argument_with_its_reason(gateway, channel, frame, reason):
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await channel.unary_unary(METHOD)(frame)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details() == reason
    stub = rls_pb2_grpc.RateLimitServiceStub(channel)
    assert (await stub.ShouldRateLimit(request("bounds", descriptor(("k", "after"))))).overall_code == OK
    assert "Traceback" not in "".join(gateway.stderr_lines)


async def test_past_grpcios_ceiling_grpcio_refuses_unread(channel):
    huge = request("bounds", *(descriptor(("token", "x" * 60 * 1024)) for _ in range(70))).SerializeToString()
    assert len(huge) > 4 * 1024 * 1024
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await channel.unary_unary(METHOD)(huge)
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_2000_concurrent_rpcs_on_one_channel_are_all_answered(gateway, channel):
    """grpcio's default pending-call limits answered 164 of these CANCELLED, which Envoy
    lets through (failure_mode_deny: false), bypassing `on_store_error: closed`."""
    stub = rls_pb2_grpc.RateLimitServiceStub(channel)
    await channel.channel_ready()
    burst = request("bounds", descriptor(("closed", "2000")))
    answers = await asyncio.gather(*(stub.ShouldRateLimit(burst) for _ in range(2000)), return_exceptions=True)
    errors = [a for a in answers if isinstance(a, BaseException)]
    assert errors == []
    codes = [a.overall_code for a in answers]
    assert codes.count(OK) + codes.count(OVER_LIMIT) == 2000
    assert 0 < codes.count(OK) <= 50
    async with aiohttp.ClientSession() as client:
        _, samples = await scrape(client, gateway.admin_url)
    assert value(samples, "gateway_rls_descriptors_total", domain="bounds", decision="fail_open") == 0


async def test_oversize_senders_leave_the_public_listeners_limit_exact(rules, upstream):
    """Two senders loop the 20,000-descriptor RPC while 30 clients of the public listener
    each send 8 requests at once under a burst-3 limit. Each such RPC used to hold the
    event loop for one 20,000-key script: clients' store checks timed out and failed
    open, and some of them got all 8 through (22 fail_open in one run, 8 in another)."""
    port = free_port()
    with RedisServer(dedicated=True) as redis, GatewayProcess(config(redis.url, port, rules, upstream)) as gw:
        stop = asyncio.Event()
        refused = [0, 0]
        answered = [asyncio.Event(), asyncio.Event()]

        async def sender(i: int) -> None:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", -1)]) as channel:
                send = channel.unary_unary(METHOD)
                while not stop.is_set():
                    with pytest.raises(grpc.aio.AioRpcError) as error:
                        await send(OVERSIZE)
                    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    refused[i] += 1
                    answered[i].set()

        senders = [asyncio.ensure_future(sender(i)) for i in range(2)]
        try:
            await asyncio.wait_for(asyncio.gather(*(a.wait() for a in answered)), 30)
            async with aiohttp.ClientSession() as client:

                async def one(key: str) -> int:
                    async with client.get(gw.url + "/limited", headers={"X-Key": key}) as response:
                        return response.status

                # Rounds of 8 at once, each round a client of its own, so each asks the store.
                admitted = [(await asyncio.gather(*(one(f"probe-{r}") for _ in range(8)))).count(200) for r in range(ROUNDS)]
                stop.set()
                await asyncio.gather(*senders)
                counts = await decisions(client, gw.admin_url)
                _, samples = await scrape(client, gw.admin_url)
        finally:
            stop.set()
            await asyncio.gather(*senders, return_exceptions=True)
    assert all(refused)
    assert admitted == [3] * ROUNDS
    assert counts["burst3", "allow"] == 3 * ROUNDS and counts["burst3", "fail_open"] == 0
    assert value(samples, "gateway_store_breaker", state="open") == 0


async def test_past_max_in_flight_rpcs_are_answered_by_their_failure_policies(rules):
    """max_in_flight: 1, and the one RPC in flight held by a paused store (a long
    store.timeout keeps it there): the 49 sent beside it are answered at once by the
    fail-closed rule's policy, the store unasked, and the held one once the store is back."""
    port = free_port()
    with RedisServer(dedicated=True) as redis, GatewayProcess(
        config(f'{{url: "{redis.url}", timeout: 60s}}', port, rules, extra="max_in_flight: 1\n")
    ) as gw:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await channel.channel_ready()
            stub = rls_pb2_grpc.RateLimitServiceStub(channel)
            held = request("bounds", descriptor(("closed", "held")))
            redis.pause()
            try:
                calls = [asyncio.ensure_future(stub.ShouldRateLimit(held)) for _ in range(50)]
                await eventually(lambda: sum(c.done() for c in calls) == 49, what="49 answers beside the held one")
            finally:
                redis.resume()
            answers = await asyncio.gather(*calls)
        async with aiohttp.ClientSession() as client:
            _, samples = await scrape(client, gw.admin_url)
        await eventually(lambda: any("RPCs in flight (max_in_flight)" in line for line in gw.stderr_lines), what="the shed line")
    assert sorted(a.overall_code for a in answers) == [OK] + [OVER_LIMIT] * 49
    assert value(samples, "gateway_rls_descriptors_total", domain="bounds", decision="fail_closed") == 49
    assert value(samples, "gateway_rls_descriptors_total", domain="bounds", decision="allow") == 1
    assert value(samples, "gateway_rls_shed_total") == 49


async def test_a_shed_rpc_takes_each_rules_failure_policy_and_leaves_the_store_alone(rules, redis_server):
    """open: OK; closed: OVER_LIMIT; local: the in-process stand-in, which counts on its own."""
    text = config(redis_server.url, free_port(), rules)
    async with running_gateway(text) as gw:
        service = gw.gateway.rls

        async def codes(key: str, *, shed: bool) -> list[int]:
            return [(await service.should_rate_limit(request("bounds", descriptor((key, "shed"))), shed=shed)).overall_code for _ in range(3)]

        assert await codes("open", shed=True) == [OK, OK, OK]
        assert await codes("closed", shed=True) == [OVER_LIMIT] * 3
        assert await codes("local", shed=True) == [OK, OK, OVER_LIMIT]  # the stand-in's burst of 2
        # None of them reached the store: its buckets are full.
        assert await codes("open", shed=False) == [OK, OK, OVER_LIMIT]
        assert await codes("local", shed=False) == [OK, OK, OVER_LIMIT]
        assert await codes("closed", shed=False) == [OK, OK, OK]


async def test_a_store_failure_on_64_descriptors_logs_one_bounded_line(rules):
    port = free_port()
    with RedisServer(dedicated=True) as redis, GatewayProcess(config(redis.url, port, rules)) as gw:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = rls_pb2_grpc.RateLimitServiceStub(channel)
            many = request("bounds", *(descriptor(("k", f"v{i}")) for i in range(MAX_DESCRIPTORS - 1)), descriptor(("closed", "c")))
            redis.pause()
            try:
                response = await stub.ShouldRateLimit(many)
            finally:
                redis.resume()
        assert response.overall_code == OVER_LIMIT  # the closed rule's policy

        def failure_lines() -> list[str]:
            return [line for line in gw.stderr_lines if "store failed, applying failure policies" in line]

        await eventually(failure_lines, what="the store failure's line")
    (line,) = failure_lines()
    assert "(rls.bounds.k-" in line and "=open x63, rls.bounds.closed-" in line and "=closed)" in line
    assert len(line) < 400


async def test_with_the_store_down_a_local_rule_refuses_past_its_stand_ins_burst(rules, redis_server):
    """`on_store_error: local` answers OVER_LIMIT once the in-process stand-in is empty, as
    a shed RPC's does (it used to answer OK: only the store's own refusals counted)."""
    async with running_gateway(config(redis_server.url, free_port(), rules)) as gw:
        down = request("bounds", descriptor(("local", "store-down")))
        redis_server.pause()
        try:
            codes = [(await gw.gateway.rls.should_rate_limit(down)).overall_code for _ in range(3)]
        finally:
            redis_server.resume()
    assert codes == [OK, OK, OVER_LIMIT]
