"""Config fuzzing: whatever the file holds, the loader answers with a
GatewayConfig or a ConfigError of one line per mistake, each naming the file and where,
never a traceback.

Three sources of input: arbitrary text, arbitrary YAML documents, and valid
configs with one part mutated (a value replaced, a key dropped or added, a
mapping turned into a list), which reach deep into the loader where random
documents rarely get. A mutated valid config's errors must each name a YAML path."""

from __future__ import annotations

import copy
import re
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.config import ConfigError, GatewayConfig, parse_config
from tests.examples import ISSUE_EXAMPLE

SOURCE = "gw.yaml"
FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# A path as the loader writes them (`routes[0].match.path`, `limits.per_client.key[1]`,
# `routes[0].limits[1].':'`), then what was wrong; never malformed YAML or a bare message.
_ERROR_WITH_PATH = re.compile(r"^gw\.yaml: (?!malformed YAML)\S.*?: \S")

# Valid configs to mutate: every section the loader reads.
VALID = [
    ISSUE_EXAMPLE,
    """\
listen: {address: 127.0.0.1:8443, tls: {cert: /nonexistent/c.pem, key: /nonexistent/k.pem, min_version: TLSv1.3}}
admin_listen: "[::1]:9090"
max_in_flight: 100
shutdown_grace: 5s
forwarded_headers: append
path_normalization: {dot_segments: reject, escaped_slashes: decode, merge_slashes: false}
store: {url: 'redis+sentinel://:pw@s1:26379,s2/mymaster?db=1', timeout: 20ms, local_divisor: 2, max_pending: 10}
limits:
  a: {rate: 10/second, burst: 3, key: ['query:key', 'cookie:sid', ip], on_store_error: local}
  b: {rate: 1/500ms, burst: 1, key: header:X-User, on_store_error: closed}
routes:
  - match: {path: /files/my docs, methods: [GET, PUT], host: api.example.com, case_sensitive: false}
    upstream: https://10.0.0.7:9000/base
    limits: [a, {name: b, cost: 1}]
    strip_prefix: true
    preserve_host: true
    allow_path_parameters: true
    timeout: {connect: 1s, read: 30s}
""",
]
VALID_DOCS = [yaml.safe_load(text) for text in VALID]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
    st.sampled_from(["", "/", "ip", "1/second", "10ms", "-1s", "0", "${X}", "$$", "redis://h:0/0", "a:b", "[::1]:x", "open"]),
)
documents = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.one_of(st.text(max_size=12), st.integers()), children, max_size=4)
    ),
    max_leaves=20,
)


def dump(document: Any) -> str:
    """The document as YAML text, written by libyaml when PyYAML has it: the Python
    emitter took about as long as the loader under test."""
    return yaml.dump(document, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper))


def outcome(text: str) -> GatewayConfig | list[str]:
    """The config, or the error's lines, each naming the file."""
    try:
        return parse_config(text, source=SOURCE, environ={})
    except ConfigError as exc:
        lines = str(exc).split("\n")
        assert lines == list(exc.lines), lines
        assert all(line.startswith(f"{SOURCE}: ") for line in lines), lines
        return lines


@FUZZ
@given(st.text(max_size=300))
def test_arbitrary_text_is_a_config_or_one_line_error(text):
    outcome(text)


@FUZZ
@given(documents)
def test_arbitrary_yaml_documents_are_a_config_or_one_line_error(document):
    outcome(dump(document))


def _locations(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [path]
    if isinstance(node, dict):
        for key, value in node.items():
            found += _locations(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += _locations(value, (*path, i))
    return found


@st.composite
def mutated(draw) -> Any:
    document = copy.deepcopy(draw(st.sampled_from(VALID_DOCS)))
    path = draw(st.sampled_from(_locations(document)[1:]))
    parent = document
    for step in path[:-1]:
        parent = parent[step]
    last = path[-1]
    kind = draw(st.sampled_from(["replace", "drop", "add key", "as list", "as mapping"]))
    if kind == "replace":
        parent[last] = draw(documents)
    elif kind == "drop":
        del parent[last]
    elif kind == "add key" and isinstance(parent[last], dict):
        parent[last][draw(st.text(min_size=1, max_size=10))] = draw(scalars)
    elif kind == "as list":
        parent[last] = [parent[last]]
    elif kind == "as mapping":
        parent[last] = {"value": parent[last]}
    return document


@FUZZ
@given(mutated())
def test_a_mutated_valid_config_is_a_config_or_an_error_naming_a_path(document):
    result = outcome(dump(document))
    if isinstance(result, list):
        assert all(_ERROR_WITH_PATH.match(line) for line in result if not line.startswith(f"{SOURCE}: … and ")), result
