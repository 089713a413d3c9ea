"""Rewriting an upstream's own address in `Location` and `Content-Location` to the gateway's.

An upstream that redirects to an absolute URL names itself (`http://10.0.0.7:9000/login`),
which the client cannot reach and should not learn. As nginx's `proxy_redirect
default` does, a value whose scheme, host and port are the route's upstream's,
and whose path lies under the upstream URL's own path, is rewritten to the
address the client used: the scheme and host the gateway sent upstream as
X-Forwarded-Proto and X-Forwarded-Host (its own, or those of a trusted proxy in
front of it), then the route's prefix when it has `strip_prefix`, then the rest
of the path, query and fragment. Values naming any other address, and relative
ones, are left alone. With no host to name (an HTTP/1.0 request without Host),
the rewritten value is the path alone, which RFC 9110 §10.2.2 allows.

Trusts the config; the response headers come from the upstream the route names.
"""

from __future__ import annotations

from collections.abc import Sequence

from dataclasses import dataclass
from urllib.parse import quote, urlsplit

from multidict import CIMultiDict

from gateway.proxy.protocol import VALID_HOST

_DEFAULT_PORTS = {"http": 80, "https": 443}
_NAMES = ("Location", "Content-Location")
# Characters a prefix keeps unencoded in a URL path (RFC 3986 §3.3 pchar and "/").
_PATH_SAFE = "/!$&'()*+,;=:@~"


@dataclass(frozen=True, slots=True)
class LocationRewrite:
    origins: frozenset[str]  # the upstream's "scheme://host[:port]", lower case, each spelling of its port
    base: str  # the upstream URL's own path, without a trailing slash ("" for none)
    prefix: str  # the route's prefix, percent-encoded, put back with strip_prefix; "" otherwise

    @classmethod
    def of(cls, upstreams: Sequence[str], strip_prefix: str | None) -> LocationRewrite:
        """`upstreams` are the route's base URLs without a trailing slash (a pool's targets,
        which share their path); `strip_prefix` the prefix a strip_prefix route removes (as
        written, decoded), else None."""
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
        return cls(origins=frozenset(origins), base=urlsplit(upstreams[0]).path, prefix=prefix)

    def apply(self, response_headers: CIMultiDict[str], forwarded: CIMultiDict[str]) -> None:
        """Rewrite the Location fields of `response_headers`; `forwarded` are the headers sent
        upstream, whose X-Forwarded-Proto and -Host say how the client reached the gateway."""
        for name in _NAMES:
            value = response_headers.get(name)
            if value is not None and "://" in value:
                rewritten = self.rewritten(value, _public_origin(forwarded))
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
        return public_origin + self.prefix + rest


def _public_origin(forwarded: CIMultiDict[str]) -> str:
    """"scheme://host" as the client reached the gateway; "" when no valid host is known."""
    proto = forwarded.get("X-Forwarded-Proto", "").partition(",")[0].strip().lower()
    host = forwarded.get("X-Forwarded-Host", "").partition(",")[0].strip()
    if proto not in _DEFAULT_PORTS or not VALID_HOST.fullmatch(host):
        return ""
    return f"{proto}://{host}"
