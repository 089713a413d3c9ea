"""The config of Envoy's rate-limit service: `rls_listen` and `rls_config`, and the files
`rls_config` names, in envoyproxy/ratelimit's own YAML format, so a deployment points the
gateway at the config directory it already has.

Each file holds one `domain` and its `descriptors`, nested as envoyproxy/ratelimit nests
them (`key`, `value`, `rate_limit: {unit, requests_per_unit, name, unlimited, replaces}`,
`shadow_mode`, `descriptors`). Each `rate_limit` becomes a gateway `Limit`: by default a
token bucket whose burst is `requests_per_unit` and which refills that many per `unit`;
`algorithm: fixed_window` (a gateway key beside theirs) counts it in the gateway's quota
windows instead, which exist for hour, day and month only. `on_store_error` (also ours) sets
a descriptor's failure policy. Trusts nothing in the files: every key is checked, unknown
keys are refused, and each error names the file and the YAML path, in one line.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any

import yaml

from gateway.config import safe_yaml
from gateway.config.model import (
    FailurePolicy,
    IdentitySource,
    Limit,
    Quota,
    RlsConfig,
    RlsDescriptor,
    RlsRateLimit,
)
from gateway.config.reader import MAX_COUNT, ConfigError, _choice, _Reader
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
# Envoy's descriptor keys and values are free text; the Limit's name goes into Redis keys,
# where `{` would move the Cluster hash tag and `:` could meet a lease key.
_NAME_UNSAFE_RE = re.compile(r"[^A-Za-z0-9_.\-]")
# Every RLS bucket shares the one identity source kind: the descriptor's entries are the identity.
_RLS_KEY = (IdentitySource(kind="global"),)


def rls_config(listen: Address, path: Any, r: _Reader) -> RlsConfig:
    """`rls_listen` (already parsed) and `rls_config`: a directory of files or one file."""
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
    domains: dict[str, RlsDescriptor] = {}
    origin: dict[str, str] = {}
    for file in files:
        domain, root = _file(file)
        if domain in domains:
            raise ConfigError(f"{file}: domain: {domain!r} is defined in {origin[domain]} already")
        domains[domain], origin[domain] = root, file
    return RlsConfig(listen=listen, config_path=path, domains=domains)


def _file(file: str) -> tuple[str, RlsDescriptor]:
    r = _Reader(file)
    try:
        with open(file, encoding="utf-8") as handle:
            document = safe_yaml.load(handle.read())
    except OSError as exc:
        raise ConfigError(f"{file}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{file}: cannot read: not UTF-8 text") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(f"{file}: malformed YAML: {where}{getattr(exc, 'problem', None) or exc}") from None
    spec = r.mapping(document, "", required=("domain",), optional=("descriptors",))
    domain = r.string(spec["domain"], "domain")
    children, prefixes = _level(spec.get("descriptors") or [], "descriptors", domain, (), r)
    return domain, RlsDescriptor(rate_limit=None, children=children, prefixes=prefixes)


def _level(
    items: Any, path: str, domain: str, parents: tuple[str, ...], r: _Reader
) -> tuple[dict[str, RlsDescriptor], tuple[tuple[str, str, RlsDescriptor], ...]]:
    children: dict[str, RlsDescriptor] = {}
    prefixes: list[tuple[str, str, RlsDescriptor]] = []
    for i, item in enumerate(r.sequence(items, path)):
        where = f"{path}[{i}]"
        spec = r.mapping(
            item, where, required=("key",), optional=("value", "rate_limit", "descriptors", "shadow_mode", "on_store_error")
        )
        key = r.string(spec["key"], f"{where}.key")
        value = r.string(spec["value"], f"{where}.value") if spec.get("value") is not None else None
        selector = key if value is None else f"{key}_{value}"
        own = (*parents, selector)
        shadow = r.boolean(spec.get("shadow_mode", False), f"{where}.shadow_mode")
        policy = _choice(FailurePolicy, spec.get("on_store_error", FailurePolicy.OPEN.value), f"{where}.on_store_error", r)
        rate_limit = None
        if spec.get("rate_limit") is not None:
            rate_limit = _rate_limit(spec["rate_limit"], f"{where}.rate_limit", _limit_name(domain, own), shadow, policy, r)
        elif "shadow_mode" in spec or "on_store_error" in spec:
            r.fail(where, "shadow_mode and on_store_error apply to a descriptor's rate_limit, which this one does not have")
        nested, nested_prefixes = _level(spec.get("descriptors") or [], f"{where}.descriptors", domain, own, r)
        node = RlsDescriptor(rate_limit=rate_limit, children=nested, prefixes=nested_prefixes)
        if value is not None and value.endswith("*"):
            if any(k == key and p == value[:-1] for k, p, _ in prefixes):
                r.fail(where, f"a descriptor {key}: {value} is defined already at this level")
            prefixes.append((key, value[:-1], node))
            continue
        if selector in children:
            r.fail(where, f"a descriptor {selector!r} is defined already at this level")
        children[selector] = node
    return children, tuple(prefixes)


def _rate_limit(doc: Any, path: str, name: str, shadow: bool, policy: FailurePolicy, r: _Reader) -> RlsRateLimit:
    spec = r.mapping(doc, path, optional=("unit", "requests_per_unit", "name", "unlimited", "replaces", "algorithm", "charge"))
    replaces = tuple(
        r.string(r.mapping(item, f"{path}.replaces[{i}]", required=("name",))["name"], f"{path}.replaces[{i}].name")
        for i, item in enumerate(r.sequence(spec.get("replaces", []), f"{path}.replaces"))
    )
    own_name = r.string(spec["name"], f"{path}.name") if "name" in spec else ""
    if r.boolean(spec.get("unlimited", False), f"{path}.unlimited"):
        if "unit" in spec or "requests_per_unit" in spec or "algorithm" in spec or "charge" in spec:
            r.fail(path, "an unlimited rate_limit counts nothing: it has no unit, requests_per_unit, algorithm or charge")
        return RlsRateLimit(limit=None, unit="unknown", requests_per_unit=0, name=own_name, replaces=replaces)
    for key in ("unit", "requests_per_unit"):
        if key not in spec:
            r.fail(f"{path}.{key}", "required key is missing (or set `unlimited: true`)")
    unit_text = spec["unit"]
    unit = unit_text.lower() if isinstance(unit_text, str) else unit_text
    if unit not in UNIT_SECONDS:
        r.fail(f"{path}.unit", f"expected {', '.join(UNIT_SECONDS)}, got {unit_text!r}")
    # 0 is envoyproxy/ratelimit's "always over limit"; a bucket that never holds a token
    # is a refusal the gateway has no form for, and Envoy's own config can drop the route.
    count = r.integer(spec["requests_per_unit"], f"{path}.requests_per_unit", minimum=1, maximum=min(MAX_COUNT, 2**32 - 1))
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
        rate=Rate(tokens=count, period_seconds=UNIT_SECONDS[unit], text=f"{count}/{unit}"),
        burst=count,
        key=_RLS_KEY,
        on_store_error=policy,
        shadow=shadow,
        quota=quota,
    )
    return RlsRateLimit(
        limit=limit, unit=unit, requests_per_unit=count, name=own_name, replaces=replaces, charge_always=charge == "always"
    )


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
