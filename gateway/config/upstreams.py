"""A route's `upstream`: one base URL, or a pool of targets with its balancing, active
health checks, passive ejection and retries.

Trusts nothing in the file; a URL's password is never shown in a message. Targets are
shared by every route that names them (gateway.upstream.balancing), so `_SharedTargets`
holds each URL to one name and one set of health settings across the whole file.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from gateway.config.pool_model import Balance, HealthCheck, PassiveEjection, Target, UpstreamPool
from gateway.config.reader import _choice, _Reader, _split_url
from gateway.config.redaction import redacted_url
from gateway.config.units import parse_duration

# Upstream pools. Passive ejection takes Envoy's outlier-detection defaults (5 consecutive
# errors, 30 s out); the active check defaults are nginx Plus's interval with Envoy-like
# thresholds, so one lost probe never flaps a target. One retry, as nginx's
# proxy_next_upstream passes a refused connection on to the next server by default.
DEFAULT_EJECT_AFTER = 5
DEFAULT_EJECT_FOR = "30s"
DEFAULT_RETRIES = 1
DEFAULT_HEALTH_INTERVAL = "5s"
DEFAULT_HEALTH_TIMEOUT = "1s"
DEFAULT_UNHEALTHY_AFTER = 3
DEFAULT_HEALTHY_AFTER = 2
_TARGET_NAME_RE = re.compile(r"^[A-Za-z0-9_.:\-\[\]]+$")
_HEALTH_PATH_RE = re.compile(r"^/[!-~]*$")


def _upstream_url(value: Any, path: str, r: _Reader) -> str:
    """An upstream base URL, without its trailing slash."""
    url = r.string(value, path)
    shown = redacted_url(url)  # every message below shows this, never the password
    parts = _split_url(url, path, r, shown=shown)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        r.fail(path, f"expected an http:// or https:// URL with a host and no query, got {shown!r}")
    try:
        _ = parts.port  # raises ValueError on a bad port
    except ValueError:
        r.fail(path, f"bad port in {shown!r}")
    return url.rstrip("/")


class _SharedTargets:
    """The targets seen so far in any route's pool. A target's health, ejection and load are
    shared by every route that names it (gateway.upstream.balancing), so a URL has one name,
    one set of health and passive settings, and a name one URL: metrics stay unambiguous."""

    def __init__(self) -> None:
        self._by_url: dict[str, tuple[str, Target, UpstreamPool]] = {}
        self._url_of: dict[str, tuple[str, str]] = {}  # name -> (url, YAML path)

    def add(self, target: Target, pool: UpstreamPool, path: str, r: _Reader) -> None:
        seen = self._by_url.get(target.url)
        if seen is not None:
            where, other, other_pool = seen
            if other.name != target.name:
                r.fail(path, f"{target.url} is named {other.name!r} at {where}; a target has one name")
            if (other_pool.health, other_pool.passive) != (pool.health, pool.passive):
                r.fail(
                    path,
                    f"{target.url} has other health or passive settings at {where}; every route naming a target "
                    "shares its state, so they must match (a YAML anchor, &pool, shares one pool)",
                )
            return
        named = self._url_of.get(target.name)
        if named is not None:
            r.fail(path, f"name {target.name!r} is already {named[0]} at {named[1]}; each target needs its own name")
        self._by_url[target.url] = (path, target, pool)
        self._url_of[target.name] = (target.url, path)


def _pool(doc: Mapping[str, Any], path: str, shared: _SharedTargets, r: _Reader) -> UpstreamPool:
    spec = r.mapping(doc, path, required=("targets",), optional=("balance", "health", "passive", "retries"))
    items = r.sequence(spec["targets"], f"{path}.targets")
    if not items:
        r.fail(f"{path}.targets", "expected at least one target")
    targets = tuple(_target(item, f"{path}.targets[{i}]", r) for i, item in enumerate(items))
    for i, target in enumerate(targets):
        if any(t.url == target.url for t in targets[:i]):
            r.fail(f"{path}.targets[{i}]", f"{target.url} is listed twice; give it a weight instead")
    balance = _choice(Balance, spec.get("balance", Balance.ROUND_ROBIN.value), f"{path}.balance", r)
    passive_doc = spec.get("passive", {})
    pool = UpstreamPool(
        targets=targets,
        balance=balance,
        health=_health(spec["health"], f"{path}.health", r) if "health" in spec else None,
        # YAML 1.1 reads a bare `off` as false: both turn passive ejection off.
        passive=None if passive_doc is False or passive_doc == "off" else _passive(passive_doc, f"{path}.passive", r),
        retries=r.integer(spec.get("retries", DEFAULT_RETRIES), f"{path}.retries", minimum=0),
    )
    for i, target in enumerate(targets):
        shared.add(target, pool, f"{path}.targets[{i}]", r)
    return pool


def _target(item: Any, path: str, r: _Reader) -> Target:
    if not isinstance(item, dict):
        url = _upstream_url(item, path, r)
        return Target(url=url, name=_address(url))
    spec = r.mapping(item, path, required=("url",), optional=("weight", "name"))
    url = _upstream_url(spec["url"], f"{path}.url", r)
    name = spec.get("name", _address(url))
    if not isinstance(name, str) or not _TARGET_NAME_RE.match(name):
        r.fail(f"{path}.name", f"target names may use letters, digits and '_.:-[]' only, got {name!r}")
    return Target(url=url, name=name, weight=r.integer(spec.get("weight", 1), f"{path}.weight", minimum=1))


def _address(url: str) -> str:
    """A target's default name: its host and port, as `10.0.0.5:9000` (the port its scheme implies if none)."""
    parts = urlsplit(url)
    host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
    return f"{host}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


def _health(doc: Any, path: str, r: _Reader) -> HealthCheck:
    spec = r.mapping(
        doc, path, required=("path",), optional=("interval", "timeout", "unhealthy_after", "healthy_after")
    )
    check_path = r.string(spec["path"], f"{path}.path")
    if not _HEALTH_PATH_RE.match(check_path):
        r.fail(
            f"{path}.path", f"expected a path starting with / without spaces or control characters, got {check_path!r}"
        )
    health = HealthCheck(
        path=check_path,
        interval=r.parsed(parse_duration, spec.get("interval", DEFAULT_HEALTH_INTERVAL), f"{path}.interval"),
        timeout=r.parsed(parse_duration, spec.get("timeout", DEFAULT_HEALTH_TIMEOUT), f"{path}.timeout"),
        unhealthy_after=r.integer(
            spec.get("unhealthy_after", DEFAULT_UNHEALTHY_AFTER), f"{path}.unhealthy_after", minimum=1
        ),
        healthy_after=r.integer(spec.get("healthy_after", DEFAULT_HEALTHY_AFTER), f"{path}.healthy_after", minimum=1),
    )
    if health.timeout > health.interval:
        r.fail(
            f"{path}.timeout",
            f"a check's timeout ({health.timeout:g}s) may not exceed its interval ({health.interval:g}s)",
        )
    return health


def _passive(doc: Any, path: str, r: _Reader) -> PassiveEjection:
    spec = r.mapping(doc, path, optional=("eject_after", "eject_for"))
    return PassiveEjection(
        eject_after=r.integer(spec.get("eject_after", DEFAULT_EJECT_AFTER), f"{path}.eject_after", minimum=1),
        eject_for=r.parsed(parse_duration, spec.get("eject_for", DEFAULT_EJECT_FOR), f"{path}.eject_for"),
    )
