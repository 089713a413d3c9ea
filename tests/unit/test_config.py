"""The YAML config: parsed once into immutable typed objects, or rejected with one line
that names the file, the YAML path and what was expected."""

import dataclasses
from pathlib import Path

import pytest

from gateway.config import ConfigError, GatewayConfig, load_config, parse_config
from gateway.config.model import FailurePolicy, IdentitySource, PathForm, ValueMatch
from gateway.config.regex import Regex
from gateway.config.store_url import parse_store_url as parse_cluster_url
from gateway.config.store_url import parse_store_url as parse_sentinel_url
from tests.examples import ALIAS_BOMBS, ISSUE_EXAMPLE
from tests.helpers import SOURCE, error_of

REPO = Path(__file__).resolve().parents[2]


ROUTE = "routes:\n  - match: {path: /}\n    upstream: http://127.0.0.1:9000\n"
ONE_LIMIT = "limits:\n  a: {rate: 10/second, burst: 3}\n"


def parse(text: str, environ: dict[str, str] | None = None) -> GatewayConfig:
    return parse_config(text, source=SOURCE, environ=environ or {})


# --- the reference example ---------------------------------------------------------


def test_issue_example_parses_into_the_expected_limits():
    config = parse(ISSUE_EXAMPLE)
    per_client, reports = config.limits
    assert per_client.name == "per_client"
    assert (per_client.rate.tokens, per_client.rate.period_seconds) == (100, 60)
    assert per_client.burst == 20
    assert per_client.key == (IdentitySource(kind="header", name="x-api-key"), IdentitySource(kind="ip"))
    assert per_client.on_store_error is FailurePolicy.OPEN
    assert reports.name == "reports"
    assert (reports.rate.tokens, reports.rate.period_seconds) == (1, 1)
    assert reports.burst == 5
    assert reports.key == (IdentitySource(kind="header", name="x-api-key"),)
    assert reports.on_store_error is FailurePolicy.CLOSED


def test_issue_example_parses_into_the_expected_routes_and_costs():
    config = parse(ISSUE_EXAMPLE)
    per_client, reports = config.limits
    first, second = config.routes
    assert first.match.path == "/api/reports"
    assert first.match.methods == frozenset({"POST"})
    assert first.match.host is None
    assert first.upstream == "http://127.0.0.1:9000"
    assert [(rl.limit, rl.cost) for rl in first.limits] == [(per_client, 1), (reports, 2)]
    assert second.match.path == "/"
    assert second.match.methods is None
    assert [(rl.limit, rl.cost) for rl in second.limits] == [(per_client, 1)]
    assert not first.strip_prefix and not second.strip_prefix


def test_issue_example_parses_listeners_store_and_trusted_proxies():
    config = parse(ISSUE_EXAMPLE)
    assert (config.listen.host, config.listen.port) == ("0.0.0.0", 8080)
    assert (config.admin_listen.host, config.admin_listen.port) == ("127.0.0.1", 9090)
    assert config.workers == 1
    assert config.store is not None
    assert config.store.url == "redis://127.0.0.1:6379/0"
    assert config.store.timeout == pytest.approx(0.010)
    assert config.store.prefix == "rl:"
    assert [str(n) for n in config.trusted_proxies] == ["10.0.0.0/8"]
    assert config.source == SOURCE


def test_parsed_config_is_immutable():
    config = parse(ISSUE_EXAMPLE)
    for obj, field in [
        (config, "workers"),
        (config.store, "url"),
        (config.limits[0], "burst"),
        (config.routes[0], "upstream"),
        (config.routes[0].match, "path"),
        (config.routes[0].limits[0], "cost"),
    ]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, field, None)
    assert isinstance(config.limits, tuple) and isinstance(config.routes, tuple)
    assert isinstance(config.routes[0].match.methods, frozenset)


def test_the_reference_configs_first_limits_and_route_are_the_issue_example(monkeypatch):
    monkeypatch.chdir(REPO)  # its files are named relative to the clone's root
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", "0123456789abcdef0123")
    config = load_config("config/gateway.yaml")
    example = parse(ISSUE_EXAMPLE)
    # The reference adds an allowlist to the first, and a shadow mode and a response to the second.
    assert config.limits[0] == dataclasses.replace(example.limits[0], allow=config.limits[0].allow)
    reports = dataclasses.replace(config.limits[1], shadow=False, response=example.limits[1].response)
    assert reports == example.limits[1]
    route, first = config.routes[0], example.routes[0]
    assert (route.match, route.upstream, route.timeout) == (first.match, first.upstream, first.timeout)
    assert [(rl.limit.name, rl.cost) for rl in route.limits] == [(rl.limit.name, rl.cost) for rl in first.limits]
    assert config.store is not None and config.store.local_divisor == 4


def test_shipped_demo_yaml_parses():
    config = load_config(str(REPO / "gateway" / "demo_config.yaml"))
    assert config.store is None
    assert [(limit.name, limit.rate.text, limit.burst) for limit in config.limits] == [("per_client", "10/minute", 5)]


# --- defaults and optional keys ----------------------------------------------------


def test_defaults_when_only_routes_are_given():
    config = parse(ROUTE)
    assert str(config.listen) == "0.0.0.0:8080"
    assert str(config.admin_listen) == "127.0.0.1:9090"
    assert config.workers == 1
    assert config.max_in_flight == 1024
    assert config.store is None
    assert config.limits == ()
    assert config.routes[0].limits == ()
    assert config.shutdown_grace == 20
    assert (config.routes[0].timeout.connect, config.routes[0].timeout.read) == (5, 60)


def test_burst_defaults_to_the_rate_count_and_key_to_ip():
    config = parse("limits:\n  a: {rate: 7/minute}\n" + ROUTE)
    (limit,) = config.limits
    assert limit.burst == 7
    assert limit.key == (IdentitySource(kind="ip"),)
    assert limit.on_store_error is FailurePolicy.OPEN


def test_fractional_rate_needs_an_explicit_burst():
    assert "limits.a.burst" in error_of("limits:\n  a: {rate: 0.5/second}\n" + ROUTE)
    (limit,) = parse("limits:\n  a: {rate: 0.5/second, burst: 2}\n" + ROUTE).limits
    assert limit.burst == 2 and limit.rate.per_second == 0.5


def test_every_identity_source_kind_is_read():
    config = parse("limits:\n  a: {rate: 1/second, key: [header:X-Key, query:api_key, cookie:session, ip]}\n" + ROUTE)
    assert [str(k) for k in config.limits[0].key] == ["header:x-key", "query:api_key", "cookie:session", "ip"]


def test_a_single_key_may_be_written_as_a_string():
    config = parse("limits:\n  a: {rate: 1/second, key: header:X-Key}\n" + ROUTE)
    assert config.limits[0].key == (IdentitySource(kind="header", name="x-key"),)


def test_match_host_methods_strip_prefix_and_timeouts():
    config = parse(
        ONE_LIMIT
        + "routes:\n"
        "  - match: {path: /v1/, methods: [get, Post], host: API.Example.com}\n"
        "    upstream: https://backend.internal:8443/\n"
        "    strip_prefix: true\n"
        "    preserve_host: true\n"
        "    timeout: {connect: 250ms, read: 2m}\n"
        "    limits: [{name: a}]\n"
    )
    (route,) = config.routes
    assert route.match.path == "/v1"
    assert route.match.methods == frozenset({"GET", "POST"})
    assert route.match.host == "api.example.com"
    assert parse(ONE_LIMIT + "routes:\n  - match: {path: /, host: api.example.com.}\n    upstream: http://h:1\n").routes[0].match.host == "api.example.com"
    assert route.upstream == "https://backend.internal:8443"
    assert route.strip_prefix and route.preserve_host
    assert (route.timeout.connect, route.timeout.read) == (0.25, 120)
    assert route.limits[0].cost == 1


def test_match_forms_and_conditions_are_read():
    config = parse(
        """
routes:
  - match: {exact: /api/health/, host: '*.Example.com.'}
    upstream: http://h:1
  - match:
      regex: '/api/v[0-9]+/.*'
      case_sensitive: false
      headers: {X-Version: "2", X-Beta: {present: true}, X-Legacy: {present: false}, X-Tier: {regex: 'gold|silver'}}
      query: {debug: {exact: "1"}}
    upstream: http://h:1
"""
    )
    exact, regex = (route.match for route in config.routes)
    assert (exact.form, exact.path, exact.host) == (PathForm.EXACT, "/api/health/", "*.example.com")  # exact keeps its slash
    assert (regex.form, regex.path, regex.regex) == (PathForm.REGEX, "/api/v[0-9]+/.*", Regex.compile("/api/v[0-9]+/.*", case_sensitive=False))
    assert regex.headers == (
        ValueMatch(name="x-version", exact="2"),
        ValueMatch(name="x-beta"),
        ValueMatch(name="x-legacy", present=False),
        ValueMatch(name="x-tier", regex=Regex.compile("gold|silver")),
    )
    assert regex.query == (ValueMatch(name="debug", exact="1"),)
    assert [route.label for route in config.routes] == [
        "*.example.com=/api/health/",
        "~/api/v[0-9]+/.* header:x-version=2 header:x-beta header:!x-legacy header:x-tier~gold|silver query:debug=1",
    ]


def test_a_cluster_url_names_seed_nodes():
    config = parse("store: {url: 'redis+cluster://gw:p%40ss@n1:7000,[::1],n3:7002'}\n" + ROUTE)
    seeds = parse_cluster_url(config.store.url)
    assert seeds.nodes == (("n1", 7000), ("::1", 6379), ("n3", 7002))
    assert (seeds.username, seeds.password) == ("gw", "p@ss")


def test_a_sentinel_url_names_the_sentinels_and_the_master():
    config = parse("store: {url: 'redis+sentinel://gw:p%40ss@s1:26380,[::1],s3:1/mymaster?db=2'}\n" + ROUTE)
    assert config.store is not None
    service = parse_sentinel_url(config.store.url)
    assert service.sentinels == (("s1", 26380), ("::1", 26379), ("s3", 1))
    assert (service.service, service.username, service.password, service.db) == ("mymaster", "gw", "p@ss", 2)


def test_store_options_are_read():
    config = parse(
        "store:\n  url: rediss://user:pw@redis.internal:6380/3\n  timeout: 25ms\n  prefix: 'gw:'\n"
        "  local_divisor: 4\n  max_pending: 8\n  key_secret: s3cret\nworkers: 3\n" + ROUTE
    )
    store = config.store
    assert store is not None
    assert (store.url, store.timeout, store.prefix) == ("rediss://user:pw@redis.internal:6380/3", 0.025, "gw:")
    assert (store.local_divisor, store.max_pending, store.key_secret) == (4, 8, "s3cret")
    assert config.workers == 3


def test_unix_socket_store_url_may_choose_a_db():
    config = parse("store: {url: 'unix:///run/redis.sock?db=2'}\n" + ROUTE)
    assert config.store is not None and config.store.url == "unix:///run/redis.sock?db=2"


def test_shutdown_grace_and_zero_cost_are_accepted():
    config = parse("shutdown_grace: 1500ms\n" + ONE_LIMIT + ROUTE + "    limits: [{name: a, cost: 0}]\n")
    assert config.shutdown_grace == 1.5
    assert config.routes[0].limits[0].cost == 0


def test_max_in_flight_is_read_and_may_come_from_the_environment():
    assert parse("max_in_flight: 1\n" + ROUTE).max_in_flight == 1
    config = parse("max_in_flight: ${GATEWAY_MAX_IN_FLIGHT:-256}\n" + ROUTE, {"GATEWAY_MAX_IN_FLIGHT": "4096"})
    assert config.max_in_flight == 4096 and type(config.max_in_flight) is int


def test_yaml_merge_keys_still_work():
    config = parse(
        "limits:\n  base: &base {rate: 1/second, burst: 5, key: [ip]}\n  other: {<<: *base, burst: 3}\n" + ROUTE
    )
    base, other = config.limits
    assert (base.burst, other.burst) == (5, 3)
    assert other.rate == base.rate and other.key == base.key


# --- interpolation -----------------------------------------------------------------


def test_interpolation_reads_the_environment_in_any_value():
    config = parse(
        "listen: ${HOST}:${PORT}\nstore: {url: '${REDIS_URL}', prefix: '${PREFIX:-gw}:'}\n" + ROUTE,
        {"HOST": "127.0.0.1", "PORT": "8181", "REDIS_URL": "redis://r.internal:6379/1"},
    )
    assert str(config.listen) == "127.0.0.1:8181"
    assert config.store is not None
    assert config.store.url == "redis://r.internal:6379/1"
    assert config.store.prefix == "gw:"


def test_interpolation_inside_lists_and_nested_values():
    config = parse(
        "limits:\n  a: {rate: '${RATE:-5/second}', key: ['header:${KEY_HEADER}']}\n"
        "routes:\n  - match: {path: /}\n    upstream: http://${UPSTREAM_HOST}:9000\n    limits: [a]\n",
        {"KEY_HEADER": "X-Tenant", "UPSTREAM_HOST": "backend"},
    )
    assert config.limits[0].rate.text == "5/second"
    assert str(config.limits[0].key[0]) == "header:x-tenant"
    assert config.routes[0].upstream == "http://backend:9000"


def test_environment_wins_over_the_default():
    config = parse("workers: ${W:-2}\nstore: {url: 'redis://h/0'}\n" + ROUTE, {"W": "4"})
    assert config.workers == 4


def test_whole_value_interpolation_takes_the_yaml_type():
    config = parse(
        "workers: ${W:-2}\nstore:\n  url: redis://h/0\n  max_pending: ${MAXC}\n"
        "routes:\n  - match: {path: /}\n    upstream: http://h:1\n    strip_prefix: ${STRIP:-true}\n",
        {"MAXC": "16"},
    )
    assert config.workers == 2 and type(config.workers) is int
    assert config.store is not None and config.store.max_pending == 16
    assert config.routes[0].strip_prefix is True


def test_quoted_whole_value_interpolation_in_flow_style_takes_the_yaml_type():
    # Unquoted, `${M}` inside `{...}` would be YAML syntax; quoted, it is still converted.
    config = parse("store: {url: 'redis://h/0', max_pending: '${M}'}\n" + ROUTE, {"M": "4"})
    assert config.store is not None and config.store.max_pending == 4


def test_partial_interpolation_stays_a_string():
    # "${W}0" is text, not the integer 20: workers must be an integer.
    message = error_of("workers: ${W}0\n" + ROUTE, {"W": "2"})
    assert "workers: expected an integer, got a string" in message


def test_empty_default_and_dollar_escape():
    config = parse("store: {url: 'redis://h/0', prefix: '${P:-}', key_secret: 'a$$b'}\n" + ROUTE)
    assert config.store is not None
    assert config.store.prefix == ""
    assert config.store.key_secret == "a$b"


def test_missing_environment_variable_without_default_names_variable_and_path():
    message = error_of("store:\n  url: ${REDIS_URL}\n" + ROUTE)
    assert message.startswith(f"{SOURCE}: store.url: ")
    assert "REDIS_URL is not set" in message


def test_missing_environment_variable_inside_a_list_names_the_index():
    message = error_of(
        "limits:\n  a: {rate: 1/second}\nroutes:\n  - match: {path: /}\n    upstream: http://h:1\n"
        "  - match: {path: /x}\n    upstream: http://h:1\n    limits: [a, '${EXTRA}']\n"
    )
    assert message.startswith(f"{SOURCE}: routes[1].limits[1]: ")
    assert "EXTRA" in message


def test_shaping_quotas_and_long_rates_are_read():
    config = parse(
        "max_delayed: 32\n"
        "limits:\n"
        "  shaped: {rate: 10/second, burst: 1, mode: delay, max_delay: 500ms}\n"
        "  monthly: {quota: {limit: 10000, per: month, reset: '06:30 UTC'}}\n"
        "  yearly: {rate: 1000/year}\n" + ROUTE
    )
    shaped, monthly, yearly = config.limits
    assert (shaped.max_delay, shaped.quota) == (0.5, None)
    assert monthly.quota is not None and (monthly.quota.limit, monthly.quota.per, monthly.quota.reset) == (
        10000, "month", 6.5 * 3600)
    assert (monthly.burst, monthly.rate.period_seconds, monthly.max_delay) == (10000, 30 * 86400, 0.0)
    assert yearly.rate.period_seconds == 365 * 86400 and yearly.burst == 1000
    assert config.max_delayed == 32
    assert parse(ROUTE).max_delayed == 256
    assert parse("limits:\n  d: {quota: {limit: 5, per: day}}\n" + ROUTE).limits[0].quota.reset == 0


# --- errors: one line naming the file, the YAML path and what was expected ---------

ERROR_CASES = {
    "malformed YAML": ("routes: [\n", "malformed YAML: line 2"),
    "malformed YAML, tab indentation": ("routes:\n\t- a\n", "malformed YAML: line 2, column 1"),
    "duplicate key": ("limits:\n  a: {rate: 1/second}\n  a: {rate: 5/second}\n" + ROUTE, "duplicate key 'a'"),
    "deeply nested YAML": ("routes: " + "[" * 3000 + "]" * 3000, "nested too deeply"),
    "empty file": ("", "the file is empty"),
    "comments only": ("# nothing here\n", "the file is empty"),
    "not a mapping": ("- routes\n", "expected a mapping, got a list"),
    "unknown top-level key": ("listne: 0.0.0.0:80\n" + ROUTE, "listne: unknown key"),
    "unknown nested key": ("store: {url: 'redis://h/0', timout: 5ms}\n" + ROUTE, "store.timout: unknown key"),
    "unknown key in a limit": ("limits:\n  a: {rate: 1/second, brust: 2}\n" + ROUTE, "limits.a.brust: unknown key"),
    "unknown key in a match": (
        "routes:\n  - match: {path: /, method: [GET]}\n    upstream: http://h:1\n", "routes[0].match.method: unknown key"),
    "unknown key in a route timeout": (
        "routes:\n  - match: {path: /}\n    upstream: http://h:1\n    timeout: {idle: 1s}\n",
        "routes[0].timeout.idle: unknown key"),
    "missing routes": ("listen: 0.0.0.0:80\n", "routes: required key is missing"),
    "no routes": ("routes: []\n", "routes: expected at least one route"),
    "missing upstream": ("routes:\n  - match: {path: /}\n", "routes[0].upstream: required key is missing"),
    "workers wrong type": ("workers: two\n" + ROUTE, "workers: expected an integer, got a string"),
    "workers is a boolean": ("workers: true\n" + ROUTE, "workers: expected an integer, got a boolean"),
    "workers zero": ("workers: 0\n" + ROUTE, "workers: expected an integer >= 1, got 0"),
    "max_in_flight zero": ("max_in_flight: 0\n" + ROUTE, "max_in_flight: expected an integer >= 1, got 0"),
    "max_in_flight negative": ("max_in_flight: -5\n" + ROUTE, "max_in_flight: expected an integer >= 1, got -5"),
    "max_in_flight a fraction": ("max_in_flight: 1.5\n" + ROUTE, "max_in_flight: expected an integer, got a number"),
    "max_in_flight a word": ("max_in_flight: lots\n" + ROUTE, "max_in_flight: expected an integer, got a string"),
    "max_in_flight a boolean": ("max_in_flight: true\n" + ROUTE, "max_in_flight: expected an integer, got a boolean"),
    "max_in_flight null": ("max_in_flight:\n" + ROUTE, "max_in_flight: expected an integer, got nothing (null)"),
    "burst past exact counting": (
        "limits:\n  a: {rate: 1/second, burst: 100000000000000000000}\n" + ROUTE,
        "limits.a.burst: expected an integer <= 1,000,000,000,000,000, got 100,000,000,000,000,000,000"),
    "implied burst past exact counting": (
        "limits:\n  a: {rate: 100000000000000000000/second}\n" + ROUTE, "limits.a.rate: a burst of 1e+20 is more than the"),
    "quota past exact counting": (
        "limits:\n  a: {quota: {limit: 10000000000000000, per: day}}\n" + ROUTE, "limits.a.quota.limit: expected an integer <="),
    "a 400-digit duration": ("shutdown_grace: 1" + "0" * 400 + "s\n" + ROUTE, "shutdown_grace: expected a duration from"),
    "a lease_ttl that reads as inf": (
        "store: {url: 'redis://h/0'}\nlimits:\n  c: {concurrency: 2, lease_ttl: 1" + "0" * 400 + "s}\n" + ROUTE,
        "limits.c.lease_ttl: expected a duration from 0.001ms to 365d"),
    "a rate whose period reads as inf": (
        "limits:\n  a: {rate: 1/" + "9" * 400 + "s, burst: 1}\n" + ROUTE, "limits.a.rate: expected a rate whose period is"),
    "a denormal rate": (
        "limits:\n  a: {rate: 0." + "0" * 315 + "1/second, burst: 1}\n" + ROUTE, "limits.a.rate: expected a rate of at least 1/year"),
    "a rate count that reads as inf": (
        "limits:\n  a: {rate: 1" + "0" * 400 + "/second}\n" + ROUTE, "limits.a.rate: expected a rate with a count of at most"),
    "an integer past any range": (
        "upstream_connections: 1" + "0" * 400 + "\n" + ROUTE,
        "upstream_connections: expected an integer <= 1,000,000,000,000,000, got a number past 10**40"),
    "an integer Python will not read": ("max_in_flight: " + "9" * 5000 + "\n" + ROUTE, "line 1, column 16: an integer with more digits"),
    "an integer past any range from the environment": (
        "max_delayed: ${BIG}\n" + ROUTE, "max_delayed: expected an integer <= 1,000,000,000,000,000, got 10,000,000,000,000,000"),
    "workers past any machine": ("workers: 5000\nstore: {url: 'redis://h/0'}\n" + ROUTE, "workers: expected an integer <= 1,024"),
    "a size past a tebibyte": (
        "routes:\n  - match: {path: /}\n    upstream: http://h:1\n    max_body_size: 2048GiB\n",
        "routes[0].max_body_size: expected a size of at most 1024GiB"),
    "burst wrong type": ("limits:\n  a: {rate: 1/second, burst: lots}\n" + ROUTE, "limits.a.burst: expected an integer"),
    "routes wrong type": ("routes: {path: /}\n", "routes: expected a list, got a mapping"),
    "limits wrong type": ("limits: [a]\n" + ROUTE, "limits: expected a mapping, got a list"),
    "strip_prefix wrong type": (
        "routes:\n  - match: {path: /}\n    upstream: http://h:1\n    strip_prefix: yes please\n",
        "routes[0].strip_prefix: expected true or false"),
    "bad rate": ("limits:\n  a: {rate: 100/fortnight}\n" + ROUTE, "limits.a.rate: expected a rate such as 100/minute"),
    "rate as a number": ("limits:\n  a: {rate: 100}\n" + ROUTE, "limits.a.rate: expected a rate"),
    "cluster url with a bad port": (
        "store: {url: 'redis+cluster://h1:x,h2'}\n" + ROUTE, "store.url: expected seed nodes as in"),
    "cluster url with a database": (
        "store: {url: 'redis+cluster://h1:7000/2'}\n" + ROUTE, "store.url: a Redis Cluster has only database 0"),
    "cluster url with an option": (
        "store: {url: 'redis+cluster://h1:7000?db=1'}\n" + ROUTE, "store.url: URL option 'db' is not supported"),
    "sentinel url with a bad port": (
        "store: {url: 'redis+sentinel://h1:x,h2/mymaster'}\n" + ROUTE, "store.url: expected sentinels as in"),
    "sentinel url without a master name": (
        "store: {url: 'redis+sentinel://h1:26379'}\n" + ROUTE, "store.url: expected the monitored master's name"),
    "store max_connections, replaced by pipelining": (
        "store: {url: 'redis://h/0', max_connections: 8}\n" + ROUTE, "store.max_connections: no longer used"),
    "store max_pending zero": ("store: {url: 'redis://h/0', max_pending: 0}\n" + ROUTE, "store.max_pending: expected"),
    "bad store timeout": ("store: {url: 'redis://h/0', timeout: 10}\n" + ROUTE, "store.timeout: expected a duration"),
    "bad route timeout": (
        "routes:\n  - match: {path: /}\n    upstream: http://h:1\n    timeout: {read: soon}\n",
        "routes[0].timeout.read: expected a duration"),
    "zero shutdown grace": ("shutdown_grace: 0s\n" + ROUTE, "shutdown_grace: expected a duration greater than zero"),
    "bad listen address": ("listen: 8080\n" + ROUTE, "listen: expected HOST:PORT"),
    "bad admin port": ("admin_listen: 127.0.0.1:70000\n" + ROUTE, "admin_listen: port must be 0..65535"),
    "upstream without scheme": (
        "routes:\n  - match: {path: /}\n    upstream: 127.0.0.1:9000\n", "routes[0].upstream: expected an http:// or https:// URL"),
    "upstream with unsupported scheme": (
        "routes:\n  - match: {path: /}\n    upstream: ftp://h/\n", "routes[0].upstream: expected an http:// or https:// URL"),
    "upstream with query": (
        "routes:\n  - match: {path: /}\n    upstream: http://h/?a=1\n", "routes[0].upstream: expected an http"),
    "upstream with bad port": (
        "routes:\n  - match: {path: /}\n    upstream: http://h:99999\n", "routes[0].upstream: bad port"),
    "store url unsupported scheme": ("store: {url: 'memcached://h:11211'}\n" + ROUTE, "store.url: expected a URL with scheme redis://"),
    "store url without host": ("store: {url: 'redis:///0'}\n" + ROUTE, "store.url: expected a host"),
    "store url bad port": ("store: {url: 'redis://h:notaport/0'}\n" + ROUTE, "store.url: bad port"),
    "store url bad db": ("store: {url: 'redis://h:6379/zero'}\n" + ROUTE, "store.url: expected a database number"),
    "store url unsupported query option": (
        "store: {url: 'redis://h:6379/0?socket_timeout=5'}\n" + ROUTE,
        "store.url: URL option 'socket_timeout' is not supported"),
    "unix store url with unsupported option": (
        "store: {url: 'unix:///run/r.sock?password=x'}\n" + ROUTE, "store.url: URL option 'password' is not supported"),
    "store prefix with hash tag": ("store: {url: 'redis://h/0', prefix: '{rl}'}\n" + ROUTE, "store.prefix: must not contain"),
    "undefined limit by name": (
        ONE_LIMIT + "routes:\n  - match: {path: /}\n    upstream: http://h:1\n"
        "  - match: {path: /x}\n    upstream: http://h:1\n    limits: [{name: nope}]\n",
        "routes[1].limits[0].name: no limit named 'nope' is defined under `limits` (defined: a)"),
    "undefined limit as a string": (
        ROUTE + "    limits: [missing]\n", "routes[0].limits[0]: no limit named 'missing' is defined under `limits` (defined: none)"),
    "limit listed twice": (ONE_LIMIT + ROUTE + "    limits: [a, a]\n", "routes[0].limits: a limit may appear only once"),
    "route limit of the wrong type": (ONE_LIMIT + ROUTE + "    limits: [7]\n", "routes[0].limits[0]: expected a limit name or"),
    "cost greater than burst": (
        ONE_LIMIT + ROUTE + "    limits: [{name: a, cost: 4}]\n",
        "routes[0].limits[0].cost: cost 4 is greater than the burst 3 of limit 'a'"),
    "negative cost": (ONE_LIMIT + ROUTE + "    limits: [{name: a, cost: -1}]\n", "routes[0].limits[0].cost: expected an integer >= 0"),
    "workers > 1 with the in-process store": ("workers: 2\n" + ROUTE, f"{SOURCE}: workers: 2 needs a shared `store:`; with the in-process store"),
    "workers > 1 on port 0": (
        "workers: 2\nlisten: 127.0.0.1:0\nstore: {url: 'redis://h/0'}\n" + ROUTE, "listen: port 0 needs workers: 1"),
    "bad identity source": ("limits:\n  a: {rate: 1/second, key: [header]}\n" + ROUTE, "limits.a.key[0]: expected ip, ip/PREFIX, ip/PREFIX4,PREFIX6, header:NAME"),
    "unknown identity kind": ("limits:\n  a: {rate: 1/second, key: [body:id]}\n" + ROUTE, "limits.a.key[0]: expected ip"),
    "bad header name": ("limits:\n  a: {rate: 1/second, key: ['header:X Key']}\n" + ROUTE, "limits.a.key[0]: 'X Key' is not a valid header name"),
    "bad failure policy": (
        "limits:\n  a: {rate: 1/second, on_store_error: retry}\n" + ROUTE, "limits.a.on_store_error: expected open, closed or local"),
    "bad limit name": ("limits:\n  'a b': {rate: 1/second}\n" + ROUTE, "limits.a b: limit names may use"),
    "path without slash": ("routes:\n  - match: {path: api}\n    upstream: http://h:1\n", "routes[0].match.path: expected a path starting with /"),
    # What nginx, Traefik, Express, Kong and OpenAPI users write, which a literal prefix would match only as written.
    "a glob in a prefix": ("routes:\n  - match: {path: '/static/*'}\n    upstream: http://h:1\n",
                           "routes[0].match.path: a path is a prefix on whole segments and * is no wildcard: "
                           "`path: /static` already matches /static and everything under it; for a pattern write match.regex"),
    "a double-star glob": ("routes:\n  - match: {path: '/assets/**/x'}\n    upstream: http://h:1\n",
                           "routes[0].match.path: a path is a prefix on whole segments and * is no wildcard: `path: /assets`"),
    "a glob in an exact path": ("routes:\n  - match: {exact: '/*'}\n    upstream: http://h:1\n",
                                "routes[0].match.exact: a path is a prefix on whole segments and * is no wildcard: `path: /`"),
    "an Express parameter": ("routes:\n  - match: {path: '/users/:id'}\n    upstream: http://h:1\n",
                             "routes[0].match.path: a segment such as :id or {id} is a parameter"),
    "an OpenAPI parameter": ("routes:\n  - match: {path: '/users/{id}/orders'}\n    upstream: http://h:1\n",
                             "routes[0].match.path: a segment such as :id or {id} is a parameter"),
    "nginx's regex location": ("routes:\n  - match: {path: '~ ^/api'}\n    upstream: http://h:1\n",
                               "routes[0].match.path: a path is a literal prefix; nginx's `~` and a leading `^` are regex syntax"),
    "a regex anchor": ("routes:\n  - match: {path: '^/api'}\n    upstream: http://h:1\n",
                       "routes[0].match.path: a path is a literal prefix; nginx's `~` and a leading `^` are regex syntax"),
    "a regex end anchor": ("routes:\n  - match: {path: '/api$'}\n    upstream: http://h:1\n",
                           "routes[0].match.path: a trailing $ is regex syntax: for this path alone write match.exact"),
    "bad method": (
        "routes:\n  - match: {path: /, methods: ['GE T']}\n    upstream: http://h:1\n", "routes[0].match.methods[0]: expected an HTTP method"),
    "bad trusted proxy": ("trusted_proxies: [10.0.0.0/33]\n" + ROUTE, "trusted_proxies[0]: "),
    "host with a port, which could never match": (
        "routes:\n  - match: {path: /, host: 'api.example.com:8080'}\n    upstream: http://h:1\n",
        "routes[0].match.host: expected a host name without a port"),
    "no path form": ("routes:\n  - match: {methods: [GET]}\n    upstream: http://h:1\n",
                     "routes[0].match: expected exactly one of path (a prefix), exact or regex"),
    "two path forms": ("routes:\n  - match: {path: /a, exact: /a}\n    upstream: http://h:1\n",
                       "routes[0].match: expected exactly one of path (a prefix), exact or regex"),
    "exact path with an escape": ("routes:\n  - match: {exact: /a%20b}\n    upstream: http://h:1\n",
                                  "routes[0].match.exact: write the path decoded"),
    "regex RE2 does not take": ("routes:\n  - match: {regex: '/(a)\\1'}\n    upstream: http://h:1\n",
                                "routes[0].match.regex: not a regular expression RE2 takes (invalid escape sequence: \\1)"),
    "regex that does not parse": ("routes:\n  - match: {regex: '/(a'}\n    upstream: http://h:1\n",
                                  "routes[0].match.regex: not a regular expression RE2 takes (missing ): /(a)"),
    "strip_prefix without a prefix": ("routes:\n  - match: {exact: /a}\n    upstream: http://h:1\n    strip_prefix: true\n",
                                      "routes[0].strip_prefix: needs a prefix to strip: match.path, not match.exact"),
    "wildcard host alone": ("routes:\n  - match: {path: /, host: '*'}\n    upstream: http://h:1\n",
                            "routes[0].match.host: expected a host name without a port, such as api.example.com or *.example.com"),
    "wildcard inside a host": ("routes:\n  - match: {path: /, host: 'a.*.example.com'}\n    upstream: http://h:1\n",
                               "routes[0].match.host: expected a host name"),
    "header condition of the wrong type": ("routes:\n  - match: {path: /, headers: {X-V: 2}}\n    upstream: http://h:1\n",
                                           "routes[0].match.headers.X-V: expected a string (the exact value) or"),
    "header condition with two forms": (
        "routes:\n  - match: {path: /, headers: {X-V: {exact: a, regex: b}}}\n    upstream: http://h:1\n",
        "routes[0].match.headers.X-V: expected exactly one of present, exact or regex"),
    "header condition with an unknown form": (
        "routes:\n  - match: {path: /, headers: {X-V: {prefix: a}}}\n    upstream: http://h:1\n",
        "routes[0].match.headers.X-V.prefix: unknown key"),
    "header condition named twice": (
        "routes:\n  - match: {path: /, headers: {X-V: a, x-v: b}}\n    upstream: http://h:1\n",
        "routes[0].match.headers.x-v: header 'x-v' is given twice"),
    "bad header name in a condition": (
        "routes:\n  - match: {path: /, headers: {'X V': a}}\n    upstream: http://h:1\n",
        "routes[0].match.headers.X V: 'X V' is not a valid header name"),
    "present that is not a boolean": (
        "routes:\n  - match: {path: /, query: {q: {present: yes please}}}\n    upstream: http://h:1\n",
        "routes[0].match.query.q.present: expected true or false"),
    "query regex RE2 does not take": (
        "routes:\n  - match: {path: /, query: {q: {regex: '(?<=a)b'}}}\n    upstream: http://h:1\n",
        "routes[0].match.query.q.regex: not a regular expression RE2 takes"),
    "query conditions as a list": (
        "routes:\n  - match: {path: /, query: [q]}\n    upstream: http://h:1\n",
        "routes[0].match.query: expected a mapping of query parameter names, got a list"),
    "tls_ca_file without TLS": (
        "store: {url: 'redis://h/0', tls_ca_file: /etc/hostname}\n" + ROUTE,
        "store.tls_ca_file: only applies to a rediss:// (TLS) store URL"),
    "neither rate nor quota": ("limits:\n  a: {burst: 3}\n" + ROUTE, "limits.a: expected exactly one of `rate`"),
    "both rate and quota": (
        "limits:\n  a: {rate: 1/second, quota: {limit: 1, per: day}}\n" + ROUTE, "limits.a: expected exactly one of"),
    "an unknown mode": ("limits:\n  a: {rate: 1/second, mode: queue}\n" + ROUTE, "limits.a.mode: expected reject or delay"),
    "delay without max_delay": (
        "limits:\n  a: {rate: 1/second, mode: delay}\n" + ROUTE, "limits.a.max_delay: required with mode: delay"),
    "max_delay without delay": (
        "limits:\n  a: {rate: 1/second, max_delay: 1s}\n" + ROUTE, "limits.a.max_delay: only applies with mode: delay"),
    "max_delay past a minute": (
        "limits:\n  a: {rate: 1/second, mode: delay, max_delay: 61s}\n" + ROUTE, "limits.a.max_delay: at most 60s"),
    "max_delay without a unit": (
        "limits:\n  a: {rate: 1/second, mode: delay, max_delay: 500}\n" + ROUTE, "limits.a.max_delay: expected a duration"),
    "a shadow limit that delays": (
        "limits:\n  a: {rate: 1/second, mode: delay, max_delay: 1s, shadow: true}\n" + ROUTE,
        "limits.a.mode: a shadow limit never holds a request back"),
    "a quota that delays": (
        "limits:\n  a: {quota: {limit: 1, per: day}, mode: delay, max_delay: 1s}\n" + ROUTE,
        "limits.a.mode: a quota cannot delay"),
    "a quota with a burst": (
        "limits:\n  a: {quota: {limit: 1, per: day}, burst: 2}\n" + ROUTE, "limits.a.burst: a quota has no burst"),
    "a quota per fortnight": (
        "limits:\n  a: {quota: {limit: 1, per: fortnight}}\n" + ROUTE,
        "limits.a.quota.per: expected hour, day, week, month, got 'fortnight'"),
    "a quota of none": ("limits:\n  a: {quota: {limit: 0, per: day}}\n" + ROUTE, "limits.a.quota.limit: expected an integer >= 1"),
    "a quota reset at 24:00": (
        "limits:\n  a: {quota: {limit: 1, per: day, reset: '24:00 UTC'}}\n" + ROUTE,
        "limits.a.quota.reset: expected a time of day in UTC"),
    "a quota reset in another zone": (
        "limits:\n  a: {quota: {limit: 1, per: day, reset: '09:00 CET'}}\n" + ROUTE, "limits.a.quota.reset: expected"),
    "a quota missing its period": ("limits:\n  a: {quota: {limit: 1}}\n" + ROUTE, "limits.a.quota.per: required key"),
    "a cost above a quota": (
        "limits:\n  a: {quota: {limit: 2, per: day}}\nroutes:\n  - match: {path: /}\n    upstream: http://h:1\n"
        "    limits: [{name: a, cost: 3}]\n", "routes[0].limits[0].cost: cost 3 is greater than the burst 2"),
    "max_delayed zero": ("max_delayed: 0\n" + ROUTE, "max_delayed: expected an integer >= 1, got 0"),
    "tls_ca_file missing": (
        "store: {url: 'rediss://h/0', tls_ca_file: /nonexistent/ca.pem}\n" + ROUTE,
        "store.tls_ca_file: no such file"),
    # urlsplit raises ValueError on an unclosed `[` or a bracketed non-address: it was a traceback.
    "store URL with an unclosed IPv6 bracket": (
        "store: {url: 'redis://[::1:6379/0'}\n" + ROUTE, "store.url: not a URL (Invalid IPv6 URL): 'redis://[::1:6379/0'"),
    "upstream with an unclosed IPv6 bracket": (
        "routes:\n  - match: {path: /}\n    upstream: 'http://[::1:9000'\n", "routes[0].upstream: not a URL (Invalid IPv6 URL)"),
}


@pytest.mark.parametrize(("text", "expected"), ERROR_CASES.values(), ids=ERROR_CASES.keys())
def test_invalid_config_is_one_line_naming_file_path_and_expectation(text, expected):
    message = error_of(text, {"BIG": "10000000000000000"})
    assert expected in message


def test_paths_that_only_look_like_another_gateways_patterns_load():
    """A colon inside a segment (Google's custom methods), a brace that is not a whole
    segment and a dollar inside a path are literal, as upstreams use them."""
    for path in ("/v1/things:batchGet", "/a/{b", "/price$/list", "/a/b*c", "/files/a.tar"):
        config = parse_config(f"routes:\n  - match: {{path: '{path}'}}\n    upstream: http://h:1\n", source="<test>", environ={})
        assert config.routes[0].match.path == path


@pytest.mark.parametrize(
    ("upstream", "expected"),
    [
        ("http://svc:${UP_PASS}@127.0.0.1:x", "routes[0].upstream: bad port in 'http://svc:***@127.0.0.1:x'"),
        ("http://svc:${UP_PASS}@127.0.0.1:1/?q", "got 'http://svc:***@127.0.0.1:1/?q'"),
        ("http://svc:${UP_PASS}@[::1:9000", "routes[0].upstream: not a URL (Invalid IPv6 URL): 'http://svc:***@[::1:9000'"),
    ],
)
def test_an_upstream_url_error_shows_its_password_as_stars(upstream, expected):
    message = error_of(f"routes:\n  - match: {{path: /}}\n    upstream: '{upstream}'\n", {"UP_PASS": "s3cr3t"})
    assert expected in message
    assert "s3cr3t" not in message


@pytest.mark.parametrize(
    ("secret", "expected"),
    [
        ("s3cr3t-token\n", "character 20 of 20 is '\\n'"),
        ("s3cr3t-tok\u00e9n", "character 18 of 19 is '\\xe9'"),
        ("s3cr3t-token ", "this one of 20 characters starts or ends with a space or tab"),
    ],
)
def test_a_header_rule_value_error_says_where_the_value_is_wrong_without_quoting_it(secret, expected):
    """Header rules often carry secrets from the environment; the error names the path and
    the offending character, never the value."""
    text = (
        "routes:\n  - match: {path: /}\n    upstream: http://h:1\n"
        "    request_headers: {set: {Authorization: 'Bearer ${TOKEN}'}}\n"
    )
    message = error_of(text, {"TOKEN": secret})
    assert "routes[0].request_headers.set.Authorization: a header value may hold visible ASCII" in message
    assert expected in message
    assert "s3cr3t" not in message


# --- YAML aliases ----------------------------------------------------------------------


@pytest.mark.parametrize("text", ALIAS_BOMBS.values(), ids=ALIAS_BOMBS.keys())
def test_an_alias_bomb_is_refused_before_its_aliases_are_expanded(text):
    assert "aliases expand the document by more than 100,000 values" in error_of(text)


def test_an_alias_inside_its_own_anchor_is_refused():
    assert "an alias is used inside the anchor it names" in error_of("routes: &r [*r]\n")


def test_aliases_that_share_a_block_among_many_routes_are_read():
    """Sharing is what aliases are for: a thousand routes merging one route's settings add
    ~12,000 values, well inside the bound."""
    first = "  - &first {match: {path: /r0}, upstream: http://127.0.0.1:9000, timeout: {connect: 1s, read: 2s}}\n"
    rest = "".join(f"  - {{<<: *first, match: {{path: /r{i}}}}}\n" for i in range(1, 1000))
    config = parse("routes:\n" + first + rest)
    assert len(config.routes) == 1000
    assert {route.timeout.read for route in config.routes} == {2.0}


# --- reading the file ----------------------------------------------------------------


def test_load_config_reads_a_file_and_uses_the_process_environment(tmp_path, monkeypatch):
    path = tmp_path / "gw.yaml"
    path.write_text("workers: ${GATEWAY_TEST_WORKERS}\nstore: {url: 'redis://h/0'}\n" + ROUTE)
    monkeypatch.setenv("GATEWAY_TEST_WORKERS", "3")
    config = load_config(str(path))
    assert config.workers == 3
    assert config.source == str(path)


def test_load_config_missing_file(tmp_path):
    path = tmp_path / "absent.yaml"
    with pytest.raises(ConfigError, match=rf"^{path}: cannot read: No such file or directory$"):
        load_config(str(path))


def test_load_config_directory_and_binary_file(tmp_path):
    with pytest.raises(ConfigError, match=rf"^{tmp_path}: cannot read: "):
        load_config(str(tmp_path))
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00routes")
    with pytest.raises(ConfigError, match=r"cannot read: not UTF-8 text$"):
        load_config(str(binary))


def test_unsafe_yaml_tags_are_refused_not_constructed():
    message = error_of("routes: !!python/object/apply:os.system ['true']\n")
    assert "malformed YAML: line 1, column 9: could not determine a constructor for the tag" in message


def test_parse_config_reads_only_the_environ_it_is_given(monkeypatch):
    monkeypatch.setenv("GATEWAY_TEST_HOST", "r.internal")
    message = error_of("store: {url: 'redis://${GATEWAY_TEST_HOST}/0'}\n" + ROUTE, {})
    assert "GATEWAY_TEST_HOST is not set" in message


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0", "local_store_memory: expected a size greater than zero"),
        ("lots", "local_store_memory: expected a size such as 32KiB"),
        ("2TiB", "local_store_memory: expected a size such as 32KiB"),
    ],
)
def test_local_store_memory_is_a_size_and_a_bad_one_names_its_path(value, expected):
    assert expected in error_of(f"local_store_memory: {value}\nroutes:\n  - match: {{path: /}}\n    upstream: http://h:1\n")


def test_local_store_memory_defaults_to_32_mib_and_takes_a_size():
    routes = "routes:\n  - match: {path: /}\n    upstream: http://h:1\n"
    assert parse_config(routes, source="<test>", environ={}).local_store_memory == 32 * 1024 * 1024
    assert parse_config("local_store_memory: 256MiB\n" + routes, source="<test>", environ={}).local_store_memory == 256 << 20
