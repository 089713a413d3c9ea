"""envoyproxy/ratelimit's own config vectors, run against the gateway's loader
(gateway.config.rls) and descriptor walk (gateway.envoy.descriptors): every case of its
test/config/config_test.go at commit f2fb157, on its own YAML files (tests.rls_reference_files)
or, where the Go test builds the config as structs, on the same config written as YAML here;
its example and integration configs load (tests.rls_reference_examples); and its
integration test of share_threshold runs against the gateway started as users start it.

Each acceptance case asserts what the reference asserts about matching: which rule a
descriptor falls under (its requests_per_unit, unit, name, shadow mode), or none, and which
entries key its bucket (share_threshold). What the reference asserts about its statsd names
(Stats.Key, FullKey, detailed_metric, value_to_metric) has no counterpart in the gateway, a
documented difference (docs/envoy-rls.md, "Differences"). Each refusal is one line naming the
file and the YAML path. Pure but for the last test: no gRPC, no store.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from gateway.config import ConfigError, parse_config
from gateway.config.rls import override_limit
from gateway.envoy.descriptors import identity_of, rate_limit_of
from tests.processes import GatewayProcess, RedisServer, free_port
from tests.rls_reference_examples import EXAMPLES, INTEGRATION
from tests.rls_reference_files import CONFIG_TEST


def load(directory: Path, files: dict[str, str], *, merge: bool = False):
    """The domains of `files` (name -> YAML) as the gateway reads them from one rls_config directory."""
    directory.mkdir(exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(textwrap.dedent(text))
    extra = "rls_merge_domains: true\n" if merge else ""
    config = parse_config(
        f"rls_listen: 127.0.0.1:0\nrls_config: {directory}\n{extra}routes: [{{match: {{path: /}}, upstream: http://a}}]\n",
        source="gw.yaml", environ={},
    )
    return config.rls.domains


def rule(domains, domain: str, *entries: tuple[str, str]):
    return rate_limit_of(domains, domain, entries)[0]


def limit(domains, domain: str, *entries: tuple[str, str]) -> tuple[int, str] | None:
    """(requests_per_unit, unit) of the rule the descriptor falls under, or None."""
    found = rule(domains, domain, *entries)
    return None if found is None else (found.requests_per_unit, found.unit)


def keyed(domains, domain: str, *entries: tuple[str, str]) -> list[tuple[str, str]]:
    """The entries the descriptor's bucket is keyed by."""
    return list(rate_limit_of(domains, domain, entries)[1])


def test_basic_config(tmp_path):  # TestBasicConfig
    d = load(tmp_path, {"basic_config.yaml": CONFIG_TEST["basic_config.yaml"]})
    assert rule(d, "foo_domain") is None and rule(d, "test-domain") is None
    for entries in (
        [("key1", "something")], [("key1", "value1")], [("key2", "value2"), ("subkey", "subvalue")],
        [("key5", "value5"), ("subkey5", "subvalue")], [("key2", "value3")],
    ):
        assert limit(d, "test-domain", *entries) is None, entries
    assert limit(d, "test-domain", ("key1", "value1"), ("subkey1", "something")) == (5, "second")
    assert limit(d, "test-domain", ("key1", "value1"), ("subkey1", "subvalue1")) == (10, "second")
    assert limit(d, "test-domain", ("key2", "something")) == (20, "minute")
    assert limit(d, "test-domain", ("key2", "value2")) == (30, "minute")
    key3 = rule(d, "test-domain", ("key3", "foo"))
    assert (key3.requests_per_unit, key3.unit, key3.name) == (1, "hour", "")
    key4 = rule(d, "test-domain", ("key4", "foo"))
    assert (key4.requests_per_unit, key4.unit, key4.name) == (1, "day", "key4_rate_limit")
    assert rule(d, "test-domain", ("key6", "foo")).limit is None  # unlimited
    # detailed_metric: one rule for every value; each value its own bucket, as the reference's cache keys.
    unspecified = rate_limit_of(d, "test-domain", [("key7", "unspecified_value")])
    another = rate_limit_of(d, "test-domain", [("key7", "another_value")])
    assert unspecified[0] is another[0] and limit(d, "test-domain", ("key7", "x")) == (70, "minute")
    assert identity_of(unspecified[1]) != identity_of(another[1])


def test_domain_merge(tmp_path):  # TestDomainMerge
    files = {name: CONFIG_TEST[name] for name in ("merge_domain_key1.yaml", "merge_domain_key2.yaml")}
    d = load(tmp_path, files, merge=True)
    assert rule(d, "foo_domain") is None and rule(d, "test-domain") is None
    assert limit(d, "test-domain", ("key1", "value1")) == (10, "minute")
    assert limit(d, "test-domain", ("key2", "value2")) == (20, "minute")


def test_config_limit_override():  # TestConfigLimitOverride
    # The override replaces the configured rule (gateway.envoy.service applies it, and ignores
    # it in a domain the config does not have); here, the bucket it is counted in: its own
    # count and unit, never in shadow mode. One per count and unit, a documented difference.
    day, hour = override_limit("test-domain", 10, "day"), override_limit("test-domain", 42, "hour")
    assert (day.burst, day.rate.period_seconds, day.shadow) == (10, 86400.0, False)
    assert (hour.burst, hour.rate.period_seconds) == (42, 3600.0)
    assert day.name != hour.name


def test_shadow_mode_config(tmp_path):  # TestShadowModeConfig
    d = load(tmp_path, {"shadowmode_config.yaml": CONFIG_TEST["shadowmode_config.yaml"]})
    cases = [
        ([("key1", "value1"), ("subkey1", "something")], 5, "second", False),
        ([("key1", "value1"), ("subkey1", "subvalue1")], 10, "second", True),
        ([("key2", "something")], 20, "minute", True),
        ([("key2", "value2")], 30, "minute", False),
    ]
    for entries, count, unit, shadow in cases:
        found = rule(d, "test-domain", *entries)
        assert (found.requests_per_unit, found.unit, found.limit.shadow) == (count, unit, shadow), entries


def test_wildcard_config(tmp_path):  # TestWildcardConfig
    d = load(tmp_path, {"wildcard.yaml": CONFIG_TEST["wildcard.yaml"]})
    assert rule(d, "test-domain", ("noVal", "foo1")) is rule(d, "test-domain", ("noVal", "foo2")) is not None
    wild = rule(d, "test-domain", ("wild", "foo1"))
    assert wild is not None and wild is rule(d, "test-domain", ("wild", "foo2"))
    assert limit(d, "test-domain", ("nestedWild", "val1"), ("wild", "goo2")) == (20, "minute")
    assert rule(d, "test-domain", ("wild", "bar")) is None
    assert rule(d, "test-domain", ("noWild", "foo1")) is None  # no eager match of a value without *
    middle = rule(d, "test-domain", ("midWild", "barab"))
    assert middle is not None and middle is rule(d, "test-domain", ("midWild", "bar123b"))
    assert rule(d, "test-domain", ("midWild", "barb")) is middle  # * matches the empty string
    assert rule(d, "test-domain", ("midWild", "bara")) is None  # no suffix
    assert rule(d, "test-domain", ("midWild", "xbarb")) is None  # no prefix
    multi = rule(d, "test-domain", ("multiWild", "foo123bar456baz"))
    assert multi is not None and multi is rule(d, "test-domain", ("multiWild", "foobarbaz"))
    assert multi.requests_per_unit == 10
    assert rule(d, "test-domain", ("multiWild", "foo123baz")) is None  # a middle segment missing
    assert rule(d, "test-domain", ("multiWild", "bar456baz")) is None  # the prefix missing
    # Without share_threshold each value a wildcard matches is its own bucket.
    assert keyed(d, "test-domain", ("wild", "foo1")) == [("wild", "foo1")]


NESTED = """
    domain: nested
    descriptors:
      - key: key-1
        detailed_metric: {detailed}
        rate_limit: {{unit: minute, requests_per_unit: 100}}
        descriptors:
          - key: key-2
            detailed_metric: {detailed}
            rate_limit: {{unit: minute, requests_per_unit: 5}}
"""
# TestDetailedMetric's realisticExampleConfig, written as YAML.
REALISTIC = """
    domain: nested
    descriptors:
      - key: key_1
        detailed_metric: true
        rate_limit: {unit: minute, requests_per_unit: 500}
      - key: key_1
        value: some-value-for-key-1
        rate_limit: {unit: minute, requests_per_unit: 500}
      - key: key_2
        detailed_metric: true
        rate_limit: {unit: minute, requests_per_unit: 5000}
        descriptors:
          - {key: key_3, detailed_metric: true}
          - key: key_3
            value: requested-key3-value
            detailed_metric: true
            rate_limit: {unit: minute, requests_per_unit: 5}
      - key: key_2
        value: specific-id
        detailed_metric: true
        rate_limit: {unit: minute, requests_per_unit: 50000}
        descriptors:
          - {key: key_3, detailed_metric: true}
          - key: key_3
            value: requested-key3-value
            detailed_metric: true
            rate_limit: {unit: minute, requests_per_unit: 100}
"""


@pytest.mark.parametrize(
    ("text", "entries", "count"),
    [
        (NESTED.format(detailed="true"), [("key-1", "value-1")], 100),
        (NESTED.format(detailed="false"), [("key-1", "value-1")], 100),
        (NESTED.format(detailed="true"), [("key-1", "value-1"), ("key-2", "value-2")], 5),
        (NESTED.format(detailed="false"), [("key-1", "value-1"), ("key-2", "value-2")], 5),
        (REALISTIC, [("key_1", "value-for-key-1")], 500),
        (REALISTIC, [("key_2", "key-2-value")], 5000),
        (REALISTIC, [("key_2", "key-2-value"), ("key_3", "requested-key3-value")], 5),
    ],
)
def test_detailed_metric(tmp_path, text, entries, count):  # TestDetailedMetric (its stats keys: a difference)
    assert limit(load(tmp_path, {"nested.yaml": text}), "nested", *entries) == (count, "minute")


# The configs of TestValueToMetric_*, written as YAML: route > http_method > subject_id.
VALUE_TO_METRIC = """
    domain: domain
    descriptors:
      - key: route
        value_to_metric: true
        descriptors:
          - key: http_method
            value_to_metric: true
            descriptors:
              - key: subject_id
                detailed_metric: {detailed}
                rate_limit: {{unit: minute, requests_per_unit: 60}}
"""
CONFIGURED_VALUES = """
    domain: domain
    descriptors:
      - key: route
        value_to_metric: true
        descriptors:
          - key: http_method
            value: GET
            value_to_metric: true
            descriptors: [{key: subject_id, rate_limit: {unit: minute, requests_per_unit: 60}}]
          - key: http_method
            value: POST
            value_to_metric: true
            descriptors: [{key: subject_id, rate_limit: {unit: minute, requests_per_unit: 30}}]
"""
VALUE_WILDCARD = """
    domain: domain
    descriptors:
      - key: user
        value_to_metric: true
        descriptors:
          - key: action
            value: read*
            value_to_metric: true
            descriptors: [{key: resource, rate_limit: {unit: minute, requests_per_unit: 100}}]
"""
TWO_LEVELS = """
    domain: domain
    descriptors:
      - key: k1
        value_to_metric: {first}
        descriptors: [{{key: k2, rate_limit: {{unit: second, requests_per_unit: 1}}}}]
"""
MID_LEVEL = """
    domain: domain
    descriptors:
      - key: k1
        descriptors:
          - key: k2
            value_to_metric: true
            descriptors: [{key: k3, rate_limit: {unit: second, requests_per_unit: 1}}]
"""


@pytest.mark.parametrize(
    ("text", "entries", "count"),
    [
        (VALUE_TO_METRIC.format(detailed="false"), [("route", "draw"), ("http_method", "GET"), ("subject_id", "123")], 60),
        (TWO_LEVELS.format(first="true"), [("k1", "A"), ("k2", "foo")], 1),
        (MID_LEVEL, [("k1", "X"), ("k2", "Y"), ("k3", "Z")], 1),
        (TWO_LEVELS.format(first="false"), [("k1", "X"), ("k2", "Y")], 1),
        (VALUE_TO_METRIC.format(detailed="true"), [("route", "draw"), ("http_method", "GET"), ("subject_id", "123")], 60),
        (CONFIGURED_VALUES, [("route", "api"), ("http_method", "GET"), ("subject_id", "user123")], 60),
        (CONFIGURED_VALUES, [("route", "api"), ("http_method", "POST"), ("subject_id", "user456")], 30),
        (VALUE_WILDCARD, [("user", "alice"), ("action", "readfile"), ("resource", "documents")], 100),
        (VALUE_WILDCARD, [("user", "bob"), ("action", "readdata"), ("resource", "database")], 100),
        (VALUE_TO_METRIC.format(detailed="false"), [("route", ""), ("http_method", "GET"), ("subject_id", "123")], 60),
        (VALUE_TO_METRIC.format(detailed="false"), [("route", "draw"), ("http_method", ""), ("subject_id", "123")], 60),
        (VALUE_TO_METRIC.format(detailed="false"), [("route", ""), ("http_method", ""), ("subject_id", "123")], 60),
    ],
)
def test_value_to_metric(tmp_path, text, entries, count):  # TestValueToMetric_* (their stats keys: a difference)
    assert limit(load(tmp_path, {"d.yaml": text}), "domain", *entries)[0] == count


def test_share_threshold(tmp_path):  # TestShareThreshold: ShareThresholdKeyPattern is what keys the bucket
    d = load(tmp_path, {"share_threshold.yaml": CONFIG_TEST["share_threshold.yaml"]})

    def shared(entries, count, expected):
        assert limit(d, "test-domain", *entries)[0] == count, entries
        assert keyed(d, "test-domain", *entries) == expected, entries

    for value in ("files/a.pdf", "files/b.csv", "files/c.txt"):
        shared([("files", value)], 100, [("files", "files/*")])
    shared([("route", "api/v1"), ("method", "GET")], 60, [("route", "api/*"), ("method", "GET")])
    shared([("service", "svc/user"), ("endpoint", "get")], 80, [("service", "svc/*"), ("endpoint", "get")])
    shared([("nested", "parent"), ("files", "nested/file1.txt")], 200, [("nested", "parent"), ("files", "nested/*")])
    shared([("files", "top/file1.txt"), ("files", "nested/file1.txt")], 300, [("files", "top/*"), ("files", "nested/*")])
    shared(
        [("path", "path/foo"), ("file", "file/doc1"), ("type", "pdf")], 120,
        [("path", "path/*"), ("file", "file/doc1"), ("type", "pdf")],  # file/* has share_threshold: false
    )
    shared(
        [("user", "user/alice"), ("resource", "res/file1"), ("action", "read")], 150,
        [("user", "user/*"), ("resource", "res/*"), ("action", "read")],
    )
    shared([("file", "test1")], 50, [("file", "test1")])  # an explicit value wins over the wildcard
    for value in ("test2", "test23", "test123"):
        shared([("file", value)], 100, [("file", "test*")])
    for value in ("/api/v1", "/api-beta-v1", "/apiXYZv1"):
        shared([("midpath", value)], 100, [("midpath", "/api*v1")])
    assert rule(d, "test-domain", ("midpath", "/api/v2")) is None
    for value in ("svcAepBrpc", "svcXXXepYYYrpc", "svceprpc"):
        shared([("multiroute", value)], 50, [("multiroute", "svc*ep*rpc")])
    assert rule(d, "test-domain", ("multiroute", "svcABCrpc")) is None
    for value in ("/api/v2", "/api-beta-v2"):
        shared([("midroute", value)], 80, [("midroute", "/api*v2")])
    for tenant, resource in (("t1prod", "resAv2"), ("t99prod", "resBBBv2")):
        shared([("tenant", tenant), ("resource", resource)], 60, [("tenant", "t*prod"), ("resource", "res*v2")])


@pytest.mark.parametrize(
    ("flags", "value", "expected"),
    [
        ("", "foo1", "foo1"),
        ("value_to_metric: true", "foo1", "foo1"),
        ("share_threshold: true", "foo1", "foo*"),
        ("share_threshold: true, value_to_metric: true", "foo1", "foo*"),
    ],
)
def test_wildcard_stats_behavior(tmp_path, flags, value, expected):  # TestWildcardStatsBehavior
    text = f"domain: test-domain\ndescriptors: [{{key: wild, value: 'foo*', {flags}{', ' if flags else ''}rate_limit: {{unit: minute, requests_per_unit: 20}}}}]\n"
    d = load(tmp_path, {"d.yaml": text})
    assert limit(d, "test-domain", ("wild", value)) == (20, "minute")
    assert keyed(d, "test-domain", ("wild", value)) == [("wild", expected)]


def test_wildcard_stats_behavior_nested_and_middle(tmp_path):  # TestWildcardStatsBehavior, the other sub-tests
    d = load(tmp_path, {"d.yaml": """
        domain: test-domain
        descriptors:
          - key: wild
            value: foo*
            descriptors:
              - key: other
                value_to_metric: true
                descriptors: [{key: limit, rate_limit: {unit: minute, requests_per_unit: 20}}]
          - key: mid
            value: foo*bar*
            rate_limit: {unit: minute, requests_per_unit: 20}
    """})
    assert limit(d, "test-domain", ("wild", "foo1"), ("other", "bar"), ("limit", "X")) == (20, "minute")
    assert rule(d, "test-domain", ("mid", "foo123bar456")) is rule(d, "test-domain", ("mid", "fooXbarY")) is not None


def test_metadata(tmp_path):  # TestMetadata
    d = load(tmp_path, {"metadata.yaml": CONFIG_TEST["metadata.yaml"]})
    assert rule(d, "test-domain") is None
    first = rule(d, "test-domain", ("key1", "value1"), ("subkey1", "something"))
    assert (first.requests_per_unit, first.unit, first.metadata) == (5, "second", {"name": "service_1"})
    second = rule(d, "test-domain", ("key2", "something"))
    assert (second.requests_per_unit, second.unit) == (20, "minute")
    assert second.metadata == {"service_with_quota": {"name": "service_2"}}


def test_the_example_configs_load_with_their_meaning(tmp_path):  # examples/ratelimit/config
    d = load(tmp_path, EXAMPLES)
    assert limit(d, "mongo_cps", ("database", "users")) == (500, "second")
    assert limit(d, "rl", ("foo", "x"), ("bar", "banned")) == (0, "minute")  # always over the limit
    assert rule(d, "rl", ("foo", "x"), ("bar", "banned")).name == "banned_limit"
    assert rule(d, "rl", ("foo", "x"), ("bay", "y")).limit is None  # unlimited
    assert rule(d, "rl", ("category", "account")).replaces == ("bkthomps", "fake_name")
    service = rule(d, "rl", ("service", "service_2"))
    assert (service.requests_per_unit, service.quota_mode, service.metadata) == (2, True, {"service_with_quota": {"name": "service_2"}})
    assert limit(d, "rl", ("unspec", "anything")) == (2, "minute")


def test_the_integration_configs_load_as_one_directory(tmp_path):  # test/integration/runtime/current/ratelimit/config
    d = load(tmp_path, INTEGRATION)
    assert sorted(d) == ["another", "basic", "share-threshold-test"]
    assert limit(d, "basic", ("one_per_minute", "x")) == (1, "minute")
    assert limit(d, "another", ("key4_local", "x")) == (20, "day")
    assert keyed(d, "share-threshold-test", ("files", "files/a.pdf")) == [("files", "files/*")]
    assert keyed(d, "share-threshold-test", ("files_no_share", "files_no_share/a")) == [("files_no_share", "files_no_share/a")]


# Every refusal of config_test.go (and of config_impl.go's share_threshold check): the files
# loaded, whether domains merge, and what the one line says after the file's name.
REFUSED = [
    ("empty_domain.yaml", False, "empty_domain.yaml: domain: required key is missing"),
    (("basic_config.yaml", "duplicate_domain.yaml"), False, "duplicate_domain.yaml: domain: 'test-domain' is defined in"),
    ("empty_key.yaml", False, "empty_key.yaml: descriptors[0].key: required key is missing"),
    ("duplicate_key.yaml", False, "duplicate_key.yaml: descriptors[1]: the descriptor 'key1_value1' is defined already"),
    ("bad_limit_unit.yaml", False, "bad_limit_unit.yaml: descriptors[0].rate_limit.unit: expected second, minute, hour, day, month, year, got 'foo'"),
    ("replaces_self.yaml", False, "replaces_self.yaml: descriptors[0].descriptors[0].rate_limit.replaces[0].name: 'self' is this rate limit's own name"),
    ("replaces_empty.yaml", False, "replaces_empty.yaml: descriptors[0].descriptors[0].rate_limit.replaces[0].name: names no rate limit"),
    ("bad_yaml.yaml", False, "bad_yaml.yaml: malformed YAML: "),
    ("misspelled_key.yaml", False, "misspelled_key.yaml: descriptors[0].ratelimit: unknown key"),
    ("misspelled_key2.yaml", False, "misspelled_key2.yaml: descriptors[0].rate_limit.requestsperunit: unknown key"),
    ("non_string_key.yaml", False, "non_string_key.yaml: a key must be text, got a number 0.25"),
    ("non_map_list.yaml", False, "non_map_list.yaml: descriptors[0]: expected a mapping, got a string"),
    ("unlimited_with_unit.yaml", False, "unlimited_with_unit.yaml: descriptors[0].rate_limit.unit: an unlimited rate_limit counts nothing"),
]


@pytest.mark.parametrize(("files", "merge", "expected"), REFUSED)
def test_a_config_the_reference_refuses_is_refused_in_one_line(tmp_path, files, merge, expected):
    names = (files,) if isinstance(files, str) else files
    with pytest.raises(ConfigError) as error:
        load(tmp_path / "rls", {name: CONFIG_TEST[name] for name in names}, merge=merge)
    message = str(error.value)
    assert message.startswith(str(tmp_path / "rls" / expected.split(":")[0])) and expected in message, message
    assert "\n" not in message


def test_a_descriptor_in_two_merged_files_is_refused(tmp_path):  # TestDuplicateKeyDomainMerge
    files = {"merge_domain_key1.yaml": CONFIG_TEST["merge_domain_key1.yaml"], "merge_domain_key1_again.yaml": CONFIG_TEST["merge_domain_key1.yaml"]}
    with pytest.raises(ConfigError) as error:
        load(tmp_path, files, merge=True)
    assert str(error.value) == f"{tmp_path}/merge_domain_key1_again.yaml: descriptors[0]: the descriptor 'key1_value1' is defined already at this level"


def test_share_threshold_without_a_wildcard_is_refused(tmp_path):  # config_impl.go's check
    with pytest.raises(ConfigError, match=r"s\.yaml: descriptors\[0\]\.share_threshold: needs a value with a `\*`"):
        load(tmp_path, {"s.yaml": "domain: d\ndescriptors: [{key: k, value: v, share_threshold: true}]\n"})


async def test_the_reference_integration_tests_of_share_threshold_quota_mode_and_a_zero_limit(tmp_path):
    """integration_test.go's TestShareThreshold, integration-test/scripts/quota.sh on
    example.yaml's quota-mode services, and example.yaml's `requests_per_unit: 0`, through
    gRPC against the gateway started as users start it, on a private redis-server."""
    grpc = pytest.importorskip("grpc")
    from gateway.envoy.generated import ratelimit_pb2, rls_pb2, rls_pb2_grpc

    directory = tmp_path / "config"
    directory.mkdir()
    for name, text in {**INTEGRATION, "example.yaml": EXAMPLES["example.yaml"]}.items():
        (directory / name).write_text(text)
    port = free_port()

    def ask(*descriptors: list[tuple[str, str]], domain: str = "share-threshold-test"):
        request = rls_pb2.RateLimitRequest(
            domain=domain,
            descriptors=[
                ratelimit_pb2.RateLimitDescriptor(entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key=k, value=v) for k, v in d])
                for d in descriptors
            ],
            hits_addend=1,
        )
        return stub.ShouldRateLimit(request)

    gateway = f"store: {{url: '{{url}}'}}\nrls_listen: 127.0.0.1:{port}\nrls_config: {directory}\nroutes: [{{match: {{path: /}}, upstream: 'http://127.0.0.1:9'}}]\n"
    with RedisServer(dedicated=True) as redis, GatewayProcess(gateway.replace("{url}", redis.url)):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = rls_pb2_grpc.RateLimitServiceStub(channel)
            OK, OVER_LIMIT = rls_pb2.RateLimitResponse.Code.OK, rls_pb2.RateLimitResponse.Code.OVER_LIMIT
            codes = [(await ask([("files", "files/a.pdf")])).overall_code for _ in range(10)]
            assert codes == [OK] * 10
            shared = await ask([("files", "files/b.csv")])  # shares files/a.pdf's 10 per hour
            assert shared.overall_code == OVER_LIMIT
            assert (shared.statuses[0].current_limit.requests_per_unit, shared.statuses[0].limit_remaining) == (10, 0)
            for i in range(10):  # each value its own 10 per hour
                isolated = await ask([("files_no_share", f"files_no_share/{i}")])
                assert (isolated.overall_code, isolated.statuses[0].limit_remaining) == (OK, 9)

            # quota.sh: service_1 holds 1 a minute and service_2 2, both in quota mode. The
            # request passes while either has room; the third finds both spent.
            services = ([("service", "service_1")], [("service", "service_2")])
            answers = [await ask(*services, domain="rl") for _ in range(3)]
            assert [a.overall_code for a in answers] == [OK, OK, OVER_LIMIT]
            assert [[s.code for s in a.statuses] for a in answers] == [[OK, OK], [OVER_LIMIT, OK], [OVER_LIMIT, OVER_LIMIT]]

            # requests_per_unit: 0 is over the limit for any cost, and a read (0) is not.
            banned = [("foo", "x"), ("bar", "banned")]
            assert (await ask(banned, domain="rl")).overall_code == OVER_LIMIT
            assert (await ask(banned, [("foo", "y")], domain="rl")).overall_code == OVER_LIMIT
            read = ratelimit_pb2.RateLimitDescriptor(entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key=k, value=v) for k, v in banned])
            read.hits_addend.value = 0
            answer = await stub.ShouldRateLimit(rls_pb2.RateLimitRequest(domain="rl", descriptors=[read]))
            assert (answer.overall_code, answer.statuses[0].current_limit.name) == (OK, "banned_limit")
