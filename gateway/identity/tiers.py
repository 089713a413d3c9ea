"""Which limit a client is held to: none (it is allowlisted), its tier's, or the limit itself.

Trusts the config and the identity gateway.identity.sources read. A tier header is
believed only when the connecting peer is a trusted proxy: the authenticator in
front sets it, and must overwrite any the client sent; from any other peer it
is ignored and the client gets the default tier, so a client can never name
its own tier. A key file's tiers match the value the limit's key read (the API
key, for `key: [header:X-API-Key]`), compared as sha256 hex so the file may
hold keys hashed. A tier's limit is named `LIMIT/TIER`, so a client moved to
another tier starts on a fresh bucket of that tier's capacity.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from aiohttp import web

from gateway.config.model import Limit
from gateway.identity.sources import parse_ip
from gateway.identity.values import single_header
from gateway.limiter.decision import Decision, LimitStatus
from gateway.limiter.outcomes import ALLOWLISTED
from gateway.limiter.store import LimitCheck


def held_to(limit: Limit, identity: str, client_ip: str, tier_header: str | None) -> Limit | None:
    """The limit a request with this identity ("source=value") and client address is checked
    against, or None if `limit.allow` names it. `tier_header` is the tier header's value as
    a trusted proxy sent it, else None."""
    allow = limit.allow
    if allow is not None:
        if identity in allow.identities:
            return None
        if allow.networks:
            address = parse_ip(client_ip)
            if address is not None and any(address in network for network in allow.networks):
                return None
    tiers = limit.tiers
    if tiers is not None and tiers.header is not None:
        return tiers.limits.get(tier_header, limit) if tier_header else limit
    return tier_of(limit, identity.partition("=")[2])


def tier_header(request: web.BaseRequest, limit: Limit, trusted: bool) -> str | None:
    """The tier a trusted proxy names for this request, if `limit` reads tiers from a header.
    Raises IdentityRejected when it is given twice: which line a hop wrote is unknowable."""
    tiers = limit.tiers
    if tiers is None or tiers.header is None or not trusted:
        return None
    return single_header(request, tiers.header, tiers.header)


def tier_of(limit: Limit, value: str) -> Limit:
    """The limit a key file puts the identity value `value` in (the admin API's default)."""
    tiers = limit.tiers
    if tiers is None or tiers.header is not None:
        return limit
    tier = tiers.members.get(hashlib.sha256(value.encode("utf-8", "surrogateescape")).hexdigest())
    return tiers.limits.get(tier, limit) if tier else limit


def with_allowlisted(decision: Decision, checks: Sequence[LimitCheck], held: Sequence[Limit | None]) -> Decision:
    """`decision` for the checked limits, with an `allowlisted` status in the place of each
    limit `held` is None for; `checks` are all the request's limits, in order."""
    checked = iter(decision.statuses)
    statuses = tuple(
        LimitStatus(c.limit, c.cost, None, ALLOWLISTED) if h is None else next(checked) for c, h in zip(checks, held)
    )
    return Decision(
        allowed=decision.allowed,
        statuses=statuses,
        retry_after=decision.retry_after,
        store_failed=decision.store_failed,
        wait=decision.wait,  # a mode: delay limit charged into its debt: the request must still wait
    )
