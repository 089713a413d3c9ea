"""Rewriting an upstream's own address in `Location` and `Content-Location` to the gateway's.

An upstream that redirects to an absolute URL names itself (`http://10.0.0.7:9000/login`),
which the client cannot reach and should not learn. As nginx's `proxy_redirect
default` does, a value whose scheme, host and port are the route's upstream's,
and whose path lies under the upstream URL's own path, is rewritten to the
address the client used: the route's prefix when it has `strip_prefix`, then the
rest of the path, query and fragment. Values naming any other address, and
relative ones, are left alone.

The rewritten value is a path alone (RFC 9110 §10.2.2 allows it; the client
resolves it against the URL it asked for), unless the route names its host: then
it starts with the scheme and host the gateway sent upstream as X-Forwarded-Proto
and X-Forwarded-Host (its own, or a trusted proxy's), when that host is one the
route names. A Host header is the client's to choose, so one no route names is
never written into a redirect for someone else to follow (a poisoned cache).
A path alone never starts `//` or `/\\` (the upstream's
`http://up//evil.example/phish`): a browser reads that as another host, so the
second byte is percent-encoded, and tab, CR and LF, which browsers drop
from a URL before reading it, are percent-encoded throughout.

The rule reads the bytes that are sent. Values hold the upstream's bytes decoded as
UTF-8 with surrogateescape, and gateway.proxy.relayed_response writes exactly those
bytes back (`field_bytes`), obs-text included: `http://up/\\xff/evil.example` becomes
`/\\xff/evil.example`, whose second byte is no slash. Nor does a browser make one of
it: before reading a Location as a URL (WHATWG URL) it removes tab, CR and LF
anywhere and C0 controls and spaces at either end, reads `\\` as `/`, and
percent-encodes a byte outside ASCII (the byte itself, or what it decodes as UTF-8,
U+FFFD for a byte that is none): `/%FF/evil.example` or `/%EF%BF%BD/evil.example`,
a path of this host.

Trusts the config; the response headers come from the upstream the route names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

from multidict import CIMultiDict

from gateway.config.http_names import request_host
from gateway.proxy.protocol import VALID_HOST
from gateway.proxy.relayed_response import field_bytes
from gateway.proxy.routing import WILDCARD

_DEFAULT_PORTS = {"http": 80, "https": 443}
_NAMES = ("Location", "Content-Location")
# Characters a prefix keeps unencoded in a URL path (RFC 3986 §3.3 pchar and "/").
_PATH_SAFE = "/!$&'()*+,;=:@~"
# What a browser removes from a URL before parsing it (WHATWG URL), so "/\t/evil" is "//evil".
_DROPPED = str.maketrans({"\t": "%09", "\n": "%0A", "\r": "%0D"})
# A path alone whose second byte is one of these is read as another host: that byte, encoded.
_ANOTHER_HOST = {b"/": "/%2F", b"\\": "/%5C"}


@dataclass(frozen=True, slots=True)
class LocationRewrite:
    origins: frozenset[str]  # the upstream's "scheme://host[:port]", lower case, each spelling of its port
    base: str  # the upstream URL's own path, without a trailing slash ("" for none)
    prefix: str  # the route's prefix, percent-encoded, put back with strip_prefix; "" otherwise
    host: str | None = None  # the route's `host` ("*.example.com" too); None: rewrite to a path alone

    @classmethod
    def of(cls, upstreams: Sequence[str], strip_prefix: str | None, host: str | None = None) -> LocationRewrite:
        """`upstreams` are the route's base URLs without a trailing slash (a pool's targets,
        which share their path); `strip_prefix` the prefix a strip_prefix route removes (as
        written, decoded), else None; `host` the route's host condition, if any."""
        named = host.lower() if host is not None else None
        origins = set()
        for upstream in upstreams:
            parts = urlsplit(upstream)
            host = parts.hostname or ""
            if ":" in host:
                host = f"[{host}]"
            scheme = parts.scheme.lower()
            port = parts.port or _DEFAULT_PORTS[scheme]
            origins.add(f"{scheme}://{host}:{port}")
            if port == _DEFAULT_PORTS[scheme]:
                origins.add(f"{scheme}://{host}")
        prefix = quote(strip_prefix, safe=_PATH_SAFE) if strip_prefix else ""
        return cls(origins=frozenset(origins), base=urlsplit(upstreams[0]).path, prefix=prefix, host=named)

    def apply(self, response_headers: CIMultiDict[str], forwarded: CIMultiDict[str]) -> None:
        """Rewrite the Location fields of `response_headers`; `forwarded` are the headers sent
        upstream, whose X-Forwarded-Proto and -Host say how the client reached the gateway."""
        for name in _NAMES:
            value = response_headers.get(name)
            if value is not None and "://" in value:
                rewritten = self.rewritten(value, self._public_origin(forwarded) if self.host is not None else "")
                if rewritten is not None:
                    response_headers[name] = rewritten

    def rewritten(self, value: str, public_origin: str) -> str | None:
        """`value` with the upstream's address replaced by `public_origin` ("" for a path
        alone), or None when it names another address."""
        start = value.find("://") + 3
        end = len(value)
        for delimiter in "/?#":
            found = value.find(delimiter, start)
            if 0 <= found < end:
                end = found
        if value[:end].lower() not in self.origins:
            return None
        rest = value[end:]
        if self.base:
            if not rest.startswith(self.base) or rest[len(self.base) : len(self.base) + 1] not in ("", "/", "?", "#"):
                return None  # under another path of the upstream, which this route does not serve
            rest = rest[len(self.base) :]
        if not rest.startswith("/"):
            rest = "/" + rest
        if public_origin:
            return public_origin + self.prefix + rest
        path = (self.prefix + rest).translate(_DROPPED)
        another = _ANOTHER_HOST.get(field_bytes(path)[1:2])
        return another + path[2:] if another is not None else path

    def _public_origin(self, forwarded: CIMultiDict[str]) -> str:
        """"scheme://host" as the client reached the gateway, when the route names that host;
        "" otherwise, or when no valid host is known."""
        proto = forwarded.get("X-Forwarded-Proto", "").partition(",")[0].strip().lower()
        host = forwarded.get("X-Forwarded-Host", "").partition(",")[0].strip()
        if proto not in _DEFAULT_PORTS or not VALID_HOST.fullmatch(host) or not self._names(request_host(host)):
            return ""
        return f"{proto}://{host}"

    def _names(self, host: str) -> bool:
        named = self.host
        if named is None:
            return False
        if named.startswith(WILDCARD):
            return host.endswith(named[1:]) and len(host) > len(named) - 1
        return host == named
