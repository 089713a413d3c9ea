"""A route's `request_headers` and `response_headers`: headers removed, set and added.

Applied in that order to the headers of one direction: `remove` drops every line
of a name, `set` replaces every line of a name with one, `add` appends a line to
those already there. Requests are rewritten after the hop-by-hop fields are
dropped and before the gateway writes its own (X-Forwarded-*, X-Request-ID),
responses from the upstream after the Location rewrite (gateway.proxy.location)
and before the RateLimit fields and X-Request-ID are written; so the gateway's
own fields always win. The loader refuses a rule that names them, a hop-by-hop field or
Content-Length, or a header a limit of the route reads its identity from
(the upstream must see the identity that was charged).

Trusts the config, which `gateway.config.loader` has validated.
"""

from __future__ import annotations

from multidict import CIMultiDict

from gateway.config.model import HeaderRules


def rewrite_headers(headers: CIMultiDict[str], rules: HeaderRules) -> None:
    for name in rules.remove:
        headers.popall(name, None)
    for name, value in rules.set:
        headers[name] = value
    for name, value in rules.add:
        headers.add(name, value)
