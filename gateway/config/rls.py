"""The config of Envoy's rate-limit service: `rls_listen`, `rls_config` and
`rls_merge_domains`, and the files `rls_config` names, in envoyproxy/ratelimit's own YAML
format, so a deployment points the gateway at the config directory it already has.

Each file holds one `domain` and its `descriptors`, nested as envoyproxy/ratelimit nests
them (`key`, `value`, `rate_limit: {unit, requests_per_unit, name, unlimited, replaces}`,
`shadow_mode`, `quota_mode`, `share_threshold`, `detailed_metric`, `value_to_metric`,
`metadata`, `descriptors`). Each `rate_limit` becomes a gateway `Limit`: by default a token
bucket whose burst is `requests_per_unit` and which refills that many per `unit`;
`algorithm: fixed_window` (a gateway key beside theirs) counts it in the gateway's quota
windows instead, which exist for hour, day and month only. `on_store_error` (also ours) sets
a descriptor's failure policy. What envoyproxy/ratelimit (f2fb157, src/config/config_impl.go)
refuses is refused; where the gateway refuses more, docs/envoy-rls.md says why.

Trusts nothing in the files: every key is checked, unknown keys are refused, and each error
names the file and the YAML path, in one line.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from gateway.config import safe_yaml
from gateway.config.model import FailurePolicy, IdentitySource, Limit, Quota, RlsConfig, RlsDescriptor, RlsRateLimit
from gateway.config.reader import ConfigError, _choice, _Reader, _type_name
from gateway.config.units import Address, Rate

# envoyproxy/ratelimit's units, as Envoy's RateLimitResponse.RateLimit.Unit names them
# (lower case, as their files write them; they read them in any case). A month is
# nominally 30 days and a year 365, as the gateway's own rates count them.
UNIT_SECONDS = {"second": 1.0, "minute": 60.0, "hour": 3600.0, "day": 86400.0, "month": 30 * 86400.0, "year": 365 * 86400.0}
# The gateway's quota windows among those units: its quotas have no second, minute or year window.
FIXED_WINDOW_UNITS = ("hour", "day", "month")
ALGORITHMS = ("token_bucket", "fixed_window")
CHARGES = ("when_allowed", "always")
# The files of a config directory; envoyproxy/ratelimit's own examples all end so.
CONFIG_SUFFIXES = (".yaml", ".yml")
# requests_per_unit is a uint32 in Envoy's RateLimit and in envoyproxy/ratelimit's files.
MAX_REQUESTS_PER_UNIT = 2**32 - 1
# Envoy's descriptor keys and values are free text; the Limit's name goes into Redis keys,
# where `{` would move the Cluster hash tag and `:` could meet a lease key.
_NAME_UNSAFE_RE = re.compile(r"[^A-Za-z0-9_.\-]")
# Every RLS bucket shares the one identity source kind: the descriptor's entries are the identity.
_RLS_KEY = (IdentitySource(kind="global"),)
# The fields envoyproxy/ratelimit reads as strings. Its YAML reader (yaml.v2) gives a string
# field a plain scalar's own text, so `value: 5` is "5" and `value: 05` is "05".
_TEXT_FIELDS = frozenset({"domain", "key", "value", "name", "unit"})
_TEXT_TAGS = frozenset({"tag:yaml.org,2002:int", "tag:yaml.org,2002:bool", "tag:yaml.org,2002:timestamp"})
# A descriptor's switches, all false unless set. detailed_metric and value_to_metric choose
# envoyproxy/ratelimit's statsd names, which the gateway has no counterpart of (docs/envoy-rls.md).
_FLAGS = ("shadow_mode", "quota_mode", "share_threshold", "detailed_metric", "value_to_metric")


class _Loader(safe_yaml.SafeLoader):
    """safe_yaml's reader, except that a number, boolean or date written as the value of a
    text field is read as its text, as envoyproxy/ratelimit reads it."""

    def construct_document(self, node: yaml.Node) -> Any:
        _as_text(node)
        return super().construct_document(node)


def _as_text(root: yaml.Node) -> None:
    stack, seen = [root], set()
    while stack:
        node = stack.pop()
        if id(node) in seen or not isinstance(node, (yaml.MappingNode, yaml.SequenceNode)):
            continue
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
            continue
        for key, value in node.value:
            name = key.value if isinstance(key, yaml.ScalarNode) else None
            if name == "metadata":
                continue  # free data, read as YAML types it
            if name in _TEXT_FIELDS and isinstance(value, yaml.ScalarNode) and value.tag in _TEXT_TAGS:
                value.tag = "tag:yaml.org,2002:str"
            stack.append(value)


@dataclass
class _Level:
    """One level of a domain's tree while its files are read (frozen into an RlsDescriptor)."""

    children: dict[str, RlsDescriptor] = field(default_factory=dict)
    wildcards: list[tuple[str, tuple[str, ...], str]] = field(default_factory=list)


def rls_config(listen: Address, path: Any, r: _Reader, *, merge_domains: bool = False) -> RlsConfig:
    """`rls_listen` (already parsed) and `rls_config`: a directory of files or one file.
    `merge_domains`: a domain may be split across files (envoyproxy/ratelimit's
    MERGE_DOMAIN_CONFIG); otherwise a domain in a second file is an error."""
    path = r.string(path, "rls_config")
    if os.path.isdir(path):
        try:
            names = sorted(n for n in os.listdir(path) if n.endswith(CONFIG_SUFFIXES))
        except OSError as exc:
            r.fail("rls_config", f"cannot read the directory {path!r}: {exc.strerror}")
        files = [os.path.join(path, n) for n in names]
    elif os.path.isfile(path):
        files = [path]
    else:
        r.fail("rls_config", f"no such file or directory: {path!r}")
    roots: dict[str, _Level] = {}
    origin: dict[str, str] = {}
    for file in files:
        try:
            # Each file read on its own: a mistake in one still lets the next be checked.
            r.attempt(file, None, _file, file, roots, origin, merge_domains, r.within(file))
        except RecursionError:
            raise ConfigError(f"{file}: nested too deeply") from None
    domains = {
        domain: RlsDescriptor(rate_limit=None, children=level.children, wildcards=tuple(level.wildcards))
        for domain, level in roots.items()
    }
    return RlsConfig(listen=listen, config_path=path, domains=domains, merge_domains=merge_domains)


def _file(file: str, roots: dict[str, _Level], origin: dict[str, str], merge_domains: bool, r: _Reader) -> None:
    """`r`: a reader of `file` whose mistakes are the config's."""
    try:
        with open(file, encoding="utf-8") as handle:
            document = yaml.load(handle.read(), Loader=_Loader)
    except OSError as exc:
        raise ConfigError(f"{file}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{file}: cannot read: not UTF-8 text") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{file}: malformed YAML: {where}{problem}") from None
    if document is None:
        r.fail("", "the file is empty; it needs a domain")
    _keys_are_text(document, "", r)
    spec = r.mapping(document, "", required=("domain",), optional=("descriptors",))
    domain = _text(spec["domain"], "domain", r)
    if not domain:
        r.fail("domain", "must not be empty")
    if domain in roots and not merge_domains:
        r.fail("domain", f"{domain!r} is defined in {origin[domain]} already (rls_merge_domains: true merges the files of a domain)")
    origin.setdefault(domain, file)
    _level(spec.get("descriptors"), "descriptors", domain, (), roots.setdefault(domain, _Level()), r)


def _level(items: Any, path: str, domain: str, parents: tuple[str, ...], level: _Level, r: _Reader) -> None:
    for i, item in enumerate(r.sequence(items, path) if items is not None else ()):
        where = f"{path}[{i}]"
        _keys_are_text(item, where, r)
        spec = r.mapping(
            item,
            where,
            required=("key",),
            optional=(
                "value", "rate_limit", "descriptors", "shadow_mode", "quota_mode", "share_threshold", "detailed_metric",
                "value_to_metric", "metadata", "on_store_error",
            ),
        )
        key = _text(spec["key"], f"{where}.key", r)
        if not key:
            r.fail(f"{where}.key", "must not be empty")
        value = _text(spec.get("value"), f"{where}.value", r)  # "" as none, as envoyproxy/ratelimit reads it
        selector = f"{key}_{value}" if value else key
        if selector in level.children:
            shown = " > ".join((*parents, selector))
            r.fail(where, f"the descriptor {shown!r} is defined already at this level")
        flags = {name: r.boolean(spec.get(name, False), f"{where}.{name}") for name in _FLAGS}
        if flags["share_threshold"] and "*" not in value:
            r.fail(f"{where}.share_threshold", f"needs a value with a `*` (every value it matches then shares one bucket), not {value!r}")
        own = (*parents, selector)
        policy = _choice(FailurePolicy, spec.get("on_store_error", FailurePolicy.OPEN.value), f"{where}.on_store_error", r)
        metadata = _metadata(spec, where, r)
        rate_limit = None
        if spec.get("rate_limit") is not None:
            rate_limit = _rate_limit(spec["rate_limit"], f"{where}.rate_limit", _limit_name(domain, own), flags, policy, metadata, r)
        elif "on_store_error" in spec:
            r.fail(f"{where}.on_store_error", "applies to a descriptor's rate_limit, which this one does not have")
        below = _Level()
        _level(spec.get("descriptors"), f"{where}.descriptors", domain, own, below, r)
        level.children[selector] = RlsDescriptor(
            rate_limit=rate_limit, children=below.children, wildcards=tuple(below.wildcards), value=value,
            shared=flags["share_threshold"],
        )
        if "*" in value:
            level.wildcards.append((key, tuple(value.split("*")), selector))


def _rate_limit(
    doc: Any, path: str, name: str, flags: dict[str, bool], policy: FailurePolicy, metadata: dict[str, Any], r: _Reader
) -> RlsRateLimit:
    _keys_are_text(doc, path, r)
    spec = r.mapping(doc, path, optional=("unit", "requests_per_unit", "name", "unlimited", "replaces", "algorithm", "charge"))
    own_name = _text(spec.get("name"), f"{path}.name", r)
    replaces = []
    for i, item in enumerate(r.sequence(spec["replaces"], f"{path}.replaces") if spec.get("replaces") is not None else ()):
        where = f"{path}.replaces[{i}]"
        _keys_are_text(item, where, r)
        replaced = _text(r.mapping(item, f"{path}.replaces[{i}]", optional=("name",)).get("name"), f"{where}.name", r)
        if not replaced:
            r.fail(f"{where}.name", "names no rate limit: a replaces entry needs the name of the one it replaces")
        if replaced == own_name:
            r.fail(f"{where}.name", f"{replaced!r} is this rate limit's own name: it would replace itself and never count")
        replaces.append(replaced)
    # shadow_mode answers OK whatever the count, so a quota mode beside it refuses nothing.
    quota_mode = flags["quota_mode"] and not flags["shadow_mode"]
    common: dict[str, Any] = {"name": own_name, "replaces": tuple(replaces), "quota_mode": quota_mode, "metadata": metadata}
    if r.boolean(spec.get("unlimited", False), f"{path}.unlimited"):
        # requests_per_unit is let be, as envoyproxy/ratelimit lets it be: it counts nothing here.
        for key in ("unit", "algorithm", "charge"):
            if key in spec:
                r.fail(f"{path}.{key}", "an unlimited rate_limit counts nothing: it has no unit, algorithm or charge")
        return RlsRateLimit(limit=None, unit="unknown", requests_per_unit=0, **common)
    for key in ("unit", "requests_per_unit"):
        if key not in spec:
            r.fail(f"{path}.{key}", "required key is missing (or set `unlimited: true`)")
    unit_text = _text(spec["unit"], f"{path}.unit", r)
    unit = unit_text.lower()
    if unit not in UNIT_SECONDS:
        r.fail(f"{path}.unit", f"expected {', '.join(UNIT_SECONDS)}, got {unit_text!r}")
    # 0 is envoyproxy/ratelimit's "always over limit": a bucket that never holds a token.
    count = r.integer(spec["requests_per_unit"], f"{path}.requests_per_unit", minimum=0, maximum=MAX_REQUESTS_PER_UNIT)
    algorithm = spec.get("algorithm", "token_bucket")
    if algorithm not in ALGORITHMS:
        r.fail(f"{path}.algorithm", f"expected token_bucket or fixed_window, got {algorithm!r}")
    # The gateway's key: `always` charges every hit, refused or not, into debt past zero, as
    # envoyproxy/ratelimit counts them; what Envoy's charge after the response needs.
    charge = spec.get("charge", "when_allowed")
    if charge not in CHARGES:
        r.fail(f"{path}.charge", f"expected when_allowed or always, got {charge!r}")
    quota = None
    if algorithm == "fixed_window":
        if unit not in FIXED_WINDOW_UNITS:
            r.fail(
                f"{path}.algorithm",
                f"fixed_window counts in the gateway's quota windows, of an hour, a day or a month; not a {unit} "
                "(token_bucket counts any unit)",
            )
        quota = Quota(limit=count, per=unit, reset=0.0)
    limit = Limit(
        name=name,
        # An empty bucket still has a rate, so that the time it takes to refill is 0, not 0/0.
        rate=Rate(tokens=count or 1, period_seconds=UNIT_SECONDS[unit], text=f"{count}/{unit}"),
        burst=count,
        key=_RLS_KEY,
        on_store_error=policy,
        # A quota-mode limit is checked on its own, as a shadow limit is: charged when it has
        # room, never keeping the others from being charged; gateway.envoy.service answers it.
        shadow=flags["shadow_mode"] or quota_mode,
        quota=quota,
    )
    return RlsRateLimit(limit=limit, unit=unit, requests_per_unit=count, charge_always=charge == "always", **common)


def _keys_are_text(value: Any, path: str, r: _Reader) -> None:
    """Says of a key that is no string (`0.25: x`) that it is none, before r.mapping calls it unknown."""
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                r.fail(path, f"a key must be text, got {_type_name(key)} {key!r}")


def _text(value: Any, path: str, r: _Reader) -> str:
    """A text field as envoyproxy/ratelimit reads it: absent or null is "", and a number,
    boolean or date is its text (the loader kept it). A number with a fraction is refused,
    as envoyproxy/ratelimit's key check refuses it."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, float):
        r.fail(path, f"a number with a fraction ({value!r}) is refused here, as envoyproxy/ratelimit refuses it; quote it")
    r.fail(path, f"expected text, got {_type_name(value)}")


def _metadata(spec: Any, where: str, r: _Reader) -> dict[str, Any]:
    """`metadata`: free data, kept as JSON data (keys as text, as envoyproxy/ratelimit makes them)."""
    doc = spec.get("metadata")
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        r.fail(f"{where}.metadata", f"expected a mapping, got {_type_name(doc)}")
    return _plain(doc)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, (datetime.date, bytes)):
        return value.isoformat() if isinstance(value, datetime.date) else value.decode("utf-8", "replace")
    return value


def _limit_name(domain: str, selectors: tuple[str, ...]) -> str:
    """The Limit's name, which names its buckets: readable, and unique whatever characters
    the domain, keys and values hold (a digest of them exactly as written)."""
    readable = _NAME_UNSAFE_RE.sub("_", ".".join((domain, *selectors)))[:80]
    digest = hashlib.sha256("\x00".join((domain, *selectors)).encode("utf-8", "surrogateescape")).hexdigest()[:8]
    return f"rls.{readable}-{digest}"


def override_limit(domain: str, requests_per_unit: int, unit: str) -> Limit:
    """The token bucket of a descriptor's `limit` override (RateLimitOverride), which Envoy
    sends in place of any configured limit, as envoyproxy/ratelimit applies it: never in
    shadow mode, with buckets of its own per domain, count and unit."""
    return Limit(
        name=_limit_name(domain, ("override", str(requests_per_unit), unit)),
        rate=Rate(tokens=requests_per_unit, period_seconds=UNIT_SECONDS[unit], text=f"{requests_per_unit}/{unit}"),
        burst=requests_per_unit,
        key=_RLS_KEY,
        on_store_error=FailurePolicy.OPEN,
    )
