"""GET /config: the effective config as JSON data, every secret replaced by "***".

Trusts nothing but the config's own types: a field is shown as it is only when this
module knows it holds no secret, and a value of a type it does not know is redacted,
so a secret added to the config later cannot leak through this view by default.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
from typing import Any

from gateway.config.body_template import BodyTemplate
from gateway.config.model import (
    Allowlist,
    GatewayConfig,
    HeaderRules,
    IdentitySource,
    JwtKey,
    RlsConfig,
    RlsDescriptor,
    Route,
    StoreConfig,
    Tiers,
)
from gateway.config.pool_model import Target
from gateway.config.redaction import redacted_url
from gateway.config.regex import Regex
from gateway.config.units import Address, Rate

REDACTED = "***"

# What the effective config shows in place of each secret, by (class, field).
# A tier file's members and an allowlist's identities are API keys, or hashes of them.
_SECRET_FIELDS = {
    (StoreConfig, "key_secret"), (JwtKey, "key"), (GatewayConfig, "admin_token"), (Tiers, "members"),
    (Allowlist, "identities"),
}


_URL_FIELDS = {(StoreConfig, "url"), (Route, "upstream"), (Target, "url")}
_HEADER_VALUE_FIELDS = {(HeaderRules, "set"), (HeaderRules, "add")}
_RLS_TREES = {(RlsConfig, "domains"), (RlsDescriptor, "children")}


def redacted_config(config: GatewayConfig) -> Any:
    """The config as JSON data, with the store URL's password, key_secret, the JWT keys and
    the admin token replaced by "***". A value of a type not known here is redacted too, so a
    secret added later cannot leak through this view by default."""
    return _plain(config)


def _plain(value: Any, owner: type | None = None, field: str = "") -> Any:
    if (owner, field) in _SECRET_FIELDS:
        return None if value is None else REDACTED
    if (owner, field) in _URL_FIELDS and isinstance(value, str):  # a pool's URLs are its targets'
        return redacted_url(value)  # an upstream's userinfo is a credential as much as Redis's
    if (owner, field) in _HEADER_VALUE_FIELDS:
        # A header a route writes often carries a credential (`Authorization: ${TOKEN}`):
        # its name is shown, its value never.
        return [[name, REDACTED] for name, _ in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (Address, IdentitySource, Regex)):
        return str(value)
    if isinstance(value, Rate):
        return value.text
    if isinstance(value, BodyTemplate):
        return value.text
    if isinstance(value, (ipaddress.IPv4Network, ipaddress.IPv6Network)):
        return str(value)
    if isinstance(value, (tuple, list)):
        return [_plain(item) for item in value]
    if isinstance(value, frozenset):
        return sorted(_plain(item) for item in value)
    if owner is Tiers and field == "limits":
        return {tier: _plain(limit) for tier, limit in value.items()}
    if (owner, field) in _RLS_TREES:  # Envoy's descriptor trees: domains and entry selectors from the files
        return {name: _plain(node) for name, node in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        kind = type(value)
        return {f.name: _plain(getattr(value, f.name), kind, f.name) for f in dataclasses.fields(value)}
    return REDACTED
