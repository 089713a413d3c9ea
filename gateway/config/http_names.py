"""HTTP names the config checks against and the proxy acts on, defined once.

Config stands below the proxy, so these live here and gateway.proxy imports them: a
header the loader refuses as an identity is the same set the proxy strips. Pure
constants and name rules; nothing here reads input.
"""

from __future__ import annotations

import re

# RFC 9110 §7.6.1: fields of one connection, never forwarded in either direction.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"})
# The forwarding headers, which the gateway writes itself (gateway.proxy.headers.add_forwarded).
FORWARDING = frozenset({"x-forwarded-for", "x-forwarded-proto", "x-forwarded-host", "forwarded"})
# RFC 9110 §5.6.2 token: a header name, an HTTP method, a JWT claim name as the config writes one.
HTTP_TOKEN_RE = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
# A host name in lower case, without a port, or a bracketed IPv6 literal.
HOST_RE = re.compile(r"^(?:[a-z0-9](?:[a-z0-9\-]*[a-z0-9])?\.)*[a-z0-9](?:[a-z0-9\-]*[a-z0-9])?$|^\[[0-9a-f:.]+\]$")


def cgi_name(name: str) -> str:
    """A header's name as CGI and WSGI servers see it, where `X_API_Key` and `X-API-Key` are
    both HTTP_X_API_KEY: which of two such lines the upstream reads is its choice."""
    return name.lower().replace("_", "-")


def request_host(host: str) -> str:
    """A Host header as routes match it: lower case, without its port, and without the
    trailing dot of a fully qualified name, which names the same host (`api.example.com.`)."""
    host = host.lower()
    if host.startswith("["):
        return host.partition("]")[0] + "]"
    host = host.rpartition(":")[0] if ":" in host else host
    return host.removesuffix(".")
