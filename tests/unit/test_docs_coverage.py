"""The documentation keeps up with the code and with itself: every YAML key the loader
accepts has a row in docs/configuration.md, every metric the gateway exports is named in
docs/admin-api.md's "Metrics and health" or in docs/operations.md (and every metric the
README or a docs page names exists), the README's short config loads, every docs page is
linked from the README, and every relative link in the README and docs/ leads to a file
that exists (and a heading that exists, when it names one)."""

import ast
import collections
import re
from pathlib import Path

import pytest

from gateway.config import ConfigError, loader, parse_config
from gateway.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
DOCS = {path: path.read_text(encoding="utf-8") for path in sorted((ROOT / "docs").glob("*.md"))}
CONFIGURATION = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
ADMIN_API = (ROOT / "docs" / "admin-api.md").read_text(encoding="utf-8")
OPERATIONS = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")

# Each `_Reader.mapping` call in the loader, by (function, YAML path argument as written), ->
# the docs/configuration.md heading whose tables document it and the key path of its keys beneath that heading.
# A new mapping call fails test_every_mapping_call_has_a_section until it is placed here.
SECTIONS = {
    ("_build", "''"): ("Top level", ""),
    ("_listen", "'listen'"): ("Top level", "listen."),
    ("_listen", "'listen.tls'"): ("Top level", "listen.tls."),
    ("_client_ip", "'client_ip'"): ("Top level", "client_ip."),
    ("_build", "'limits'"): ("`limits.NAME`", ""),  # limit names only
    ("_path_normalization", "'path_normalization'"): ("`path_normalization`", ""),
    ("_store", "'store'"): ("`store`", ""),
    ("_limit", "path"): ("`limits.NAME`", ""),
    ("_quota", "path"): ("`limits.NAME`", "quota."),
    ("parse_response_cost", "path"): ("`limits.NAME`", "cost."),
    ("_tiers", "path"): ("`limits.NAME`", "tiers."),
    ("_tiers", "where"): ("`limits.NAME`", "tiers.TIER."),
    ("_tiers", "f'{path}.from'"): ("`limits.NAME`", "tiers.from."),
    ("_tier_members", "''"): ("`limits.NAME`", ""),  # the key file: tier names only
    ("_concurrency_limit", "path"): ("`limits.NAME` with `concurrency` (requests in flight)", ""),
    ("_response", "path"): ("`response`", ""),
    ("_jwt", "'jwt'"): ("`jwt`", ""),
    ("_route", "path"): ("`routes[]`", ""),
    ("_route", "f'{path}.timeout'"): ("`routes[]`", "timeout."),
    ("_route_limit", "path"): ("`routes[]`", "limits[]."),
    ("_match", "path"): ("`routes[]`", "match."),
    ("_value_matches", "where"): ("`routes[]`", "match.headers.NAME."),
    ("_header_rules", "path"): ("`routes[]`", "request_headers."),
    ("_pool", "path"): ("`routes[].upstream` as a pool", ""),
    ("_target", "path"): ("`routes[].upstream` as a pool", "targets[]."),
    ("_health", "path"): ("`routes[].upstream` as a pool", "health."),
    ("_passive", "path"): ("`routes[].upstream` as a pool", "passive."),
    ("_file", "''"): ("`rls_config` files (envoyproxy/ratelimit's format)", ""),
    ("_level", "where"): ("`rls_config` files (envoyproxy/ratelimit's format)", "descriptors[]."),
    ("_rate_limit", "path"): ("`rls_config` files (envoyproxy/ratelimit's format)", "descriptors[].rate_limit."),
    ("_rate_limit", "f'{path}.replaces[{i}]'"): ("`rls_config` files (envoyproxy/ratelimit's format)", "descriptors[].rate_limit.replaces[]."),
}

# Keys the loader names only to refuse them with a message of their own.
RETIRED = {("`store`", "max_connections")}


def _mapping_calls() -> list[tuple[str, str, list[str]]]:
    """(function, path argument, literal keys) for each `mapping(...)` call in gateway/config/.
    Keys computed from the document itself (limit and tier names) are names, not keys."""
    trees = [ast.parse(module.read_text(encoding="utf-8")) for module in sorted(Path(loader.__file__).parent.glob("*.py"))]
    calls = []
    for function in (node for tree in trees for node in ast.walk(tree)):
        if not isinstance(function, ast.FunctionDef) or function.name == "mapping":
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "mapping":
                keys = [
                    element.value
                    for keyword in node.keywords
                    if keyword.arg in ("required", "optional") and isinstance(keyword.value, ast.Tuple)
                    for element in keyword.value.elts
                    if isinstance(element, ast.Constant)
                ]
                calls.append((function.name, ast.unparse(node.args[1]), keys))
    return calls


def _section(text: str, heading: str, level: str) -> str:
    """The text under `level heading` up to the next heading of that level or higher."""
    match = re.search(rf"^{level} {re.escape(heading)}\n(.*?)(?=^#{{1,{len(level)}}} |\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, f"no heading {level} {heading}"
    return match.group(1)


def _rows(heading: str) -> list[tuple[set[str], set[str]]]:
    """(code spans of the first cell, code spans of the whole row) of each table row under
    `## heading` of docs/configuration.md."""
    section = _section(CONFIGURATION, heading, "##")
    rows = []
    for line in section.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            first = re.split(r"(?<!\\)\|", line)[1]
            rows.append((set(re.findall(r"`([^`]+)`", first)), set(re.findall(r"`([^`]+)`", line))))
    return rows


def _documented(key_path: str, rows: list[tuple[set[str], set[str]]]) -> bool:
    """A row names the key in its first cell (`timeout.connect`), or rows name its own keys
    (`client_ip.header`), or the row of one of its parents names it (`quota` row: `reset`).
    `[]` (each item of a list) is left out of the comparison: `limits` is `limits[]`'s row."""
    path = key_path.replace("[]", "")
    parents = {path.rsplit(".", cut)[0] for cut in range(1, path.count(".") + 1)}
    last = path.rsplit(".", 1)[-1]
    for first, spans in rows:
        named = {span.replace("[]", "") for span in first}
        if path in named or any(span.startswith(path + ".") for span in named) or (parents & named and last in spans):
            return True
    return False


def test_every_mapping_call_has_a_section():
    placed = {(function, path) for function, path, _ in _mapping_calls()}
    assert placed - SECTIONS.keys() == set(), "place these mapping calls in SECTIONS"
    assert SECTIONS.keys() - placed == set(), "these SECTIONS entries name no mapping call any more"


def test_every_config_key_has_a_row_in_the_configuration_reference():
    expected = {
        (heading, prefix + key)
        for function, path, keys in _mapping_calls()
        for heading, prefix in [SECTIONS[function, path]]
        for key in keys
    }
    missing = sorted(
        (heading, key) for heading, key in expected - RETIRED if not _documented(key, _rows(heading))
    )
    assert missing == []


def test_the_readme_config_is_one_the_loader_takes():
    (text,) = re.findall(r"^```yaml\n(.*?)^```$", README, re.MULTILINE | re.DOTALL)
    parse_config(text, source="README.md", environ={"GATEWAY_KEY_SECRET": "a-secret-of-thirty-two-characters"})


def test_retired_keys_are_still_refused():
    text = "store: {url: redis://127.0.0.1:1/0, max_connections: 8}\nroutes: [{match: {path: /}, upstream: http://a}]\n"
    with pytest.raises(ConfigError, match=r"store\.max_connections: no longer used"):
        parse_config(text, source="gw.yaml", environ={})


def _exported() -> dict[str, set[str]]:
    """Each metric family /metrics serves, by the name it is exposed under, -> the sample
    names it may expose. Every family is registered when Metrics is built, used or not."""
    families = {}
    for family in Metrics().exposition_registry().collect():
        name = family.name + "_total" if family.type == "counter" else family.name
        suffixes = ("", "_bucket", "_sum", "_count") if family.type == "histogram" else ("",)
        families[name] = {name + suffix for suffix in suffixes}
    return families


def _metric_names(text: str) -> set[str]:
    """`gateway_...` names in code spans, labels dropped: `gateway_requests_total{route}`."""
    return set(re.findall(r"`(gateway_[a-z_]+)(?:\{[^`]*\})?`", text))


def test_every_metric_is_named_in_the_metrics_or_operations_page():
    named = _metric_names(_section(ADMIN_API, "Metrics and health (admin listener)", "##"))
    named |= _metric_names(OPERATIONS)
    assert sorted(_exported().keys() - named) == []


def test_the_metrics_section_describes_each_metric_once():
    # Two families are referred back to ("also counted in gateway_requests_total as 5xx");
    # any other named twice is a list entry repeated, as a merge left one mid-sentence.
    section = _section(ADMIN_API, "Metrics and health (admin listener)", "##")
    named = collections.Counter(re.findall(r"`(gateway_[a-z_]+)(?:\{[^`]*\})?`", section))
    referred_back = {"gateway_requests_total", "gateway_limiter_decisions_total"}
    assert {name: count for name, count in named.items() if count > 1 and name not in referred_back} == {}


def test_every_metric_the_docs_name_exists():
    exposed = set().union(*_exported().values())
    for path, text in {ROOT / "README.md": README, **DOCS}.items():
        assert sorted(_metric_names(text) - exposed) == [], path.name


def _links(text: str) -> list[str]:
    """Targets of the markdown links and images in `text`, outside fenced code blocks."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", prose)


def _anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation dropped, spaces as `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(text: str) -> set[str]:
    prose = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    return {_anchor(heading) for heading in re.findall(r"^#{1,6} (.+)$", prose, re.MULTILINE)}


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in _links(README)}
    assert [path.name for path in DOCS if path.resolve() not in linked] == []


def test_every_relative_link_leads_to_a_file_and_heading_that_exist():
    broken = []
    for path in [ROOT / "README.md", ROOT / "SECURITY.md", *DOCS]:
        for target in _links(path.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):
                continue  # https://, mailto: and the like: not ours to check offline
            file, _, fragment = target.partition("#")
            resolved = (path.parent / file).resolve() if file else path
            if not resolved.exists():
                broken.append(f"{path.name}: {target} (no such file)")
            elif fragment and resolved.suffix == ".md" and fragment not in _anchors(resolved.read_text(encoding="utf-8")):
                broken.append(f"{path.name}: {target} (no such heading)")
    assert broken == []
