"""Who the client is, for rate limiting.

Trust model: the connecting peer is the client, unless the peer is one of
`trusted_proxies`. Only then is X-Forwarded-For believed: all its lines are
merged and read right to left, skipping trusted addresses, and the first
untrusted address is the client. Entries left of it were written by the
client and are never believed, so a forged X-Forwarded-For from an untrusted
peer changes nothing. Header, query and cookie values are whatever the client
sent; they are only ever hashed (`gateway.limiter.keys`), never used as keys.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from aiohttp import web

from gateway.config.model import IdentitySource, IPNetwork

# Addresses remembered with their parsed form and trust, so a returning client costs a
# dict hit instead of an ipaddress parse and format (~3 µs). Bounded because clients
# choose their addresses (an IPv6 /64 alone holds 2^64); when full it starts over.
ADDRESS_MEMO_SIZE = 4096
# The longest address text worth remembering: "[IPv6 with embedded IPv4]:port" is 53
# characters. Longer X-Forwarded-For entries are parsed each time, never kept.
ADDRESS_MEMO_KEY_CHARS = 64


def _parse_ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    text = text.strip()
    if text.startswith("[") and "]" in text:  # "[2001:db8::1]:443"
        text = text[1 : text.index("]")]
    elif text.count(":") == 1:  # "192.0.2.1:443"
        text = text.partition(":")[0]
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


class ClientIdentity:
    def __init__(self, trusted_proxies: Sequence[IPNetwork]) -> None:
        self._trusted = tuple(trusted_proxies)
        # address text -> (the address as we write it, or None if it is not one; trusted?)
        self._addresses: dict[str, tuple[str | None, bool]] = {}

    def address(self, text: str) -> tuple[str | None, bool]:
        """`text` (an address, with or without a port) as the gateway writes it, or None if it
        is not an address; and whether it is a trusted proxy."""
        known = self._addresses.get(text)
        if known is None:
            address = _parse_ip(text)
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
        entries = [e.strip() for line in request.headers.getall("X-Forwarded-For", ()) for e in line.split(",")]
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

    def identity(self, request: web.BaseRequest, key: IdentityKey, client_ip: str) -> str:
        """The first source present, as "source=value"; the client's IP when none is."""
        for source, prefix in key.sources:
            value = client_ip if source.kind == "ip" else self._value(request, source)
            if value:
                return prefix + value
        return "ip=" + client_ip

    def _value(self, request: web.BaseRequest, source: IdentitySource) -> str | None:
        if source.kind == "header":
            return request.headers.get(source.name)
        if source.kind == "query":
            return request.rel_url.query.get(source.name)
        return _cookie(request, source.name)


def _cookie(request: web.BaseRequest, name: str) -> str | None:
    """The first cookie called `name`, read as browsers send them (RFC 6265 §5.4): `name=value`
    pairs split on ";". http.cookies gives up on the whole header at the first value it
    dislikes (JSON, a space), which would silently key such clients by IP instead."""
    for header in request.headers.getall("Cookie", ()):
        for pair in header.split(";"):
            key, sep, value = pair.partition("=")
            if sep and key.strip() == name:
                value = value.strip()
                if len(value) >= 2 and value[0] == value[-1] == '"':
                    value = value[1:-1]
                return value
    return None
