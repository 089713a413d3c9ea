"""Header rules for forwarding: hop-by-hop removal and the X-Forwarded-* set.

RFC 9110 §7.6.1: Connection, every header Connection names, and the
hop-by-hop fields (Keep-Alive, Proxy-Connection, TE, Trailer,
Transfer-Encoding, Upgrade) describe one connection and are not forwarded,
in either direction. Content-Length is left to the HTTP library on each leg,
which sets it from the body it actually sends.

Transfer codings: the HTTP library on each leg removes `chunked` and frames the body anew,
and nothing decodes any other coding (gzip, deflate, compress). Since Transfer-Encoding is
hop-by-hop, a body in such a coding would go on with no field saying it is coded, as bytes
that look like a plain body. So a request naming one is refused with 501 (RFC 9112 §6.1;
nginx and Envoy answer 501 too) and an upstream response naming one becomes a 502, as
nginx makes it. `identity` changes nothing and is let through.

Trust: the forwarding headers (X-Forwarded-For, -Proto, -Host, Forwarded)
are the gateway's to write. A client cannot have them stripped by naming
them in Connection, and with `forwarded_headers: replace` (the default, for
a gateway at the edge) those sent by a peer outside `trusted_proxies` are
dropped and written anew; a trusted proxy's are kept, our hop appended.
An RFC 7239 Forwarded header that is kept gets our hop as one more element
(`for=`, `host=`, `proto=`, as that RFC's §4 has each proxy add); the gateway
starts no Forwarded chain of its own, as nginx, Envoy and Traefik start none.
"""

from __future__ import annotations

from multidict import CIMultiDict, CIMultiDictProxy

from gateway.config.http_names import FORWARDING, HOP_BY_HOP, cgi_name

# RFC 7230 tchar: a Forwarded value of these alone needs no quotes.
_TOKEN = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")

# Request headers the gateway writes itself, whatever a Connection header names.
GATEWAY_WRITTEN = FORWARDING | {"host"}
# The transfer codings the gateway can relay (see the module docstring).
_RELAYED_CODINGS = frozenset({"chunked", "identity"})
_FORWARDING = ("X-Forwarded-For", "X-Forwarded-Proto", "X-Forwarded-Host", "Forwarded")


def drop_cgi_aliases(headers: CIMultiDict[str], names: frozenset[str]) -> None:
    """Remove every line whose name is not one of `names` (CGI names) but reads as one under
    CGI rules: a header the gateway removes or writes itself must not reach a WSGI upstream
    as `X_Forwarded_For`. nginx drops every name with `_` (`underscores_in_headers off`)."""
    if not names:
        return
    aliases = {n for n in headers if "_" in n and cgi_name(n) in names}
    for name in aliases:
        headers.popall(name, None)


def end_to_end(
    headers: CIMultiDictProxy[str] | CIMultiDict[str], keep: frozenset[str] = frozenset()
) -> CIMultiDict[str]:
    """A copy of `headers` without hop-by-hop fields; every value of a repeated field is kept.
    Fields in `keep` (lower case) stay even when Connection names them."""
    # Copying whole and removing the few hop-by-hop fields present runs in multidict's C
    # code; filtering field by field in Python takes five times as long.
    kept = CIMultiDict(headers)
    for name in HOP_BY_HOP:
        if name in kept:
            kept.popall(name)
    for line in headers.getall("Connection", ()):
        for token in line.split(","):
            name = token.strip()
            if name.lower() not in keep:
                kept.popall(name, None)
    return kept


def unrelayable_coding(headers: CIMultiDictProxy[str]) -> bool:
    """Whether Transfer-Encoding names a coding other than chunked (or identity), which the
    gateway would pass on undecoded and unlabelled."""
    for line in headers.getall("Transfer-Encoding", ()):
        for coding in line.split(","):
            name = coding.partition(";")[0].strip().lower()
            if name and name not in _RELAYED_CODINGS:  # an empty list element is allowed (RFC 9110 §5.6.1)
                return True
    return False


def add_forwarded(
    headers: CIMultiDict[str], *, peer: str, proto: str, host: str, trusted: bool, replace: bool
) -> None:
    """Add our hop: `peer` (the connecting address as the gateway writes it) to X-Forwarded-For,
    and X-Forwarded-Proto and X-Forwarded-Host. With `replace`, an untrusted peer's forwarding
    headers are dropped first, and a trusted peer's Proto and Host, which know the original
    request, are kept; otherwise (`append`) ours are set as before."""
    if replace and not trusted:
        for name in _FORWARDING:
            headers.popall(name, None)
        headers["X-Forwarded-For"] = peer
        headers["X-Forwarded-Proto"] = proto
        headers["X-Forwarded-Host"] = host
        return
    previous = ", ".join(headers.getall("X-Forwarded-For", ()))
    headers.popall("X-Forwarded-For", None)
    headers["X-Forwarded-For"] = f"{previous}, {peer}" if previous else peer
    chain = ", ".join(headers.getall("Forwarded", ()))
    if chain:
        headers.popall("Forwarded", None)
        headers["Forwarded"] = f"{chain}, {forwarded_element(peer, proto, host)}"
    if replace:
        headers.setdefault("X-Forwarded-Proto", proto)
        headers.setdefault("X-Forwarded-Host", host)
    else:
        headers["X-Forwarded-Proto"] = proto
        headers["X-Forwarded-Host"] = host


def forwarded_element(peer: str, proto: str, host: str) -> str:
    """Our hop as an RFC 7239 Forwarded element: an IPv6 `for=` in brackets, and any value
    that is not a plain token quoted, with quotes and backslashes escaped."""
    node = f"[{peer}]" if ":" in peer else peer
    pairs = [("for", node), ("host", host), ("proto", proto)]
    return ";".join(f"{name}={_quoted(value)}" for name, value in pairs if value)


def _quoted(value: str) -> str:
    if value and all(c in _TOKEN for c in value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
