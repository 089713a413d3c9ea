"""Which Host and Origin the admin listener answers: its defence against DNS rebinding.

A page on rebind.attacker.example whose name the attacker then points at 127.0.0.1
(or at any address the visitor's browser reaches, a pod IP among them) has that
browser send the admin listener requests the page may read, since to the browser
they stay on the page's own origin. Their Host still names the attacker's domain.
So the listener answers only a Host that names it by address: an IP literal (IPv4,
or IPv6 in brackets), `localhost` (browsers resolve it to loopback themselves), or a
name in `admin_hosts` (such as the name Prometheus scrapes it by); any port, since a
published port may differ from the bound one. Nobody's DNS decides what an IP
literal reaches, so no page is ever served under one by rebinding. Any other Host
gets 421 Misdirected Request. A request without Host (HTTP/1.0) comes from no
browser and is served. /healthz, which says only that the process is alive, answers
whatever the Host, as it answers without the token.

A request that changes state (DELETE, POST, PUT, PATCH) whose Origin is not the
origin its Host names (`null` included) gets 403: browsers send Origin on every such
request, so a page elsewhere cannot reset buckets through its visitor's browser.
A request without Origin (curl, scripts) is not a browser's and is served.

Trusts nothing of the request; the names come from the config.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable, Collection

from aiohttp import hdrs, web
from yarl import URL

from gateway.proxy.problem import problem

_STATE_CHANGING = frozenset({"DELETE", "POST", "PUT", "PATCH"})
_ANY_HOST_PATHS = frozenset({"/healthz"})
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def host_guard(names: Collection[str]) -> Callable[[web.Request, _Handler], Awaitable[web.StreamResponse]]:
    """The admin app's middleware; `names` are `admin_hosts`, lower case, without a trailing dot."""
    allowed = frozenset({"localhost", *names})

    @web.middleware
    async def guard(request: web.Request, handler: _Handler) -> web.StreamResponse:
        if request.path in _ANY_HOST_PATHS:
            return await handler(request)
        hosts = request.headers.getall(hdrs.HOST, ())
        if hosts and not (len(hosts) == 1 and names_this_listener(hosts[0], allowed)):
            return problem(
                421,
                "Misdirected Request",
                "The admin listener answers only to an IP address, localhost, or a name in admin_hosts.",
            )
        if (
            request.method in _STATE_CHANGING
            and hdrs.ORIGIN in request.headers
            and (not hosts or not same_origin(request.headers.getall(hdrs.ORIGIN), hosts[0], request.scheme))
        ):
            return problem(403, "Forbidden", "A request that changes state must come from the listener's own origin.")
        return await handler(request)

    return guard


def names_this_listener(host: str, allowed: frozenset[str]) -> bool:
    """Whether a Host header value (with or without its port) is an IP literal or in `allowed`."""
    name, port = _split(host)
    if name is None or (port and not port.isdigit()):
        return False
    if name.startswith("["):
        return _is_ip(name[1:-1], ipaddress.IPv6Address)
    return _is_ip(name, ipaddress.IPv4Address) or name.lower().removesuffix(".") in allowed


def same_origin(origins: list[str], host: str, scheme: str) -> bool:
    """Whether the one Origin given is `scheme://host`, default ports spelt or not."""
    if len(origins) != 1:
        return False
    try:
        origin, own = URL(origins[0]), URL(f"{scheme}://{host}")
    except ValueError:
        return False
    if not origin.absolute or origin.scheme not in ("http", "https") or origin.raw_path not in ("", "/"):
        return False
    return (origin.scheme, origin.host, origin.port) == (own.scheme, own.host, own.port)


def _split(host: str) -> tuple[str | None, str]:
    """(name, port text) of a Host value; name None when it has no form a Host may take."""
    if host.startswith("["):
        end = host.find("]")
        if end < 0 or (host[end + 1 :] and not host[end + 1 :].startswith(":")):
            return None, ""
        return host[: end + 1], host[end + 2 :]
    name, colon, port = host.rpartition(":")
    return (name, port) if colon else (host, "")


def _is_ip(text: str, kind: type[ipaddress.IPv4Address | ipaddress.IPv6Address]) -> bool:
    try:
        kind(text)
    except ValueError:
        return False
    return True
