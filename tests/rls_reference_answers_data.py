"""envoyproxy/ratelimit's `ShouldRateLimit` vectors as test data of our own, read from
github.com/envoyproxy/ratelimit at commit f2fb157 so that the suite does not need that
repository. tests/gateway/test_rls_reference_answers.py runs them against the gateway.

Each dict is one config directory for the gateway's `rls_config`. The reference's own files
come from tests.rls_reference_examples (byte for byte) or, marked "verbatim", are here; the
others are our rendering, as config files, of the limits a Go test builds in code
(`config.NewRateLimit(...)`), named after that test. A rule with the
gateway's own key `charge: always` stands where the reference reaches a count above the
limit, which only a service that charges every hit can reach.
"""

from __future__ import annotations

from tests.rls_reference_examples import EXAMPLES
from tests.rls_reference_examples import INTEGRATION as REFERENCE_INTEGRATION

# test/integration/runtime/current/ratelimit/config/{basic,another}.yaml: the directory
# test/integration/integration_test.go (testBasicBaseConfig) serves.
INTEGRATION = {name: REFERENCE_INTEGRATION[name] for name in ("basic.yaml", "another.yaml")}

# The same `another` domain counted in fixed windows (the gateway's `algorithm:
# fixed_window`), the mode the reference's duration_until_reset vector assumes.
INTEGRATION_FIXED_WINDOW = {
    "another.yaml": """\
domain: another
descriptors:
  - key: key3
    rate_limit: {unit: hour, requests_per_unit: 10, algorithm: fixed_window}
  - key: key4
    rate_limit: {unit: day, requests_per_unit: 20, algorithm: fixed_window}
""",
}

# test/integration/runtime/current/ratelimit/reload.yaml, verbatim: the file
# testConfigReload copies into the config directory.
RELOAD = """\
domain: reload
descriptors:
  - key: key1
    rate_limit:
      unit: second
      requests_per_unit: 50

  - key: block
    rate_limit:
      unit: second
      requests_per_unit: 0

  - key: one_per_minute
    rate_limit:
      unit: minute
      requests_per_unit: 1
"""

# test/redis/fixed_cache_impl_test.go: the limits each test builds, one domain per test.
REDIS = {
    "redis.yaml": """\
# TestRedis: key3 and key3/subkey3 are found above their limits (11 of 10, 12 of 10).
domain: domain
descriptors:
  - {key: key, value: value, rate_limit: {unit: second, requests_per_unit: 10}}
  - key: key2
    value: value2
    descriptors:
      - {key: subkey2, value: subvalue2, rate_limit: {unit: minute, requests_per_unit: 10}}
  - key: key3
    value: value3
    rate_limit: {unit: hour, requests_per_unit: 10, charge: always}
    descriptors:
      - {key: subkey3, value: subvalue3, rate_limit: {unit: day, requests_per_unit: 10, charge: always}}
""",
    "near_limit.yaml": """\
# TestNearLimit
domain: near_limit
descriptors:
  - {key: key4, value: value4, rate_limit: {unit: hour, requests_per_unit: 15}}
  - {key: key5, value: value5, rate_limit: {unit: second, requests_per_unit: 20}}
  - {key: key6, value: value6, rate_limit: {unit: second, requests_per_unit: 8}}
  - {key: key7, value: value7, rate_limit: {unit: second, requests_per_unit: 20}}
  - {key: key8, value: value8, rate_limit: {unit: second, requests_per_unit: 20}}
  - {key: key9, value: value9, rate_limit: {unit: second, requests_per_unit: 20}}
  - {key: key10, value: value10, rate_limit: {unit: second, requests_per_unit: 10}}
""",
    "local_cache.yaml": """\
# TestOverLimitWithLocalCache
domain: local_cache
descriptors:
  - {key: key4, value: value4, rate_limit: {unit: hour, requests_per_unit: 15}}
""",
    "shadow_rule.yaml": """\
# TestOverLimitWithLocalCacheShadowRule
domain: shadow_rule
descriptors:
  - {key: key4, value: value4, shadow_mode: true, rate_limit: {unit: hour, requests_per_unit: 15}}
""",
    "stop_increment.yaml": """\
# TestOverLimitWithStopCacheKeyIncrementWhenOverlimitConfig
domain: stop_increment
descriptors:
  - {key: key4, value: value4, rate_limit: {unit: hour, requests_per_unit: 15}}
  - {key: key5, value: value5, rate_limit: {unit: hour, requests_per_unit: 14}}
""",
}

# test/service/ratelimit_test.go: the limits each test's mocked config returns.
SERVICE = {
    "service.yaml": """\
# TestService: foo/bar has a limit named key_name, hello/world none.
domain: different-domain
descriptors:
  - {key: foo, value: bar, rate_limit: {unit: minute, requests_per_unit: 10, name: key_name}}
""",
    "unlimited.yaml": """\
# TestUnlimited
domain: some-domain
descriptors:
  - {key: foo, value: bar, rate_limit: {unit: minute, requests_per_unit: 10}}
  - {key: baz, value: qux, rate_limit: {unlimited: true}}
""",
    "rule_shadow.yaml": """\
# TestRuleShadowMode: both shadow; TestMixedRuleShadowMode: only foo/bar.
domain: rule-shadow
descriptors:
  - {key: foo, value: bar, shadow_mode: true, rate_limit: {unit: minute, requests_per_unit: 10}}
  - {key: hello, value: world, shadow_mode: true, rate_limit: {unit: minute, requests_per_unit: 10}}
""",
    "mixed_shadow.yaml": """\
domain: mixed-shadow
descriptors:
  - {key: foo, value: bar, shadow_mode: true, rate_limit: {unit: minute, requests_per_unit: 10}}
  - {key: hello, value: world, rate_limit: {unit: minute, requests_per_unit: 10}}
""",
    "token_quota.yaml": """\
# integration-test/scripts/token-quota.sh: examples/ratelimit/config/example.yaml's
# service_2 (2 per minute), with the gateway's `charge: always`; `fast` is the same at 2
# per second, so a test sees the debt repaid; `llm` the same per value.
domain: tokenquota
descriptors:
  - {key: service, value: service_2, rate_limit: {unit: minute, requests_per_unit: 2, charge: always}}
  - {key: service, value: fast, rate_limit: {unit: second, requests_per_unit: 2, charge: always}}
  - {key: llm, rate_limit: {unit: minute, requests_per_unit: 2, charge: always}}
""",
}

# examples/ratelimit/config/example.yaml: the config the reference's
# integration-test/scripts/*.sh run against, behind examples/envoy/proxy.yaml.
EXAMPLE = EXAMPLES["example.yaml"]

# test/service/ratelimit_test.go's quota-mode tests (TestServicePerDescriptorQuotaMode and
# the five after it): a regular and a quota-mode limit, and two quota-mode limits.
QUOTA_MODE = """\
domain: quota-domain
descriptors:
  - {key: regular, value: limit, rate_limit: {unit: minute, requests_per_unit: 5}}
  - {key: quota, value: limit, quota_mode: true, rate_limit: {unit: minute, requests_per_unit: 3}}
  - {key: quota1, value: limit, quota_mode: true, rate_limit: {unit: minute, requests_per_unit: 5}}
  - {key: quota2, value: limit, quota_mode: true, rate_limit: {unit: minute, requests_per_unit: 3}}
"""

# test/integration/runtime/current/ratelimit/config/share_threshold.yaml: what
# TestShareThreshold serves.
SHARE_THRESHOLD = REFERENCE_INTEGRATION["share_threshold.yaml"]
