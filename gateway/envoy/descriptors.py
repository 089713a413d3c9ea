"""Which configured rate limit a descriptor of Envoy's request falls under, as
envoyproxy/ratelimit finds it, the bucket it counts in, the `replaces` rule across a
request's limits, and the request's overall code (`quota_mode`). Pure: no I/O, no gRPC, so
it is tested on its own.

A descriptor's entries walk down its domain's tree, one level per entry: an entry takes the
node `key_value`, else the first node of its key, in the files' order, whose value pattern
(`*` matching any run of characters, the empty one too) matches the entry's value, else
`key` (any value). The limit is that of the node the last entry reaches; a walk that stops
short, or ends on a node without a rate_limit, matches nothing (the descriptor is answered
OK and counts nothing). A bucket is keyed by the descriptor's entries, except that an entry
that reached a `share_threshold` node is keyed by that node's pattern, so every value the
pattern matches counts in one bucket. Trusts the config; the entries are Envoy's, read as
plain strings.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from gateway.config.model import RlsDescriptor, RlsRateLimit

Entries = Sequence[tuple[str, str]]  # a descriptor's (key, value) entries, in order


def rate_limit_of(
    domains: Mapping[str, RlsDescriptor], domain: str, entries: Entries
) -> tuple[RlsRateLimit | None, Entries]:
    """The rate limit the descriptor falls under, or None (an unknown domain: none), and
    the entries its bucket is keyed by (identity_of)."""
    node = domains.get(domain)
    if node is None or not entries:
        return None, entries
    keyed = entries
    for i, (key, value) in enumerate(entries):
        found = node.children.get(f"{key}_{value}")
        if found is None and node.wildcards:
            for wildcard_key, parts, selector in node.wildcards:
                if wildcard_key == key and wildcard_matches(parts, value):
                    found = node.children[selector]
                    if found.shared:
                        keyed = list(keyed)
                        keyed[i] = (key, found.value)
                    break
        if found is None:
            found = node.children.get(key)
        if found is None:
            return None, entries
        node = found
    return node.rate_limit, keyed


def wildcard_matches(parts: Sequence[str], value: str) -> bool:
    """Whether `value` matches the pattern whose text between its `*`s is `parts` (at least
    two of them): it starts with the first, ends with the last, and holds the others in
    order between them, none overlapping another."""
    first, *middle, last = parts
    if len(value) < sum(map(len, parts)) or not value.startswith(first) or not value.endswith(last):
        return False
    at, end = len(first), len(value) - len(last)
    for part in middle:
        found = value.find(part, at, end)
        if found < 0:
            return False
        at = found + len(part)
    return True


def without_replaced(rate_limits: Sequence[RlsRateLimit | None]) -> list[RlsRateLimit | None]:
    """`rate_limits` with each one that another of them `replaces` (by name) left out."""
    replaced = {name for rl in rate_limits if rl is not None for name in rl.replaces}
    if not replaced:
        return list(rate_limits)
    return [None if rl is not None and rl.name and rl.name in replaced else rl for rl in rate_limits]


def request_over_limit(rate_limits: Sequence[RlsRateLimit | None], over: Sequence[bool]) -> bool:
    """The request's overall code, as envoyproxy/ratelimit decides it from its descriptors'
    (`over`, matched with `rate_limits` after `replaces`): over when a descriptor not in
    quota mode is over its limit, or when there are quota-mode descriptors and every one is."""
    quota = []
    for rate_limit, is_over in zip(rate_limits, over, strict=True):
        if rate_limit is not None and rate_limit.quota_mode and rate_limit.limit is not None:
            quota.append(is_over)
        elif is_over:
            return True
    return bool(quota) and all(quota)


def identity_of(entries: Entries) -> str:
    """The bucket's identity: every entry's key and value, so each value of a `key`-only node
    counts apart, encoded so that no two different descriptors share one."""
    return "rls=" + json.dumps(entries, ensure_ascii=False, separators=(",", ":"))
