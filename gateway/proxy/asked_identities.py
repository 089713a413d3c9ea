"""Who a request is, as the decision core asks it of the proxy and the decision listener:
the identity of each of the route's limits, what tiers and allowlists hold the client to,
and the identities its concurrency leases are taken under. Read from the request as
gateway.identity's trust model says (its client address through the trusted proxies,
a tier header only from one of them). Raises IdentityRejected, before anything is charged."""

from __future__ import annotations

from collections.abc import Sequence

from aiohttp import web

from gateway.config.model import Limit
from gateway.identity.sources import ClientIdentity
from gateway.identity.tiers import held_to, tier_header
from gateway.proxy.access_log import AccessRecord
from gateway.proxy.route_plan import RoutePlan

_NONE: tuple[str, ...] = ()


def rate_identities(
    request: web.BaseRequest, plan: RoutePlan, identity: ClientIdentity, record: AccessRecord
) -> tuple[Sequence[str], Sequence[Limit | None] | None]:
    """The identity of each rate limit of the route, and (for a route with tiers or an
    allowlist) the limit each holds this client to. Notes the client address in `record`."""
    limits = plan.decision.limits
    if not limits:
        return _NONE, None
    client_ip = record.client = identity.client_ip(request)
    identities = identity.identities(request, plan.identity, client_ip)
    if not plan.decision.classified:
        return identities, None
    trusted = identity.address(request.remote or "")[1]
    held = [
        held_to(lp.limit, who, client_ip, tier_header(request, lp.limit, trusted)) if lp.classified else lp.limit
        for lp, who in zip(limits, identities)
    ]
    return identities, held


def lease_identities(request: web.BaseRequest, plan: RoutePlan, identity: ClientIdentity, record: AccessRecord) -> Sequence[str]:
    """The identity of each concurrency limit of the route."""
    client_ip = record.client or identity.client_ip(request)
    record.client = client_ip
    return identity.identities(request, plan.concurrency_identity, client_ip)
