"""The admin API's client routes: read and reset one client's bucket or leases
(`/buckets/{limit}`), and the clients this process denied most (`/top-limited`).

Trusts its caller: app.py mounts it behind the Host check and the bearer token.
The identity a query names is read by the gateway's own rules, as a request's would
be (`gateway.identity.sources.identity_value`), and shown hashed (keyed by the process's
secret, `gateway.limiter.keys.PROCESS_SECRET`) unless `admin_raw_identities`.
"""

from __future__ import annotations

import time
from typing import Any, cast

from aiohttp import web

from gateway.config.model import ConcurrencyLimit, GatewayConfig, IdentitySource, Limit
from gateway.decision.problems import PROBLEM_CONTENT_TYPE, problem_body
from gateway.identity.sources import identity_value
from gateway.identity.tiers import tier_of
from gateway.limiter.keys import PROCESS_SECRET, HeldByDigest, identity_digest
from gateway.limiter.limiter import Limiter
from gateway.limiter.store import StoreError

DEFAULT_TOP = 10


class BucketApi:
    """The routes on one client's buckets and leases, and /top-limited; a reload hands it the new config."""

    def __init__(self, config: GatewayConfig, limiter: Limiter) -> None:
        self._limiter = limiter
        self.update(config)
        # Stable while the gateway runs, and alike in every worker (drawn before the fork), so
        # an operator can match a client's inspect answer to its line in the top list.
        self._secret = PROCESS_SECRET

    def update(self, config: GatewayConfig) -> None:
        """Answer from `config` from now on (a reload)."""
        self._config = config
        limits: list[Limit | ConcurrencyLimit] = [*config.limits, *config.concurrency_limits]
        self._limits: dict[str, Limit | ConcurrencyLimit] = {limit.name: limit for limit in limits}

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_get("/buckets/{limit}", self.inspect)
        router.add_delete("/buckets/{limit}", self.reset)
        router.add_get("/top-limited", self.top_limited)

    async def inspect(self, request: web.Request) -> web.Response:
        limit, identity = self._bucket_of(request)
        try:
            if isinstance(limit, ConcurrencyLimit):
                found = await self._leases_of(limit, identity)
            else:
                found = await self._bucket_state(limit, identity)
        except StoreError as exc:
            raise _store_unavailable(exc) from None
        return web.json_response(
            {**self._describe(limit, identity), **found, "store": self._limiter.store.description}
        )

    async def _bucket_state(self, limit: Limit, identity: str) -> dict[str, Any]:
        reading = await self._limiter.read_bucket(limit, identity)
        return {
            "key": reading.key,
            "held": reading.held,
            "tokens": reading.tokens,
            "capacity": limit.burst,
            "rate": limit.rate.text,
            "full_in_seconds": reading.full_in,
            # Below zero: a cost settled after its response took more than the bucket held. Every
            # request is refused until it has refilled past zero, in debt_clears_in_seconds.
            "debt": max(0.0, -reading.tokens),
            "debt_clears_in_seconds": max(0.0, -reading.tokens) / limit.rate.per_second,
            "denied_here_for_seconds": self._limiter.denied_here_for(limit, identity),
        }

    async def _leases_of(self, limit: ConcurrencyLimit, identity: str) -> dict[str, Any]:
        reading = await self._limiter.concurrency.read(limit, identity)
        return {
            "key": reading.key,
            "in_flight": reading.in_flight,
            "concurrency": limit.concurrency,
            "lease_ttl_seconds": limit.lease_ttl,
            # Were no lease renewed (their gateway died): when the first is freed, and the last.
            "next_lease_expires_in_seconds": reading.next_expiry_in,
            "last_lease_expires_in_seconds": reading.last_expiry_in,
        }

    async def reset(self, request: web.Request) -> web.Response:
        limit, identity = self._bucket_of(request)
        try:
            if isinstance(limit, ConcurrencyLimit):
                held = await self._limiter.concurrency.reset(limit, identity)
            else:
                held = await self._limiter.reset_bucket(limit, identity)
        except StoreError as exc:
            raise _store_unavailable(exc) from None
        return web.json_response({**self._describe(limit, identity), "reset": True, "held": held})

    async def top_limited(self, request: web.Request) -> web.Response:
        sketch = self._limiter.top_limited
        text = request.query.get("n", str(DEFAULT_TOP))
        # isdigit alone takes "²", and int() refuses digit strings past 4300 characters.
        if not (text.isascii() and text.isdigit() and len(text) <= 9) or not 1 <= int(text) <= sketch.capacity:
            raise _bad_request(f"n must be a whole number from 1 to {sketch.capacity}.")
        clients = []
        for hit in sketch.top(int(text), time.monotonic()):
            # The limiter records (limit name, identity as listed_identity keeps it).
            name, identity = cast(tuple[str, str | HeldByDigest], hit.key)
            clients.append({"limit": name, "identity": self._shown(identity), "denials": hit.count, "error": hit.error})
        return web.json_response(
            {
                "window_seconds": sketch.window,
                "identities": "raw" if self._config.admin_raw_identities else "hashed",
                "clients": clients,
            }
        )

    def _bucket_of(self, request: web.Request) -> tuple[Limit | ConcurrencyLimit, str]:
        """The limit (a bucket's, with its tier, or a concurrency limit) and identity
        ("source=value") a request names, or a 400 or 404."""
        name = request.match_info["limit"]
        limit = self._limits.get(name)
        if limit is None:
            raise _problem(web.HTTPNotFound, "Not Found", f"No limit is named {name!r}.", limits=sorted(self._limits))
        # A client with none of the key's sources is limited by address (identity.sources); a
        # key with a source every request has (ip/24, path) never is.
        fallback = () if any(s.always_present for s in limit.key) else (IdentitySource(kind="ip"),)
        sources = {str(s): s for s in (*limit.key, *fallback)}
        given = request.query.get("source")
        if given is None:
            if len(limit.key) > 1:
                raise _bad_request(
                    f"Limit {name!r} is keyed on several sources; name one with ?source=.", sources=list(sources)
                )
            source = limit.key[0]
        else:
            # Header names are matched as the loader keeps them, in lower case.
            normal = "+".join(p.lower() if p.lower().startswith("header:") else p for p in given.split("+"))
            found = sources.get(normal)
            if found is None:
                raise _bad_request(f"Limit {name!r} is not keyed on {given!r}.", sources=list(sources))
            source = found
        value = _identity_value(source, request.query.getall("value", []))
        identity = f"{source}={value}"
        tier = request.query.get("tier")
        if tier is None:
            return (limit if isinstance(limit, ConcurrencyLimit) else tier_of(limit, value)), identity
        tiers = limit.tiers.limits if isinstance(limit, Limit) and limit.tiers else {}
        if tier != "default" and tier not in tiers:
            raise _bad_request(f"Limit {name!r} has no tier {tier!r}.", tiers=["default", *tiers])
        return tiers.get(tier, limit), identity

    def _describe(self, limit: Limit | ConcurrencyLimit, identity: str) -> dict[str, Any]:
        source = identity.partition("=")[0]
        return {"limit": limit.name, "source": source, "identity": self._shown(identity)}

    def _shown(self, identity: str | HeldByDigest) -> str:
        if isinstance(identity, HeldByDigest):
            return str(identity)  # a long identity is kept hashed only, raw identities or not
        if self._config.admin_raw_identities:
            return identity
        source, _, _ = identity.partition("=")
        return f"{source}#{identity_digest(self._secret, identity)}"


def _identity_value(source: IdentitySource, values: list[str]) -> str:
    """The value a request would have given `source`, from the `value`s the operator gave."""
    parts = source.leaves
    if source.kind != "global" and (len(values) != len(parts) or not all(values)):
        shown = " and ".join(str(part) for part in parts)
        raise _bad_request(f"Give the client's value of {shown} as ?value=, once per part in that order, as sent.")
    try:
        return identity_value(source, values)
    except ValueError as exc:  # an ip value that is not an address
        raise _bad_request(str(exc)) from None


def _problem(kind: type[web.HTTPException], title: str, detail: str, **extra: Any) -> web.HTTPException:
    return kind(text=problem_body(kind.status_code, title, detail, **extra).decode(), content_type=PROBLEM_CONTENT_TYPE)


def _bad_request(detail: str, **extra: object) -> web.HTTPException:
    return _problem(web.HTTPBadRequest, "Bad Request", detail, **extra)


def _store_unavailable(exc: StoreError) -> web.HTTPException:
    return _problem(web.HTTPServiceUnavailable, "Service Unavailable", f"The store did not answer: {exc}")
