"""Envoy's rate-limit service end to end: grpcio's client, over a real socket, against the
gateway started as users start it (`rls_listen`, `rls_config` pointing at a directory in
envoyproxy/ratelimit's own format), on a private redis-server at the default 10 ms store
timeout.

- The descriptor cases of envoyproxy/ratelimit's README examples: a `key` and `value`
  pair, a `key` alone (each value its own bucket), nested descriptors, a value prefix
  (`value: foo*`), `unlimited`, `shadow_mode` and `replaces`.
- `hits_addend`, the request's and a descriptor's own, is the cost.
- All or nothing: with one descriptor over its limit, the other is not charged.
- 200 concurrent RPCs from 4 clients against a burst of 50: exactly 50 OK, none failed open.
- An unknown domain or an unmatched descriptor is OK; an empty domain, an empty descriptor
  list or a frame that is no RateLimitRequest gets a gRPC status.
- The config errors name the file and the YAML path, and a reload reads the files again.
"""

from __future__ import annotations

import asyncio
import signal
import textwrap
from pathlib import Path

import aiohttp
import pytest

from gateway.config import ConfigError, parse_config
from tests.processes import GatewayProcess, RedisServer, eventually, free_port, run_cli
from tests.scrape import scrape, value

grpc = pytest.importorskip("grpc")  # the test extra has it; skipped only where it is truly missing
from gateway.envoy.generated import ratelimit_pb2, rls_pb2, rls_pb2_grpc  # noqa: E402

pytestmark = pytest.mark.timing  # the exactness test measures under load

OK = rls_pb2.RateLimitResponse.Code.OK
OVER_LIMIT = rls_pb2.RateLimitResponse.Code.OVER_LIMIT
Descriptor = ratelimit_pb2.RateLimitDescriptor

# envoyproxy/ratelimit's README examples, in their format, with the gateway's keys where marked.
EXAMPLES = {
    "mongo.yaml": """
        domain: mongo_cps
        descriptors:
          - key: database
            value: users
            rate_limit:
              unit: second
              requests_per_unit: 5
          - key: database
            value: default
            rate_limit:
              unit: second
              requests_per_unit: 2
    """,
    "edge.yaml": """
        domain: edge_proxy_per_ip
        descriptors:
          - key: remote_address
            rate_limit:
              unit: minute
              requests_per_unit: 3
          - key: remote_address
            value: 50.0.0.5
            rate_limit:
              unit: second
              requests_per_unit: 1
    """,
    "messaging.yaml": """
        domain: messaging
        descriptors:
          - key: message_type
            value: marketing
            descriptors:
              - key: to_number
                rate_limit:
                  unit: day
                  requests_per_unit: 2
                  algorithm: fixed_window
          - key: to_number
            rate_limit:
              unit: day
              requests_per_unit: 4
          - key: key1
            value: prefix*
            rate_limit:
              unit: minute
              requests_per_unit: 1
          - key: bay
            rate_limit:
              unlimited: true
          - key: tenant
            value: loud
            shadow_mode: true
            rate_limit:
              unit: minute
              requests_per_unit: 1
    """,
    "replaces.yaml": """
        domain: replaces
        descriptors:
          - key: key1
            value: value1
            descriptors:
              - key: subkey1
                rate_limit:
                  name: subkey_limit
                  unit: minute
                  requests_per_unit: 1
          - key: key2
            value: value2
            rate_limit:
              unit: minute
              requests_per_unit: 3
              replaces:
                - name: subkey_limit
    """,
    "cost.yaml": """
        domain: cost
        descriptors:
          - key: a
            rate_limit: {unit: hour, requests_per_unit: 10}
          - key: b
            rate_limit: {unit: hour, requests_per_unit: 2}
          - key: burst
            rate_limit: {unit: hour, requests_per_unit: 50}
    """,
}

GATEWAY = """
store: {{url: "{url}"}}
rls_listen: 127.0.0.1:{port}
rls_config: {directory}
routes:
  - match: {{path: /}}
    upstream: http://127.0.0.1:9
"""


def descriptor(*entries: tuple[str, str], hits: int | None = None) -> Descriptor:
    d = Descriptor(entries=[Descriptor.Entry(key=k, value=v) for k, v in entries])
    if hits is not None:
        d.hits_addend.value = hits
    return d


def request(domain: str, *descriptors: Descriptor, hits: int = 0) -> rls_pb2.RateLimitRequest:
    return rls_pb2.RateLimitRequest(domain=domain, descriptors=descriptors, hits_addend=hits)


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("rls-config")
    for name, text in EXAMPLES.items():
        (directory / name).write_text(textwrap.dedent(text))
    return directory


@pytest.fixture(scope="module")
def gateway(config_dir):
    port = free_port()
    with RedisServer(dedicated=True) as redis, GatewayProcess(GATEWAY.format(url=redis.url, port=port, directory=config_dir)) as gw:
        gw.rls_target = f"127.0.0.1:{port}"
        yield gw


@pytest.fixture
async def stub(gateway):
    async with grpc.aio.insecure_channel(gateway.rls_target) as channel:
        yield rls_pb2_grpc.RateLimitServiceStub(channel)


def codes(response) -> list[int]:
    return [s.code for s in response.statuses]


async def test_a_key_and_value_pair_is_one_bucket_with_its_limit_and_headers(stub):
    first = await stub.ShouldRateLimit(request("mongo_cps", descriptor(("database", "users"))))
    assert first.overall_code == OK
    (status,) = first.statuses
    assert status.current_limit.requests_per_unit == 5
    assert status.current_limit.unit == rls_pb2.RateLimitResponse.RateLimit.Unit.SECOND
    assert status.limit_remaining == 4
    assert status.duration_until_reset.seconds == 1  # a token bucket: until it is full again
    headers = {h.key: h.value for h in first.response_headers_to_add}
    assert set(headers) == {"RateLimit-Policy", "RateLimit"}
    assert headers["RateLimit-Policy"].endswith(";q=5;w=1")
    assert ";r=4;t=" in headers["RateLimit"]
    for _ in range(4):
        assert (await stub.ShouldRateLimit(request("mongo_cps", descriptor(("database", "users"))))).overall_code == OK
    over = await stub.ShouldRateLimit(request("mongo_cps", descriptor(("database", "users"))))
    assert over.overall_code == OVER_LIMIT and over.statuses[0].limit_remaining == 0
    # Another value is another rule with its own bucket.
    other = await stub.ShouldRateLimit(request("mongo_cps", descriptor(("database", "default"))))
    assert other.overall_code == OK and other.statuses[0].current_limit.requests_per_unit == 2


async def test_a_key_without_a_value_gives_each_value_its_own_bucket_and_a_value_rule_wins(stub):
    for _ in range(3):
        assert (await stub.ShouldRateLimit(request("edge_proxy_per_ip", descriptor(("remote_address", "10.0.0.1"))))).overall_code == OK
    assert (await stub.ShouldRateLimit(request("edge_proxy_per_ip", descriptor(("remote_address", "10.0.0.1"))))).overall_code == OVER_LIMIT
    assert (await stub.ShouldRateLimit(request("edge_proxy_per_ip", descriptor(("remote_address", "10.0.0.2"))))).overall_code == OK
    special = await stub.ShouldRateLimit(request("edge_proxy_per_ip", descriptor(("remote_address", "50.0.0.5"))))
    assert special.statuses[0].current_limit.requests_per_unit == 1
    assert special.statuses[0].current_limit.unit == rls_pb2.RateLimitResponse.RateLimit.Unit.SECOND


async def test_nested_descriptors_a_prefix_value_and_a_fixed_window(stub):
    marketing = descriptor(("message_type", "marketing"), ("to_number", "2061234567"))
    plain = descriptor(("to_number", "2061234567"))
    response = await stub.ShouldRateLimit(request("messaging", marketing, plain))
    assert codes(response) == [OK, OK]
    assert [s.current_limit.requests_per_unit for s in response.statuses] == [2, 4]
    assert 0 < response.statuses[0].duration_until_reset.seconds <= 86400  # until the UTC day ends
    assert codes(await stub.ShouldRateLimit(request("messaging", marketing))) == [OK]
    assert codes(await stub.ShouldRateLimit(request("messaging", marketing))) == [OVER_LIMIT]
    # The walk stops short (message_type alone has no rate limit): unmatched, OK.
    assert codes(await stub.ShouldRateLimit(request("messaging", descriptor(("message_type", "marketing"))))) == [OK]
    prefixed = descriptor(("key1", "prefix-abc"))
    assert codes(await stub.ShouldRateLimit(request("messaging", prefixed))) == [OK]
    assert codes(await stub.ShouldRateLimit(request("messaging", prefixed))) == [OVER_LIMIT]


async def test_unlimited_and_shadow_mode_never_refuse(stub):
    for _ in range(5):
        response = await stub.ShouldRateLimit(request("messaging", descriptor(("bay", "x"))))
        assert response.overall_code == OK and not response.statuses[0].HasField("current_limit")
        assert response.statuses[0].limit_remaining == 2**32 - 1  # as envoyproxy/ratelimit answers it
    loud = [await stub.ShouldRateLimit(request("messaging", descriptor(("tenant", "loud")))) for _ in range(3)]
    assert [r.overall_code for r in loud] == [OK, OK, OK]
    assert [r.statuses[0].limit_remaining for r in loud] == [0, 0, 0]


async def test_replaces_drops_the_replaced_limit(stub):
    sub = descriptor(("key1", "value1"), ("subkey1", "s"))
    both = request("replaces", sub, descriptor(("key2", "value2")))
    for _ in range(3):  # subkey_limit alone would refuse the second
        response = await stub.ShouldRateLimit(both)
        assert codes(response) == [OK, OK]
        assert response.statuses[0].current_limit.requests_per_unit == 0
    assert codes(await stub.ShouldRateLimit(both)) == [OK, OVER_LIMIT]
    assert codes(await stub.ShouldRateLimit(request("replaces", sub))) == [OK]  # never charged meanwhile
    assert codes(await stub.ShouldRateLimit(request("replaces", sub))) == [OVER_LIMIT]


async def test_hits_addend_of_the_request_and_of_a_descriptor_is_the_cost(stub):
    response = await stub.ShouldRateLimit(request("cost", descriptor(("a", "1")), hits=4))
    assert response.statuses[0].limit_remaining == 6
    response = await stub.ShouldRateLimit(request("cost", descriptor(("a", "1"), hits=5), hits=4))
    assert response.statuses[0].limit_remaining == 1
    response = await stub.ShouldRateLimit(request("cost", descriptor(("a", "1"), hits=0)))
    assert response.overall_code == OK and response.statuses[0].limit_remaining == 1  # a cost of 0 reads
    assert (await stub.ShouldRateLimit(request("cost", descriptor(("a", "1")), hits=2))).overall_code == OVER_LIMIT


async def test_all_or_nothing_across_two_descriptors(stub):
    a, b = descriptor(("a", "all-or-nothing")), descriptor(("b", "all-or-nothing"))
    assert codes(await stub.ShouldRateLimit(request("cost", a, b, hits=2))) == [OK, OK]  # b is spent
    refused = await stub.ShouldRateLimit(request("cost", a, b))
    assert refused.overall_code == OVER_LIMIT and codes(refused) == [OK, OVER_LIMIT]
    # a was not charged by the refused request: 8 left, not 7.
    assert (await stub.ShouldRateLimit(request("cost", a))).statuses[0].limit_remaining == 7


async def test_the_ok_descriptor_of_a_refused_request_says_what_its_bucket_holds(stub):
    """Refused again and again (the denial cache answers after the first), the descriptor
    that was not charged still says its 10 and when its bucket is full, never 0 and 0."""
    a, b = descriptor(("a", "true-numbers")), descriptor(("b", "true-numbers"))
    await stub.ShouldRateLimit(request("cost", b, hits=2))  # b: 2 an hour, spent
    for _ in range(5):
        refused = await stub.ShouldRateLimit(request("cost", a, b))
        assert codes(refused) == [OK, OVER_LIMIT]
        assert [s.limit_remaining for s in refused.statuses] == [10, 0]
        assert refused.statuses[0].duration_until_reset.seconds == 0  # a full bucket
        assert refused.statuses[1].duration_until_reset.seconds == 1800  # b's 1 token at 2 an hour


async def test_a_bucket_named_twice_in_a_request_is_charged_for_both(stub):
    """As envoyproxy/ratelimit counts both hits: b (2 an hour) named twice takes 2, three
    times is over (and, all or nothing, charges nothing)."""
    b = descriptor(("b", "twice"))
    assert codes(await stub.ShouldRateLimit(request("cost", b, b, b))) == [OVER_LIMIT] * 3
    both = await stub.ShouldRateLimit(request("cost", b, b))
    assert codes(both) == [OK, OK] and [s.limit_remaining for s in both.statuses] == [0, 0]
    assert codes(await stub.ShouldRateLimit(request("cost", b))) == [OVER_LIMIT]


async def test_a_limit_override_in_an_unknown_domain_is_ignored(stub):
    """As envoyproxy/ratelimit: an unknown domain has no limits, its descriptors' overrides neither."""
    override = descriptor(("a", "1"))
    override.limit.requests_per_unit, override.limit.unit = 3, rls_pb2.RateLimitResponse.RateLimit.Unit.DAY
    for _ in range(5):
        response = await stub.ShouldRateLimit(request("no-such-domain", override))
        assert response.overall_code == OK and not response.statuses[0].HasField("current_limit")
    known = await stub.ShouldRateLimit(request("cost", override))
    assert known.statuses[0].current_limit.requests_per_unit == 3 and known.statuses[0].limit_remaining == 2


async def test_unknown_domain_and_unmatched_descriptors_are_ok(stub):
    response = await stub.ShouldRateLimit(request("no-such-domain", descriptor(("a", "1"))))
    assert response.overall_code == OK and codes(response) == [OK]
    response = await stub.ShouldRateLimit(request("cost", descriptor(("nothing", "here")), descriptor(("a", "unmatched-test"))))
    assert codes(response) == [OK, OK] and response.statuses[1].limit_remaining == 9


@pytest.mark.parametrize(
    "bad",
    [request("", descriptor(("a", "1"))), request("cost")],
    ids=["empty domain", "no descriptors"],
)
async def test_requests_the_service_cannot_answer_get_invalid_argument(stub, bad):
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stub.ShouldRateLimit(bad)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_garbage_frame_gets_a_grpc_status_and_the_service_goes_on(gateway, stub):
    async with grpc.aio.insecure_channel(gateway.rls_target) as channel:
        raw = channel.unary_unary("/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit")
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await raw(b"\xff\xff\xff\xff garbage")
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (await stub.ShouldRateLimit(request("cost", descriptor(("a", "after-garbage"))))).overall_code == OK
    assert "Traceback" not in "".join(gateway.stderr_lines)


async def test_200_concurrent_rpcs_from_4_clients_admit_exactly_the_burst(gateway):
    channels = [grpc.aio.insecure_channel(gateway.rls_target) for _ in range(4)]
    try:
        stubs = [rls_pb2_grpc.RateLimitServiceStub(c) for c in channels]
        for c in channels:
            await c.channel_ready()
        burst = request("cost", descriptor(("burst", "exactness")))
        responses = await asyncio.gather(*(stubs[i % 4].ShouldRateLimit(burst) for i in range(200)))
    finally:
        for c in channels:
            await c.close()
    assert sum(r.overall_code == OK for r in responses) == 50
    async with aiohttp.ClientSession() as client:
        _, samples = await scrape(client, gateway.admin_url)
    assert value(samples, "gateway_rls_descriptors_total", domain="cost", decision="fail_open") == 0
    assert value(samples, "gateway_rls_descriptors_total", domain="cost", decision="deny") >= 150


async def test_with_two_workers_the_port_is_shared_and_the_burst_is_exact(config_dir):
    """workers: 2 on one Redis: both bind rls_listen, 16 channels (spread over the workers
    by the kernel) with 200 RPCs in flight admit exactly the burst, and the admin
    listener's counts are the workers' summed."""
    port = free_port()
    workers = f"workers: 2\nlisten: 127.0.0.1:{free_port()}\nadmin_listen: 127.0.0.1:{free_port()}\n"
    with RedisServer(dedicated=True) as redis, GatewayProcess(
        workers + GATEWAY.format(url=redis.url, port=port, directory=config_dir)
    ) as gw:
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in range(16)]
        try:
            for c in channels:
                await c.channel_ready()
            stubs = [rls_pb2_grpc.RateLimitServiceStub(c) for c in channels]
            burst = request("cost", descriptor(("burst", "workers")))
            responses = await asyncio.gather(*(stubs[i % 16].ShouldRateLimit(burst) for i in range(200)))
        finally:
            for c in channels:
                await c.close()
        async with aiohttp.ClientSession() as client:
            _, samples = await scrape(client, gw.admin_url)
    assert sum(r.overall_code == OK for r in responses) == 50
    assert value(samples, "gateway_rls_descriptors_total", domain="cost", decision="allow") == 50
    assert value(samples, "gateway_rls_descriptors_total", domain="cost", decision="deny") == 150
    assert value(samples, "gateway_rls_descriptors_total", domain="cost", decision="fail_open") == 0


def _error(tmp_path: Path, text: str, gateway_extra: str = "") -> str:
    (tmp_path / "bad.yaml").write_text(textwrap.dedent(text))
    config = f"rls_listen: 127.0.0.1:0\nrls_config: {tmp_path}\n{gateway_extra}routes: [{{match: {{path: /}}, upstream: http://a}}]\n"
    with pytest.raises(ConfigError) as error:
        parse_config(config, source="gw.yaml", environ={})
    return str(error.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("domain: d\ndescriptors: [{key: k, rate_limit: {unit: minute, requests_per_unit: 5, algorithm: fixed_window}}]\n",
         "bad.yaml: descriptors[0].rate_limit.algorithm: fixed_window counts in the gateway's quota windows"),
        ("domain: d\ndescriptors: [{key: k, rate_limit: {unit: fortnight, requests_per_unit: 5}}]\n",
         "bad.yaml: descriptors[0].rate_limit.unit: expected second, minute"),
        ("domain: d\ndescriptors: [{key: k, descriptors: [{key: j, rate_limit: {unit: second, requests_per_unit: -1}}]}]\n",
         "bad.yaml: descriptors[0].descriptors[0].rate_limit.requests_per_unit: expected an integer >= 0"),
        ("domain: d\ndescriptors: [{key: k, detailed_metrics: true}]\n",
         "bad.yaml: descriptors[0].detailed_metrics: unknown key"),
        ("domain: d\ndescriptors: [{key: k, rate_limit: {unit: second, requests_per_unit: 1}, on_store_error: sometimes}]\n",
         "bad.yaml: descriptors[0].on_store_error: expected open, closed or local"),
    ],
)
def test_a_config_the_gateway_cannot_honour_names_the_file_and_yaml_path(tmp_path, text, expected):
    message = _error(tmp_path, text)
    assert expected in message and "\n" not in message


def test_rls_listen_needs_rls_config():
    with pytest.raises(ConfigError, match="needs both rls_listen and rls_config"):
        parse_config("rls_listen: 127.0.0.1:0\nroutes: [{match: {path: /}, upstream: http://a}]\n", source="gw.yaml", environ={})


async def test_a_reload_reads_the_files_again(tmp_path):
    (tmp_path / "r.yaml").write_text("domain: r\ndescriptors: [{key: k, rate_limit: {unit: hour, requests_per_unit: 1}}]\n")
    port = free_port()
    config = f"rls_listen: 127.0.0.1:{port}\nrls_config: {tmp_path}\nroutes: [{{match: {{path: /}}, upstream: http://127.0.0.1:9}}]\n"
    with GatewayProcess(config) as gw:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = rls_pb2_grpc.RateLimitServiceStub(channel)
            first = await stub.ShouldRateLimit(request("r", descriptor(("k", "v"))))
            assert first.statuses[0].current_limit.requests_per_unit == 1
            (tmp_path / "r.yaml").write_text("domain: r\ndescriptors: [{key: k, rate_limit: {unit: hour, requests_per_unit: 7}}]\n")
            gw.signal(signal.SIGHUP)

            async def reloaded() -> bool:
                response = await stub.ShouldRateLimit(request("r", descriptor(("k", "v"))))
                return response.statuses[0].current_limit.requests_per_unit == 7

            await eventually(reloaded, what="the reloaded rls_config")


def test_charge_always_is_taken_and_shown_by_gateway_check_and_a_wrong_value_is_refused(tmp_path):
    rls_dir = tmp_path / "rls"
    rls_dir.mkdir()
    (rls_dir / "llm.yaml").write_text(
        "domain: llm\ndescriptors: [{key: k, rate_limit: {unit: minute, requests_per_unit: 10, charge: always}}]\n"
    )
    config = tmp_path / "gateway.yaml"
    config.write_text(f"rls_listen: 127.0.0.1:0\nrls_config: {rls_dir}\nroutes: [{{match: {{path: /}}, upstream: 'http://a'}}]\n")
    result = run_cli("check", "-c", str(config))
    assert result.returncode == 0, result.stderr
    assert "    k: 10/minute, token bucket, on_store_error open, charge always" in result.stdout.splitlines()
    message = _error(tmp_path, "domain: d\ndescriptors: [{key: k, rate_limit: {unit: minute, requests_per_unit: 5, charge: later}}]\n")
    assert "bad.yaml: descriptors[0].rate_limit.charge: expected when_allowed or always, got 'later'" in message
    message = _error(tmp_path, "domain: d\ndescriptors: [{key: k, rate_limit: {unlimited: true, charge: always}}]\n")
    assert "bad.yaml: descriptors[0].rate_limit" in message and "an unlimited rate_limit counts nothing" in message
