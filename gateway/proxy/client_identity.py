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
(`jwt_identity`). `path` is the matched route's configured path, never the
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
HTTP_X_API_KEY) is rejected with 400, never normalised.
Only the sources read to find a limit's identity are judged, and only on
routes with limits. X-Forwarded-For and the gateway's own forwarding
headers are never stripped on the client's say (`headers.end_to_end`).
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import re
import string
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.config.model import ClientIpHeader, ClientIpStrategy, IdentitySource, IPNetwork, JwtConfig
from gateway.metrics import method_label
from gateway.proxy.headers import cgi_name
from gateway.proxy.jwt_identity import JwtVerifier, bearer_token, claim_value
from gateway.proxy.routing import request_host

# Addresses remembered with their parsed form and trust, so a returning client costs a
# dict hit instead of an ipaddress parse and format (~3 µs). Bounded because clients
# choose their addresses (an IPv6 /64 alone holds 2^64); when full it starts over.
ADDRESS_MEMO_SIZE = 4096
# The longest address text worth remembering: "[IPv6 with embedded IPv4]:port" is 53
# characters. Longer X-Forwarded-For entries are parsed each time, never kept.
ADDRESS_MEMO_KEY_CHARS = 64
_UNREAD: Any = object()  # a request's token claims, before anyone asked for them
GLOBAL_VALUE = "*"  # the one value of `global`, which every request shares
# The longest identity value a limit reads: API keys, session ids and JWT subjects are
# tens to a few hundred characters. A client choosing 8 KB keys would otherwise make the
# gateway hold 8 KB per key it remembers (denial cache, leases, the admin's top list).
MAX_IDENTITY_LENGTH = 1024


class IdentityRejected(Exception):
    """The client's identity cannot be read as the upstream would read it; the request is
    answered with `status` and never charged. `detail` names config, never client bytes."""

    status = 400
    title = "Bad Request"
    headers: Mapping[str, str] | None = None

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class IdentityTooLong(IdentityRejected):
    """An identity value past MAX_IDENTITY_LENGTH: 431, the status for a header too large,
    which is where such values come from (a query's gets the same, as nginx's 414 is for a
    whole target)."""

    status = 431
    title = "Request Header Fields Too Large"


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
        strategy: ClientIpStrategy = ClientIpStrategy(),
    ) -> None:
        self._trusted = tuple(trusted_proxies)
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
            for line_name in request.headers.keys():
                if not route.underscored and "_" not in line_name:
                    continue
                name = route.aliased.get(cgi_name(line_name))
                if name is not None and line_name.lower() != name:
                    raise IdentityRejected(
                        f"A header's name reads as {name} under CGI rules (`_` for `-`); this route reads the "
                        f"client's identity from {name}, and the upstream could take that header for it."
                    )
        claims = [_UNREAD]  # the bearer token's, verified on first use
        found: list[str] = []
        for key in route.keys:
            identity = None
            for source, prefix, reading in key.sources:
                if reading == _CLIENT_IP:
                    value: str | None = client_ip
                elif reading == _HEADER:
                    value = single_header(request, source.name, source.name)
                else:
                    value = self._read(request, source, route, client_ip, claims)
                if value:
                    if len(value) > MAX_IDENTITY_LENGTH:
                        raise IdentityTooLong(
                            f"The client's identity (from {source.kind}) is longer than "
                            f"{MAX_IDENTITY_LENGTH} characters."
                        )
                    identity = prefix + value
                    break
            found.append(identity or "ip=" + client_ip)
        return found

    def _read(
        self, request: web.BaseRequest, source: IdentitySource, route: RouteIdentity, client_ip: str, claims: list[Any]
    ) -> str | None:
        """The value of one source for this request, or None when it is absent."""
        kind = source.kind
        if kind == "composite":
            values = []
            for part in source.parts:
                value = self._read(request, part, route, client_ip, claims)
                if not value:
                    return None  # the entry is present only with all its parts
                values.append(value)
            return composite_value(values)
        if kind == "ip":
            return ip_group(client_ip, source.ipv4_prefix, source.ipv6_prefix)
        if kind == "global":
            return GLOBAL_VALUE
        if kind == "path":
            return route.path
        if kind == "method":
            return method_label(request.method)
        if kind == "host":
            return request_host(request.headers.get("Host", "")) or None
        if kind == "jwt":
            if claims[0] is _UNREAD:
                claims[0] = self._claims(request)
            return claim_value(claims[0], source.name) if claims[0] is not None else None
        return _value(request, source)

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


def single_header(request: web.BaseRequest, name: str, shown: str) -> str | None:
    """The header `name` (lower case), or None; IdentityRejected if it is given twice or holds
    characters outside visible ASCII, which the upstream might read otherwise."""
    values = request.headers.getall(name, ())
    if len(values) == 1 and _visible_or_empty(values[0]):
        return values[0] or None  # the usual case, without forming the name an error would show
    return _only(values, f"The {shown} header") or None


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
        return single_header(request, source.name, source.name)
    if source.kind == "query":
        raw = request.rel_url.raw_query_string
        if raw and (not _visible(raw) or " " in raw):
            # Raw bytes outside ASCII are re-encoded on the way out: `?\x80key=a` has no `key`
            # here, but may have one at the upstream.
            raise _not_visible("The query string")
        if ";" in raw and _named_after_semicolon(raw, source.name):
            # Rack 2 and Python's parse_qs before 3.9.2 split a query on ";" too: to them
            # `key=a&x=1;key=b` names the key twice, and the last one counts.
            raise _given_twice(f"The query parameter {source.name!r}")
        value = _only(request.rel_url.query.getall(source.name, ()), f"The query parameter {source.name!r}")
        if value is None:
            return None
        if ";" in value:
            # Some servers split a query on ";" too, and would read a different value.
            raise IdentityRejected(f"The query parameter {source.name!r} contains ';'.")
        return value or None
    return _cookie(request, source.name)


def _named_after_semicolon(query: str, name: str) -> bool:
    """Whether a parameter called `name` follows a ";" in the raw `query`, where only servers
    that split on ";" see it."""
    return any(
        urllib.parse.unquote_plus(piece.partition("=")[0]) == name
        for pair in query.split("&")
        for piece in pair.split(";")[1:]
    )


def _visible(value: str) -> bool:
    """Whether non-empty `value` is visible ASCII, with spaces inside ("Bearer x") but not at
    the ends, where HTTP parsers trim them: what the upstream reads exactly as the gateway
    does. (str methods run in C; a regex took three times as long.)"""
    return value.isascii() and value.isprintable() and value[0] != " " and value[-1] != " "


def _visible_or_empty(value: str) -> bool:
    return not value or _visible(value)


def _given_twice(what: str) -> IdentityRejected:
    return IdentityRejected(f"{what} appears more than once; it identifies the client, so it may appear once.")


def _not_visible(what: str) -> IdentityRejected:
    return IdentityRejected(f"{what} has characters outside visible ASCII; it identifies the client.")


def _cookie(request: web.BaseRequest, name: str) -> str | None:
    """The cookie called `name`, read as browsers send them (RFC 6265 §5.4): `name=value`
    pairs split on ";". http.cookies gives up on the whole header at the first value it
    dislikes (JSON, a space), which would silently key such clients by IP instead. A name
    given twice is rejected: servers differ on whether the first or the last one counts; so
    is the name percent-encoded, or a value escape no encoder writes (`%61`), since many
    servers decode them."""
    found: str | None = None
    seen = False
    for header in request.headers.getall("Cookie", ()):
        # The whole line: a byte outside ASCII in another cookie's name could be dropped on
        # the way out and make it `name`.
        if header and not _visible(header):
            raise _not_visible("The Cookie header")
        for pair in header.split(";"):
            key, sep, value = pair.partition("=")
            key = key.strip()
            if sep and "%" in key and key != name and urllib.parse.unquote(key) == name:
                raise IdentityRejected(f"A cookie's name is {name!r} percent-encoded, which the upstream may decode.")
            if sep and key == name:
                if seen:
                    raise _given_twice(f"The cookie {name!r}")
                seen = True
                value = value.strip()
                if len(value) >= 2 and value[0] == value[-1] == '"':
                    value = value[1:-1]
                if "%" in value and _needless_escape(value):
                    raise IdentityRejected(
                        f"The cookie {name!r} has a percent-encoded letter, digit, '-', '.' or '_', or a "
                        "lower-case escape; the upstream may decode it to another client's value."
                    )
                found = value
    return found or None


# An escape no cookie encoder writes (encodeURIComponent, PHP's urlencode, Rack's escape all
# leave letters, digits, "-", "." and "_" alone and write upper-case hex), yet one that PHP
# and Rack (names and values) and Express (values) decode: `sid=%61bc` is their session `abc`
# in a bucket of its own, and each character escaped or not would give one session
# 2^length buckets. Escapes an encoder does write (`s%3A...`) stay as they are.
_ESCAPE = re.compile(r"%([0-9A-Fa-f]{2})")
_NEVER_ESCAPED = frozenset(string.ascii_letters + string.digits + "-._")


def _needless_escape(value: str) -> bool:
    return any(h != h.upper() or chr(int(h, 16)) in _NEVER_ESCAPED for h in _ESCAPE.findall(value))
