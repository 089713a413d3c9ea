"""Header rules for forwarding: hop-by-hop removal and the X-Forwarded-* set.

RFC 9110 §7.6.1: Connection, every header Connection names, and the
hop-by-hop fields (Keep-Alive, Proxy-Connection, TE, Trailer,
Transfer-Encoding, Upgrade) describe one connection and are not forwarded,
in either direction. Content-Length is left to the HTTP library on each leg,
which sets it from the body it actually sends.

Trust: the forwarding headers (X-Forwarded-For, -Proto, -Host, Forwarded)
are the gateway's to write. A client cannot have them stripped by naming
them in Connection, and with `forwarded_headers: replace` (the default, for
a gateway at the edge) those sent by a peer outside `trusted_proxies` are
dropped and written anew; a trusted proxy's are kept, our hop appended.
"""

from __future__ import annotations

from multidict import CIMultiDict, CIMultiDictProxy

HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"}
)
# Request headers the gateway writes itself, whatever a Connection header names.
GATEWAY_WRITTEN = frozenset({"x-forwarded-for", "x-forwarded-proto", "x-forwarded-host", "forwarded", "host"})
_FORWARDING = ("X-Forwarded-For", "X-Forwarded-Proto", "X-Forwarded-Host", "Forwarded")


def end_to_end(
    headers: CIMultiDictProxy[str] | CIMultiDict[str], keep: frozenset[str] = frozenset()
) -> CIMultiDict[str]:
    """A copy of `headers` without hop-by-hop fields; every value of a repeated field is kept.
    Fields in `keep` (lower case) stay even when Connection names them."""
    # Copying whole and removing the few hop-by-hop fields present runs in multidict's C
    # code; filtering field by field in Python took five times as long.
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
    if replace:
        headers.setdefault("X-Forwarded-Proto", proto)
        headers.setdefault("X-Forwarded-Host", host)
    else:
        headers["X-Forwarded-Proto"] = proto
        headers["X-Forwarded-Host"] = host
