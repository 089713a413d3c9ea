"""The parsed config of Envoy's rate-limit service: each domain's descriptor tree, as
gateway.config.rls reads it from envoyproxy/ratelimit's files, with the gateway `Limit` of
each `rate_limit`. Immutable and trusted, as the rest of the parsed config."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.config.model import Limit
from gateway.config.units import Address


@dataclass(frozen=True, kw_only=True)
class RlsRateLimit:
    """One `rate_limit` of an envoyproxy/ratelimit config file, as the gateway counts it."""

    limit: Limit | None  # None: `unlimited: true`, never counted
    unit: str  # as Envoy's RateLimit.Unit names it, lower case: "second" ... "year"
    requests_per_unit: int  # 0: every request that costs anything is over the limit
    name: str = ""  # `rate_limit.name`, what another rate_limit's `replaces` refers to
    replaces: tuple[str, ...] = ()
    # The descriptor's `quota_mode` (without shadow_mode): `limit` is checked as a shadow one, and
    # its refusal refuses the request only when every quota-mode limit of it refuses.
    quota_mode: bool = False
    metadata: Mapping[str, Any] = field(default_factory=dict, compare=False)  # the descriptor's `metadata`
    charge_always: bool = False  # `charge: always`: every hit is charged, refused or not, into debt


@dataclass(frozen=True, kw_only=True)
class RlsDescriptor:
    """A node of a domain's descriptor tree: its rate limit, if it has one, and the nodes
    below it, by `key_value` for those with a value and by `key` for those without (any
    value matches, each value its own bucket). `wildcards`: the nodes whose value holds a
    `*`, in the order of the files, as (key, the value split on `*`, selector in children).
    `shared`: `share_threshold`, every value its wildcard matches counts in one bucket."""

    rate_limit: RlsRateLimit | None
    children: Mapping[str, RlsDescriptor] = field(default_factory=dict, compare=False)
    wildcards: tuple[tuple[str, tuple[str, ...], str], ...] = ()
    value: str = ""  # as written in the file: the pattern a shared node's buckets are keyed by
    shared: bool = False


@dataclass(frozen=True, kw_only=True)
class RlsConfig:
    """Envoy's rate-limit service (gateway.envoy): where it listens, and the descriptor trees
    of each domain, read from envoyproxy/ratelimit's YAML files at `config_path`."""

    listen: Address
    config_path: str
    domains: Mapping[str, RlsDescriptor] = field(compare=False)  # domain -> its root (no rate limit)
