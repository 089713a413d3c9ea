"""Who the client is, for rate limiting.

Trust model: the connecting peer is the client, unless the peer is one of
`trusted_proxies`. Only then is X-Forwarded-For believed: all its lines are
merged and read right to left, skipping trusted addresses, and the first
untrusted address is the client. Entries left of it were written by the
client and are never believed, so a forged X-Forwarded-For from an untrusted
peer changes nothing. Header, query and cookie values are whatever the client
sent; they are only ever hashed (`gateway.limiter.keys`), never used as keys.
A `jwt:CLAIM` is believed only from a token that verifies (`jwt_identity`).

The identity charged must be the identity the upstream sees, so a value is
taken only when the upstream will receive exactly that value and no other:
a source given twice (two header lines, `?key=a&key=b`, two cookies of one
name), a value outside visible ASCII (which one parser reads as another
value, or drops), or a `Connection` header naming an identity header (which
would be stripped as hop-by-hop) is rejected with 400, never normalised.
Only the sources read to find a limit's identity are judged, and only on
routes with limits. X-Forwarded-For and the gateway's own forwarding
headers are never stripped on the client's say (`headers.end_to_end`).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.config.model import IdentitySource, IPNetwork, JwtConfig
from gateway.proxy.jwt_identity import JwtVerifier, bearer_token, claim_value

# Addresses remembered with their parsed form and trust, so a returning client costs a
# dict hit instead of an ipaddress parse and format (~3 µs). Bounded because clients
# choose their addresses (an IPv6 /64 alone holds 2^64); when full it starts over.
ADDRESS_MEMO_SIZE = 4096
# The longest address text worth remembering: "[IPv6 with embedded IPv4]:port" is 53
# characters. Longer X-Forwarded-For entries are parsed each time, never kept.
ADDRESS_MEMO_KEY_CHARS = 64
_UNREAD: Any = object()  # a request's token claims, before anyone asked for them


class IdentityRejected(Exception):
    """The client's identity cannot be read as the upstream would read it; the request is
    answered with `status` and never charged. `detail` names config, never client bytes."""

    status = 400
    title = "Bad Request"
    headers: Mapping[str, str] | None = None

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class TokenRejected(IdentityRejected):
    status = 401
    title = "Unauthorized"
    headers = {"WWW-Authenticate": 'Bearer error="invalid_token"'}


def parse_ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """A client address as the gateway keys it (port, zone id dropped; IPv4-mapped as IPv4), or None."""
    text = text.strip()
    if text.startswith("[") and "]" in text:  # "[2001:db8::1]:443"
        text = text[1 : text.index("]")]
    elif text.count(":") == 1:  # "192.0.2.1:443"
        text = text.partition(":")[0]
    # A zone id (`fe80::1%eth0`, `%25eth0` in a URL) names an interface of the host that
    # wrote it, not a different client: `%1`, `%2` and `%eth0` must share one bucket.
    text = text.partition("%")[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        return address.ipv4_mapped
    return address


@dataclass(frozen=True, slots=True)
class IdentityKey:
    """A limit's `key`, compiled once: each source beside its "source=" prefix."""

    sources: tuple[tuple[IdentitySource, str], ...]

    @classmethod
    def of(cls, sources: Sequence[IdentitySource]) -> IdentityKey:
        return cls(sources=tuple((source, f"{source}=") for source in sources))


@dataclass(frozen=True, slots=True)
class RouteIdentity:
    """What a route's limits read, compiled once: each limit's key, and the request headers
    those keys read, which a `Connection` header may not name (lower case -> as configured)."""

    keys: tuple[IdentityKey, ...]
    guarded: Mapping[str, str]

    @classmethod
    def of(cls, keys: Sequence[IdentityKey]) -> RouteIdentity:
        guarded: dict[str, str] = {}
        for key in keys:
            for source, _ in key.sources:
                if source.kind == "header":
                    guarded[source.name] = source.name
                elif source.kind == "cookie":
                    guarded["cookie"] = "Cookie"
                elif source.kind == "jwt":
                    guarded["authorization"] = "Authorization"
        return cls(keys=tuple(keys), guarded=guarded)


class ClientIdentity:
    def __init__(self, trusted_proxies: Sequence[IPNetwork], jwt: JwtConfig | None = None) -> None:
        self._trusted = tuple(trusted_proxies)
        self._jwt = JwtVerifier(jwt) if jwt is not None else None
        # address text -> (the address as we write it, or None if it is not one; trusted?)
        self._addresses: dict[str, tuple[str | None, bool]] = {}

    def address(self, text: str) -> tuple[str | None, bool]:
        """`text` (an address, with or without a port) as the gateway writes it, or None if it
        is not an address; and whether it is a trusted proxy."""
        known = self._addresses.get(text)
        if known is None:
            address = parse_ip(text)
            trusted = address is not None and any(address in network for network in self._trusted)
            known = (str(address) if address is not None else None, trusted)
            if len(text) <= ADDRESS_MEMO_KEY_CHARS:
                if len(self._addresses) >= ADDRESS_MEMO_SIZE:
                    self._addresses.clear()
                self._addresses[text] = known
        return known

    def client_ip(self, request: web.BaseRequest) -> str:
        peer_text = request.remote or ""
        peer, trusted = self.address(peer_text)
        if not trusted:
            return peer or peer_text
        lines = request.headers.getall("X-Forwarded-For", ())
        for line in lines:
            # Bytes outside ASCII are re-encoded on the way out, so "\x801.2.3.4", garbage
            # that stops the walk here, could reach the upstream as an address.
            if not line.isascii() or not line.isprintable():
                raise IdentityRejected("The X-Forwarded-For header has characters outside visible ASCII.")
        entries = [e.strip() for line in lines for e in line.split(",")]
        client = peer or peer_text
        for entry in reversed([e for e in entries if e]):
            address, trusted = self.address(entry)
            if address is None:
                # A trusted proxy passed on something that is not an address; stop believing here.
                break
            client = address
            if not trusted:
                break
        return client

    def identities(self, request: web.BaseRequest, route: RouteIdentity, client_ip: str) -> list[str]:
        """Each limit's identity, in order; raises IdentityRejected for a request whose identity
        the upstream could read otherwise."""
        if route.guarded and "Connection" in request.headers:
            for line in request.headers.getall("Connection"):
                for token in line.split(","):
                    name = route.guarded.get(token.strip().lower())
                    if name is not None:
                        raise IdentityRejected(
                            f"The Connection header names {name}, which this route reads the client's identity "
                            "from; it would be removed before the upstream saw it."
                        )
        claims = _UNREAD
        found: list[str] = []
        for key in route.keys:
            identity = None
            for source, prefix in key.sources:
                kind = source.kind
                if kind == "ip":
                    value: str | None = client_ip
                elif kind == "jwt":
                    if claims is _UNREAD:
                        claims = self._claims(request)
                    value = claim_value(claims, source.name) if claims is not None else None
                else:
                    value = _value(request, source)
                if value:
                    identity = prefix + value
                    break
            found.append(identity or "ip=" + client_ip)
        return found

    def _claims(self, request: web.BaseRequest) -> Mapping[str, Any] | None:
        """The verified claims of the request's bearer token; None without a valid one."""
        authorization = _single_header(request, "authorization", "Authorization")
        token = bearer_token(authorization) if authorization else None
        if token is None:
            return None
        assert self._jwt is not None  # the loader refuses jwt: sources without a `jwt` block
        claims = self._jwt.claims(token)
        if claims is None and self._jwt.rejects:
            raise TokenRejected("The bearer token is invalid, expired or unsigned.")
        return claims


def _single_header(request: web.BaseRequest, name: str, shown: str) -> str | None:
    return _only(request.headers.getall(name, ()), f"The {shown} header") or None


def _only(values: Sequence[str], shown: str) -> str | None:
    """The one value given, checked to be visible ASCII; None when there is none."""
    if not values:
        return None
    if len(values) > 1:
        raise _given_twice(shown)
    value = values[0]
    if value and not _visible(value):
        raise _not_visible(shown)
    return value


def _value(request: web.BaseRequest, source: IdentitySource) -> str | None:
    if source.kind == "header":
        return _single_header(request, source.name, source.name)
    if source.kind == "query":
        raw = request.rel_url.raw_query_string
        if raw and (not _visible(raw) or " " in raw):
            # Raw bytes outside ASCII are re-encoded on the way out: `?\x80key=a` has no `key`
            # here, but may have one at the upstream.
            raise _not_visible("The query string")
        value = _only(request.rel_url.query.getall(source.name, ()), f"The query parameter {source.name!r}")
        if value is None:
            return None
        if ";" in value:
            # Some servers split a query on ";" too, and would read a different value.
            raise IdentityRejected(f"The query parameter {source.name!r} contains ';'.")
        return value or None
    return _cookie(request, source.name)


def _visible(value: str) -> bool:
    """Whether non-empty `value` is visible ASCII, with spaces inside ("Bearer x") but not at
    the ends, where HTTP parsers trim them: what the upstream reads exactly as the gateway
    does. (str methods run in C; a regex took three times as long.)"""
    return value.isascii() and value.isprintable() and value[0] != " " and value[-1] != " "


def _given_twice(what: str) -> IdentityRejected:
    return IdentityRejected(f"{what} appears more than once; it identifies the client, so it may appear once.")


def _not_visible(what: str) -> IdentityRejected:
    return IdentityRejected(f"{what} has characters outside visible ASCII; it identifies the client.")


def _cookie(request: web.BaseRequest, name: str) -> str | None:
    """The cookie called `name`, read as browsers send them (RFC 6265 §5.4): `name=value`
    pairs split on ";". http.cookies gives up on the whole header at the first value it
    dislikes (JSON, a space), which would silently key such clients by IP instead. A name
    given twice is rejected: servers differ on whether the first or the last one counts."""
    found: str | None = None
    seen = False
    for header in request.headers.getall("Cookie", ()):
        # The whole line: a byte outside ASCII in another cookie's name could be dropped on
        # the way out and make it `name`.
        if header and not _visible(header):
            raise _not_visible("The Cookie header")
        for pair in header.split(";"):
            key, sep, value = pair.partition("=")
            if sep and key.strip() == name:
                if seen:
                    raise _given_twice(f"The cookie {name!r}")
                seen = True
                value = value.strip()
                if len(value) >= 2 and value[0] == value[-1] == '"':
                    value = value[1:-1]
                found = value
    return found or None
