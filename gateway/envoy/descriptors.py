"""Which configured rate limit a descriptor of Envoy's request falls under, as
envoyproxy/ratelimit finds it, and the `replaces` rule across a request's limits. Pure:
no I/O, no gRPC, so it is tested on its own.

A descriptor's entries walk down its domain's tree, one level per entry: an entry takes the
node `key_value`, else the longest `key: prefix*` its value starts with, else `key` (any
value). The limit is that of the node the last entry reaches; a walk that stops short, or
ends on a node without a rate_limit, matches nothing (the descriptor is answered OK and
counts nothing). Trusts the config; the entries are Envoy's, read as plain strings.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from gateway.config.model import RlsDescriptor, RlsRateLimit

Entries = Sequence[tuple[str, str]]  # a descriptor's (key, value) entries, in order


def rate_limit_of(domains: Mapping[str, RlsDescriptor], domain: str, entries: Entries) -> RlsRateLimit | None:
    """The rate limit the descriptor falls under, or None (an unknown domain: none)."""
    node = domains.get(domain)
    if node is None or not entries:
        return None
    for key, value in entries:
        found = node.children.get(f"{key}_{value}")
        if found is None and node.prefixes:
            best = -1
            for prefix_key, prefix, candidate in node.prefixes:
                if prefix_key == key and value.startswith(prefix) and len(prefix) > best:
                    found, best = candidate, len(prefix)
        if found is None:
            found = node.children.get(key)
        if found is None:
            return None
        node = found
    return node.rate_limit


def without_replaced(rate_limits: Sequence[RlsRateLimit | None]) -> list[RlsRateLimit | None]:
    """`rate_limits` with each one that another of them `replaces` (by name) left out."""
    replaced = {name for rl in rate_limits if rl is not None for name in rl.replaces}
    if not replaced:
        return list(rate_limits)
    return [None if rl is not None and rl.name and rl.name in replaced else rl for rl in rate_limits]


def identity_of(entries: Entries) -> str:
    """The bucket's identity: every entry's key and value, so each value of a `key`-only node
    counts apart, encoded so that no two different descriptors share one."""
    return "rls=" + json.dumps(entries, ensure_ascii=False, separators=(",", ":"))
