"""One run reports every mistake in a config file: each on its own line naming the file and
the YAML path, at most MAX_REPORTED of them, a misspelt key or value with the known one it
is closest to. What makes the rest meaningless (YAML that does not parse, a top level that
is no mapping, unset environment variables) still stops at once, and what only follows from
a mistake already reported (a route naming a broken limit) is not reported again.
Pure parsing, but for the CLI tests, which run `gateway check` and `gateway run` as users do."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import ConfigError, parse_config
from gateway.config.reader import MAX_REPORTED
from tests.helpers import SOURCE, error_of
from tests.processes import run_cli

ROUTE = "routes:\n  - match: {path: /}\n    upstream: http://127.0.0.1:9000\n"
THREE_MISTAKES = (
    "limits:\n"
    "  per_client: {rate: 100/minute, brust: 20}\n"
    "  reports: {rate: 10/fortnight}\n"
    "routes:\n"
    "  - match: {path: /}\n"
    "    upstream: http://127.0.0.1:9000\n"
    "    limits: [per_client, nope]\n"
)
THREE_LINES = [
    "limits.per_client.brust: unknown key, did you mean `burst`? (expected one of: rate, burst, quota, key,",
    "limits.reports.rate: expected a rate such as 100/minute",
    "routes[0].limits[1]: no limit named 'nope' is defined under `limits` (defined: per_client, reports)",
]


def errors_of(text: str, environ: dict[str, str] | None = None) -> list[str]:
    """The lines of the ConfigError parsing `text` raises, each checked to name the file."""
    with pytest.raises(ConfigError) as info:
        parse_config(text, source=SOURCE, environ=environ or {})
    lines = str(info.value).split("\n")
    assert lines == list(info.value.lines)
    assert all(line.startswith(f"{SOURCE}: ") for line in lines), lines
    return [line.removeprefix(f"{SOURCE}: ") for line in lines]


def test_a_typo_a_bad_rate_and_an_undefined_limit_are_three_lines_of_one_error():
    lines = errors_of(THREE_MISTAKES)
    assert len(lines) == 3, lines
    for line, expected in zip(lines, THREE_LINES, strict=True):
        assert line.startswith(expected), line


@pytest.mark.parametrize("command", ["check", "run"])
def test_the_cli_prints_each_mistake_on_a_line_of_its_own_and_exits_2(tmp_path: Path, command: str):
    path = tmp_path / "gw.yaml"
    path.write_text(THREE_MISTAKES)
    result = run_cli(command, "-c", str(path))
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 3, result.stderr
    for line, expected in zip(lines, THREE_LINES, strict=True):
        assert line.startswith(f"gateway: {path}: {expected}"), line


def test_a_good_file_still_checks_and_exits_0(tmp_path: Path):
    path = tmp_path / "gw.yaml"
    path.write_text("limits:\n  a: {rate: 1/second, burst: 5}\n" + ROUTE)
    result = run_cli("check", "-c", str(path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"{path}: OK")


# --- did you mean -----------------------------------------------------------------

SUGGESTIONS = {
    "top level": ("listne: 127.0.0.1:8080\n" + ROUTE, "listne: unknown key, did you mean `listen`?"),
    "in a limit": ("limits:\n  a: {rate: 1/second, brust: 2}\n" + ROUTE, "limits.a.brust: unknown key, did you mean `burst`?"),
    "in a route": (
        ROUTE + "    limts: [a]\n" + "limits:\n  a: {rate: 1/second}\n",
        "routes[0].limts: unknown key, did you mean `limits`?",
    ),
    "in a store": ("store: {url: 'redis://h/0', timout: 5ms}\n" + ROUTE, "store.timout: unknown key, did you mean `timeout`?"),
    "an enum value": (
        "limits:\n  a: {rate: 1/second, on_store_error: opn}\n" + ROUTE,
        "limits.a.on_store_error: expected open, closed or local, got 'opn', did you mean `open`?",
    ),
    "a top-level enum value": (
        "forwarded_headers: apend\n" + ROUTE, "forwarded_headers: expected replace or append, got 'apend', did you mean `append`?"
    ),
    "a limit's mode": (
        "limits:\n  a: {rate: 1/second, mode: dealy, max_delay: 1s}\n" + ROUTE,
        "limits.a.mode: expected reject or delay, got 'dealy', did you mean `delay`?",
    ),
    "a quota's period": (
        "limits:\n  a: {quota: {limit: 5, per: mnth}}\n" + ROUTE,
        "limits.a.quota.per: expected hour, day, week, month, got 'mnth', did you mean `month`?",
    ),
    "a route's limit name": (
        "limits:\n  per_client: {rate: 1/second}\n" + ROUTE + "    limits: [per_clinet]\n",
        "routes[0].limits[0]: no limit named 'per_clinet' is defined under `limits` (defined: per_client), did you mean `per_client`?",
    ),
}


@pytest.mark.parametrize(("text", "expected"), SUGGESTIONS.values(), ids=SUGGESTIONS.keys())
def test_a_misspelling_is_told_the_closest_known_key_or_value(text: str, expected: str):
    assert error_of(text).removeprefix(f"{SOURCE}: ").startswith(expected)


def test_a_key_like_no_known_one_gets_no_suggestion():
    line = error_of("colour: blue\n" + ROUTE)
    assert line.startswith(f"{SOURCE}: colour: unknown key (expected one of: routes, listen,"), line
    assert "did you mean" not in line


def test_a_misspelt_required_key_is_not_also_reported_missing():
    lines = errors_of("routes:\n  - match: {path: /}\n    upstrem: http://127.0.0.1:9000\n")
    assert lines == [
        "routes[0].upstrem: unknown key, did you mean `upstream`? (expected one of: match, upstream, limits, strip_prefix, "
        "preserve_host, allow_path_parameters, timeout, max_body_size, request_headers, response_headers)"
    ]


def test_a_required_key_missing_beside_an_unrelated_unknown_key_is_two_mistakes():
    lines = errors_of("listen: {adress: 127.0.0.1:8080, color: red}\n" + ROUTE)
    assert [line.partition(":")[0] for line in lines] == ["listen.adress", "listen.color"]
    lines = errors_of("listen: {color: red}\n" + ROUTE)
    assert [line.partition(": ")[0] for line in lines] == ["listen.color", "listen.address"]


# --- what is not reported twice, and what still stops at once --------------------------


def test_a_route_naming_a_broken_limit_is_not_told_the_limit_is_undefined():
    text = "limits:\n  a: {rate: 10/fortnight}\n" + ROUTE + "    limits: [a]\n"
    assert [line.partition(":")[0] for line in errors_of(text)] == ["limits.a.rate"]


def test_a_broken_store_is_not_also_a_missing_one():
    text = "workers: 2\nstore: {url: 'redis://h:x/0'}\n" + ROUTE
    assert [line.partition(":")[0] for line in errors_of(text)] == ["store.url"]


def test_settings_read_only_from_trusted_proxies_are_not_refused_for_broken_ones():
    text = "trusted_proxies: [10.0.0.1/8]\nclient_ip: {depth: 2}\n" + ROUTE
    assert [line.partition(": ")[0] for line in errors_of(text)] == ["trusted_proxies[0]"]


def test_a_mapping_left_empty_by_an_unknown_key_is_not_also_told_it_is_empty():
    text = "routes:\n  - match: {path: /, headers: {X-V: {prefix: a}}}\n    upstream: http://127.0.0.1:9000\n"
    assert [line.partition(": ")[0] for line in errors_of(text)] == ["routes[0].match.headers.X-V.prefix"]


def test_every_route_and_every_top_level_setting_is_checked():
    text = (
        "workers: 0\nshutdown_grace: soon\naccess_log: jsn\n"
        "routes:\n"
        "  - match: {path: /a}\n    upstream: ftp://h\n"
        "  - match: {path: b}\n    upstream: http://h\n"
        "  - match: {path: /c}\n    upstream: http://h\n    timeout: {read: forever}\n"
    )
    assert [line.partition(": ")[0] for line in errors_of(text)] == [
        "workers", "routes[0].upstream", "routes[1].match.path", "routes[2].timeout.read", "shutdown_grace", "access_log",
    ]
    assert "did you mean `json`?" in errors_of(text)[-1]


def test_at_most_max_reported_lines_then_how_many_more():
    extra = MAX_REPORTED + 7
    text = "".join(f"unknown_{i}: 1\n" for i in range(extra)) + ROUTE
    lines = errors_of(text)
    assert len(lines) == MAX_REPORTED + 1
    assert lines[:MAX_REPORTED] == [line for line in lines if line.startswith("unknown_")]
    assert lines[0].startswith("unknown_0: unknown key")
    assert lines[-1] == "… and 7 more"


def test_the_cli_prints_the_cap_line_too(tmp_path: Path):
    path = tmp_path / "gw.yaml"
    path.write_text("".join(f"unknown_{i}: 1\n" for i in range(MAX_REPORTED + 3)) + ROUTE)
    result = run_cli("check", "-c", str(path), env={"PYTHONIOENCODING": "utf-8"})
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == MAX_REPORTED + 1, result.stderr
    assert lines[-1] == f"gateway: {path}: … and 3 more"


STOPS_AT_ONCE = {
    "malformed YAML": ("limits: {a: {brust: 1}}\nroutes: [\n", "malformed YAML: line 3"),
    "a top level that is no mapping": ("- listne: 1\n- brust: 2\n", "expected a mapping, got a list"),
    "an empty file": ("", "the file is empty"),
}


@pytest.mark.parametrize(("text", "expected"), STOPS_AT_ONCE.values(), ids=STOPS_AT_ONCE.keys())
def test_a_file_that_cannot_be_read_on_is_one_line(text: str, expected: str):
    assert expected in error_of(text)


def test_every_unset_environment_variable_is_named_and_nothing_read_from_them():
    text = "listen: ${GW_LISTEN}\nstore: {url: '${GW_STORE}'}\nlimits:\n  a: {rate: 1/second, brust: 2}\n" + ROUTE
    lines = errors_of(text)
    assert [line.partition(": ")[0] for line in lines] == ["listen", "store.url"]
    assert all("is not set and has no default" in line for line in lines)


def test_a_mistake_in_each_of_two_rls_files_and_one_in_the_gateway_file(tmp_path: Path):
    pytest.importorskip("grpc")
    (tmp_path / "a.yaml").write_text("domain: a\ndescriptors:\n  - key: k\n    ratelimit: {unit: second, requests_per_unit: 1}\n")
    (tmp_path / "b.yaml").write_text("domain: b\ndescriptors:\n  - key: k\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n")
    text = f"rls_listen: 127.0.0.1:0\nrls_config: {tmp_path}\nworkrs: 1\n" + ROUTE
    with pytest.raises(ConfigError) as info:
        parse_config(text, source=SOURCE, environ={})
    lines = info.value.lines
    assert len(lines) == 3, lines
    assert lines[0].startswith(f"{SOURCE}: workrs: unknown key, did you mean `workers`?")
    assert lines[1].startswith(f"{tmp_path / 'a.yaml'}: descriptors[0].ratelimit: unknown key, did you mean `rate_limit`?")
    assert lines[2].startswith(f"{tmp_path / 'b.yaml'}: descriptors[0].rate_limit.unit:")


# --- one mistake reads as it did -------------------------------------------------------

UNCHANGED = {
    "undefined limit": (
        "limits:\n  a: {rate: 1/second}\n" + ROUTE + "    limits: [{name: nope}]\n",
        "gw.yaml: routes[0].limits[0].name: no limit named 'nope' is defined under `limits` (defined: a)",
    ),
    "bad rate": (
        "limits:\n  a: {rate: 10/fortnight}\n" + ROUTE,
        "gw.yaml: limits.a.rate: expected a rate such as 100/minute, 5/second, 1000/month, 100/10s or 3/500ms, got '10/fortnight'",
    ),
    "workers without a store": (
        "workers: 4\n" + ROUTE,
        "gw.yaml: workers: 4 needs a shared `store:`; with the in-process store each worker would count separately "
        "and clients would get 4 times the limit",
    ),
    "unknown key far from any": (
        "path_normalization: {normalize: true}\n" + ROUTE,
        "gw.yaml: path_normalization.normalize: unknown key (expected one of: dot_segments, escaped_slashes, merge_slashes)",
    ),
}


@pytest.mark.parametrize(("text", "expected"), UNCHANGED.values(), ids=UNCHANGED.keys())
def test_a_single_mistake_is_the_one_line_it_was(text: str, expected: str):
    assert error_of(text) == expected


def test_the_lines_reach_a_terminal_that_is_not_utf_8(tmp_path: Path):
    """A control character in a key stays escaped in its own line, whatever the encoding."""
    path = tmp_path / "gw.yaml"
    path.write_text('"a\\x1bb": 1\nlistne: 2\n' + ROUTE)
    result = run_cli("check", "-c", str(path), env={"PYTHONIOENCODING": "ascii:backslashreplace"})
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 2, result.stderr
    assert "\x1b" not in result.stderr and "\\x1b" in lines[0]


BAD_YAML = """\
limits:
  per_client: {rate: 100/minute, brust: 20, key: [header:X-API-Key, ip]}
  reports: {rate: 10/fortnight, on_store_error: closed}
routes:
  - match: {path: /api}
    upstream: http://10.0.0.7:9000
    limits: [per_client]
  - match: {path: /api/reports}
    upstream: http://10.0.0.7:9000
    limits: [report]
"""


def test_the_configuration_pages_transcript_is_what_its_file_gives():
    page = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text(encoding="utf-8")
    shown = page.partition("$ gateway check -c bad.yaml\n")[2].partition("```")[0].splitlines()
    with pytest.raises(ConfigError) as info:
        parse_config(BAD_YAML, source="bad.yaml", environ={})
    assert shown == [f"gateway: {line}" for line in info.value.lines]
