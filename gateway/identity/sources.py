"""Who the client is, for rate limiting.

Trust model: the connecting peer is the client, unless the peer is one of
`trusted_proxies`. Only then is the header `client_ip.header` names believed
(X-Forwarded-For by default, X-Real-IP, or RFC 7239 Forwarded's `for=`): a
list is merged over its lines and read right to left, skipping trusted
addresses, and the first untrusted address is the client. Entries left of it
were written by the client and are never believed, so a forged header from an
untrusted peer changes nothing. With `client_ip.depth: N` the operator says
the N right-most entries were written by trusted hops, and the N-th from the
right is the client whatever its address. Header, query and cookie values are
whatever the client sent; they are only ever hashed (`gateway.limiter.keys`),
never used as keys. A `jwt:CLAIM` is believed only from a token that verifies
(`gateway.identity.jwt`). `path` is the matched route's configured path, never the
request's, and `method` is one of a fixed set, so neither lets a client mint
buckets; `host` is the Host header, as routes match it, and is as much the
client's choice as any header unless the route names its host.

The identity charged must be the identity the upstream sees, so a value is
taken only when the upstream will receive exactly that value and no other:
a source given twice (two header lines, `?key=a&key=b`, two cookies of one
name), a value outside visible ASCII (which one parser reads as another
value, or drops), a `Connection` header naming an identity header (which
would be stripped as hop-by-hop), or a header whose name differs from an
identity header's only by `_` for `-` (CGI and WSGI servers read both as
HTTP_X_API_KEY) is rejected with 400, never normalised (a header, query or
cookie value is read by `gateway.identity.values`).
Only the sources read to find a limit's identity are judged, and only on
routes with limits. X-Forwarded-For and the gateway's own forwarding
headers are never stripped on the client's say (`headers.end_to_end`).

`part_value` turns what a request carried for one source into the value keyed
on; the admin API reads an operator's values through it too (`identity_value`),
so it names exactly the bucket the proxy charges.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from aiohttp import web

from gateway.config.http_names import cgi_name, request_host
from gateway.config.model import DEFAULT_IDENTITY_MAX_LENGTH, ClientIpHeader, ClientIpStrategy, IdentitySource, IPNetwork, JwtConfig
from gateway.identity.jwt import JwtVerifier, bearer_token, claim_value
from gateway.identity.methods import method_label
from gateway.identity.values import IdentityRejected, sent_value, single_header

# Addresses remembered with their parsed form and trust, so a returning client costs a
# dict hit instead of an ipaddress parse and format (~3 µs). Bounded because clients
# choose their addresses (an IPv6 /64 alone holds 2^64); when full it starts over.
ADDRESS_MEMO_SIZE = 4096
# The longest address text worth remembering: "[IPv6 with embedded IPv4]:port" is 53
# characters. Longer X-Forwarded-For entries are parsed each time, never kept.
ADDRESS_MEMO_KEY_CHARS = 64
_UNREAD: Any = object()  # a request's token claims, before anyone asked for them
GLOBAL_VALUE = "*"  # the one value of `global`, which every request shares
DEFAULT_STRATEGY = ClientIpStrategy()  # X-Forwarded-For from trusted proxies, as a config without `client_ip` says
class IdentityTooLong(IdentityRejected):
    """An identity value past the cap: 431, the status for a header too large, which is
    where such values come from (a query's gets the same, as nginx's 414 is for a whole
    target)."""

    status = 431
    title = "Request Header Fields Too Large"


class TokenRejected(IdentityRejected):
    status = 401
    title = "Unauthorized"
    headers: ClassVar[Mapping[str, str] | None] = {"WWW-Authenticate": 'Bearer error="invalid_token"'}


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


@functools.lru_cache(maxsize=ADDRESS_MEMO_SIZE)
def ip_group(client: str, ipv4_prefix: int, ipv6_prefix: int) -> str:
    """The network of `client` (an address as the gateway writes it) that `ip/V4,V6` keys it by,
    such as 192.0.2.0/24; a client that is not an address (a Unix socket peer) stays itself."""
    try:
        address = ipaddress.ip_address(client)
    except ValueError:
        return client
    prefix = ipv4_prefix if address.version == 4 else ipv6_prefix
    return str(ipaddress.ip_network((address, prefix), strict=False))


def composite_value(values: Sequence[str]) -> str:
    """The parts of a composite identity as one value, one way only: `%` and `,` in a part are
    escaped, so ("a,b", "c") and ("a", "b,c") never share a bucket."""
    return ",".join(v.replace("%", "%25").replace(",", "%2C") for v in values)


# How identities() reads a source, decided once per source: the two common kinds inline.
_CLIENT_IP, _HEADER, _OTHER = range(3)


@dataclass(frozen=True, slots=True)
class IdentityKey:
    """A limit's `key`, compiled once: each source beside its "source=" prefix and how it is read."""

    sources: tuple[tuple[IdentitySource, str, int], ...]

    @classmethod
    def of(cls, sources: Sequence[IdentitySource]) -> IdentityKey:
        return cls(sources=tuple((source, f"{source}=", _reading(source)) for source in sources))


def _reading(source: IdentitySource) -> int:
    if source.kind == "ip" and source.ipv4_prefix == 32 and source.ipv6_prefix == 128:
        return _CLIENT_IP  # the whole address: the client's address as it is
    if source.kind == "header":
        return _HEADER
    return _OTHER


def part_value(source: IdentitySource, sent: str) -> str:
    """The value a single (not composite) source is keyed on, from what the request carried
    for it: the client's address as the gateway writes it (`ip`), the method, the Host
    header, the route's configured path, or the header, query, cookie or claim value.
    Empty when the source is absent."""
    kind = source.kind
    if kind == "ip":
        return ip_group(sent, source.ipv4_prefix, source.ipv6_prefix)
    if kind == "method":
        return method_label(sent)
    if kind == "host":
        return request_host(sent)
    if kind == "global":
        return GLOBAL_VALUE
    return sent


def identity_value(source: IdentitySource, sent: Sequence[str]) -> str:
    """The value a request that carried `sent` (one per leaf of `source`, in order, each
    non-empty) would be keyed on: the admin API's reading of an operator's values. An
    address may be written as a client's would arrive (with a port, IPv4-mapped) and a
    method in any case; ValueError if an `ip` value is not an address."""
    if source.kind == "global":
        return GLOBAL_VALUE
    if _reading(source) == _CLIENT_IP:
        return _address(sent[0])  # as identities() keys it: the address itself, not its /32
    values = [part_value(part, _as_carried(part, value)) for part, value in zip(source.leaves, sent)]
    return composite_value(values) if source.kind == "composite" else values[0]


def _as_carried(source: IdentitySource, value: str) -> str:
    """An operator's value for `source` as a request carries it to part_value."""
    if source.kind == "ip":
        return _address(value)
    if source.kind == "method":
        return value.upper()
    return value


def _address(text: str) -> str:
    """An address as the gateway writes a client's (`parse_ip`), or ValueError."""
    address = parse_ip(text)
    if address is None:
        raise ValueError("The value of an ip source must be an IP address.")
    return str(address)


@dataclass(frozen=True, slots=True)
class RouteIdentity:
    """What a route's limits read, compiled once: each limit's key, and the request headers
    those keys read, which a `Connection` header may not name (lower case -> as configured)."""

    keys: tuple[IdentityKey, ...]
    guarded: Mapping[str, str]
    path: str = "/"  # the route's configured path, which `path` sources read
    # Guarded headers by their CGI name (`_` as `-`, lower case), for those with a `-` or `_`.
    aliased: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # Whether a guarded name has a `_`: else only a name with one can alias it, the common test.
    underscored: bool = False

    @classmethod
    def of(cls, keys: Sequence[IdentityKey], path: str = "/") -> RouteIdentity:
        guarded: dict[str, str] = {}
        for key in keys:
            for entry, _, _ in key.sources:
                for source in entry.leaves:
                    if source.kind == "header":
                        guarded[source.name] = source.name
                    elif source.kind == "cookie":
                        guarded["cookie"] = "Cookie"
                    elif source.kind == "jwt":
                        guarded["authorization"] = "Authorization"
        aliased = {cgi_name(name): name for name in guarded if "-" in name or "_" in name}
        underscored = any("_" in name for name in guarded)
        return cls(keys=tuple(keys), guarded=guarded, path=path, aliased=aliased, underscored=underscored)


class ClientIdentity:
    def __init__(
        self,
        trusted_proxies: Sequence[IPNetwork],
        jwt: JwtConfig | None = None,
        strategy: ClientIpStrategy = DEFAULT_STRATEGY,
        max_length: int = DEFAULT_IDENTITY_MAX_LENGTH,
    ) -> None:
        self._trusted = tuple(trusted_proxies)
        self._max_length = max_length
        self._strategy = strategy
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
        client = peer or peer_text
        header = self._strategy.header
        if header is ClientIpHeader.X_REAL_IP:
            value = single_header(request, "x-real-ip", "X-Real-IP")
            return (self.address(value)[0] if value else None) or client
        shown = "X-Forwarded-For" if header is ClientIpHeader.X_FORWARDED_FOR else "Forwarded"
        lines = request.headers.getall(shown, ())
        for line in lines:
            # Bytes outside ASCII are re-encoded on the way out, so "\x801.2.3.4", garbage
            # that stops the walk here, could reach the upstream as an address.
            if not line.isascii() or not line.isprintable():
                raise IdentityRejected(f"The {shown} header has characters outside visible ASCII.")
        if header is ClientIpHeader.X_FORWARDED_FOR:
            entries = [e for e in (e.strip() for line in lines for e in line.split(",")) if e]
        else:
            entries = forwarded_for(lines)
        depth = self._strategy.depth
        if depth is not None:
            if not entries:
                return client
            # Fewer entries than hops: every one was written by a trusted hop, the first
            # by the hop the client reached, so the left-most is the client.
            return self.address(entries[-min(depth, len(entries))])[0] or client
        for entry in reversed(entries):
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
        if route.aliased:
            for line_name in request.headers:
                if not route.underscored and "_" not in line_name:
                    continue
                name = route.aliased.get(cgi_name(line_name))
                if name is not None and line_name.lower() != name:
                    raise IdentityRejected(
                        f"A header's name reads as {name} under CGI rules (`_` for `-`); this route reads the "
                        f"client's identity from {name}, and the upstream could take that header for it."
                    )
        claims = [_UNREAD]  # the bearer token's, verified on first use
        max_length = self._max_length
        found: list[str] = []
        for key in route.keys:
            identity = None
            for source, prefix, reading in key.sources:
                # The two common readings inline: what part_value gives for them.
                if reading == _CLIENT_IP:
                    value: str | None = client_ip
                elif reading == _HEADER:
                    value = single_header(request, source.name, source.name)
                else:
                    value = self._read(request, source, route, client_ip, claims)
                if value:
                    if len(value) > max_length:
                        raise IdentityTooLong(
                            f"The client's identity (from {source.kind}) is longer than {max_length} characters."
                        )
                    identity = prefix + value
                    break
            found.append(identity or "ip=" + client_ip)
        return found

    def _read(
        self, request: web.BaseRequest, source: IdentitySource, route: RouteIdentity, client_ip: str, claims: list[Any]
    ) -> str | None:
        """The value of one source for this request; None or empty when it is absent."""
        if source.kind == "composite":
            values = []
            for part in source.parts:
                value = self._read(request, part, route, client_ip, claims)
                if not value:
                    return None  # the entry is present only with all its parts
                values.append(value)
            return composite_value(values)
        sent = self._carried(request, source, route, client_ip, claims)
        return part_value(source, sent) if sent is not None else None

    def _carried(
        self, request: web.BaseRequest, source: IdentitySource, route: RouteIdentity, client_ip: str, claims: list[Any]
    ) -> str | None:
        """What the request carried for one single source, before part_value keys it; None when absent."""
        kind = source.kind
        if kind == "ip":
            return client_ip
        if kind == "global":
            return GLOBAL_VALUE
        if kind == "path":
            return route.path
        if kind == "method":
            return request.method
        if kind == "host":
            return request.headers.get("Host", "")
        if kind == "jwt":
            if claims[0] is _UNREAD:
                claims[0] = self._claims(request)
            return claim_value(claims[0], source.name) if claims[0] is not None else None
        return sent_value(request, source)

    def _claims(self, request: web.BaseRequest) -> Mapping[str, Any] | None:
        """The verified claims of the request's bearer token; None without a valid one."""
        authorization = single_header(request, "authorization", "Authorization")
        token = bearer_token(authorization) if authorization else None
        if token is None:
            return None
        assert self._jwt is not None  # the loader refuses jwt: sources without a `jwt` block
        claims = self._jwt.claims(token)
        if claims is None and self._jwt.rejects:
            raise TokenRejected("The bearer token is invalid, expired or unsigned.")
        return claims


def forwarded_for(lines: Sequence[str]) -> list[str]:
    """The `for=` of each element of RFC 7239 Forwarded header lines, in order, unquoted
    (`for="[2001:db8::1]:443"`); "unknown" for an element without one, which, like an
    obfuscated `_name`, is no address and ends the walk. Commas and semicolons inside a
    quoted value (`host="a,for=1.2.3.4"`) separate nothing."""
    entries = []
    for line in lines:
        for element in _split_quoted(line, ","):
            if not element.strip():
                continue
            found = "unknown"
            for pair in _split_quoted(element, ";"):
                name, _, value = pair.partition("=")
                if name.strip().lower() == "for":
                    found = _unquoted(value.strip())
            entries.append(found)
    return entries


def _split_quoted(text: str, separator: str) -> list[str]:
    """`text` split at `separator` outside RFC 9110 quoted strings."""
    if '"' not in text:
        return text.split(separator)
    parts, start, quoted, escaped = [], 0, False, False
    for i, c in enumerate(text):
        if escaped:
            escaped = False
        elif quoted and c == "\\":
            escaped = True
        elif c == '"':
            quoted = not quoted
        elif c == separator and not quoted:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _unquoted(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] == '"':
        return re.sub(r"\\(.)", r"\1", value[1:-1])
    return value.strip('"')
