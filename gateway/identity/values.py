"""A header, query parameter or cookie that identifies a client, read only when the
upstream will read exactly that value and no other.

Trusts nothing the client sent: a source given twice (two header lines,
`?key=a&key=b`, two cookies of one name, a name after a `;` in the query), a
value outside visible ASCII (which one parser reads as another value, or
drops), or a cookie escape that servers decode (`%61`) is rejected with
IdentityRejected (400), never normalised. gateway.identity.sources decides which
sources a limit reads; this module reads one.
"""

from __future__ import annotations

import re
import string
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import ClassVar

from aiohttp import web

from gateway.config.model import IdentitySource


class IdentityRejected(Exception):
    """The client's identity cannot be read as the upstream would read it; the request is
    answered with `status` and never charged. `detail` names config, never client bytes."""

    status = 400
    title = "Bad Request"
    headers: ClassVar[Mapping[str, str] | None] = None

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


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


def sent_value(request: web.BaseRequest, source: IdentitySource) -> str | None:
    """The value of a header, query or cookie source as sent, or None when it is absent."""
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
    does. (str methods run in C; a regex takes three times as long.)"""
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
