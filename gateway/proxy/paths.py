"""The one rule by which a request path is read, for matching and for forwarding alike.

A limiter in front of an upstream is bypassed whenever the two read one path
differently: `/api/%2e%2e/x` matched as `/x` but forwarded raw, `/api;x/y`
missing the `/api` route on a servlet container that drops `;x`. So the path is
read once, here, into two views that cannot disagree: `forward`, the path sent
upstream, and `match`, the same path decoded, which routes are matched against.
Reading `forward` again gives `forward` and the same `match`, so what the
upstream receives is exactly what was matched. A path that cannot be read one
way only is refused (`PathRejected`, a 400).

The rule, with the `path_normalization` setting (Envoy's `normalize_path`,
`merge_slashes` and `path_with_escaped_slashes_action`) choosing the details:

1. The path holds only what RFC 3986 §3.3 allows in a path: letters, digits,
   `-._~!$&'()*+,;=:@`, `/`, and `%` followed by two hex digits. Anything else
   (`\\`, `#`, a raw non-ASCII byte, a bad `%`) is refused.
2. Percent-encoded bytes are decoded once and must be UTF-8; none may be a
   control character (`%00`-`%1F`, `%7F`). A decoded segment may not begin or
   end with a space (Spring's `trimTokens` reads `/api%20/x` as `/api/x`).
3. A `;` starts a segment's parameters, which servlet containers drop before
   routing; the segment is matched without them (`/api;x` as `/api`). A path
   with parameters is then refused unless its route allows them
   (`allow_path_parameters`); if it does, surviving segments keep them upstream.
4. Encoded slashes (`%2F`), by `escaped_slashes`: `keep` (default) leaves them
   inside their segment both for matching and upstream, so `group%2Fproject` is
   one segment; `reject` refuses them; `decode` turns them into `/` first.
   A segment that hides `.` or `..` behind an encoded slash (`..%2Fapi`, with
   `keep`) or an encoded backslash (`..%5Capi`, which IIS reads as a slash) is
   refused, since an upstream that decodes it would resolve what the gateway
   did not.
5. Dot segments (`.`, `..`, also encoded as `%2e` and with parameters as in
   `..;`), by `dot_segments`: `resolve` (default, RFC 3986 §5.2.4; `..` above
   the root is dropped) or `reject`.
6. Empty segments (`//`) are merged (`merge_slashes: true`, default) or kept,
   and then matched and forwarded as they are.
7. `forward` is canonical: percent-encoded unreserved characters are decoded
   (RFC 3986 §6.2.2.2), so an upstream that does not decode sees what was
   matched, and other escapes get upper-case hex.

Case is left alone: routes match case-sensitively unless a route says
`case_sensitive: false` (see `gateway.proxy.routing`).

Pure functions on strings; no I/O. A path with nothing to change, which is
nearly every path, costs one regular-expression match.
"""

from __future__ import annotations

import re
from typing import NamedTuple
from urllib.parse import unquote_to_bytes

from gateway.config.model import DotSegments, EscapedSlashes, PathNormalization


class PathRejected(ValueError):
    """A path the rule refuses. str() is the problem's detail; it quotes nothing from the request."""


class NormalPath(NamedTuple):
    forward: str  # the path sent upstream (before strip_prefix), percent-encoded
    match: str  # the path routes are matched against: decoded, parameters left out; a kept %2F stays "%2F"
    parameters: bool  # some segment carried `;` parameters


# NamedTuple's own constructor is Python code; this C call makes the same tuple.
_new_path = tuple.__new__


# The usual path, which every setting leaves as it is: only unencoded path characters
# other than ";", no empty segment (except a trailing slash), no "." or ".." segment.
# Possessive (Python 3.11): a path that is not plain fails at once, without backtracking.
_PLAIN = re.compile(r"(?:/(?!\.\.?(?:/|$))[A-Za-z0-9\-._~!$&'()*+,=:@]++)++/?|/").fullmatch
_PATH_CHARACTERS = re.compile(r"/[A-Za-z0-9\-._~!$&'()*+,;=:@/%]*").fullmatch
_BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})").search
_ESCAPE = re.compile(r"%([0-9A-Fa-f]{2})")
# An escape of an unreserved character (ALPHA, DIGIT, "-", ".", "_", "~"), or with lower-case hex.
_NOT_CANONICAL = re.compile(
    r"%(?:[46][1-9A-Fa-f]|[57][0-9Aa]|3[0-9]|2[DEde]|5[Ff]|7[Ee]|[0-9A-Fa-f][a-f]|[a-f][0-9A-F])"
).search
_ENCODED_SLASH = re.compile(r"%2[Ff]")
_ENCODED_CONTROL = re.compile(r"%(?:[01][0-9A-Fa-f]|7[Ff])").search  # anywhere, parameters included
_SLASH_OR_BACKSLASH = re.compile(r"[/\\]")
_UNRESERVED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_DOTS = (".", "..")


def normalize_path(raw: str, rule: PathNormalization) -> NormalPath:
    """Read `raw`, a request target's path as received (before any `?`), by the rule above."""
    if _PLAIN(raw):
        return _new_path(NormalPath, (raw, raw, False))
    if not _PATH_CHARACTERS(raw):
        raise PathRejected("The path holds a character a path may not hold unencoded (RFC 3986 section 3.3).")
    if "%" in raw:
        if _BAD_ESCAPE(raw):
            raise PathRejected("The path holds a '%' that does not begin a percent-encoded byte.")
        if _ENCODED_CONTROL(raw):
            raise PathRejected("The path holds an encoded control character.")
        if rule.escaped_slashes is not EscapedSlashes.KEEP and _ENCODED_SLASH.search(raw):
            if rule.escaped_slashes is EscapedSlashes.REJECT:
                raise PathRejected("The path holds an encoded slash, which this gateway does not accept.")
            raw = _ENCODED_SLASH.sub("/", raw)
    resolve_dots = rule.dot_segments is DotSegments.RESOLVE
    merge = rule.merge_slashes
    forward: list[str] = []
    match: list[str] = []
    trailing = False  # the path ends in a segment that was left out, so it ends in "/"
    for segment in raw[1:].split("/"):
        name = segment.partition(";")[0]
        if "%" in segment:
            name = _decoded(name)
            if _NOT_CANONICAL(segment):
                segment = _ESCAPE.sub(_canonical_escape, segment)
        if name in _DOTS:
            if not resolve_dots:
                raise PathRejected("The path holds a '.' or '..' segment, which this gateway does not accept.")
            if name == ".." and forward:
                forward.pop()
                match.pop()
            trailing = True
            continue
        if not name and merge:
            trailing = True
            continue
        trailing = False
        if "/" in name or "\\" in name:
            if any(part in _DOTS for part in _SLASH_OR_BACKSLASH.split(name)):
                raise PathRejected("A path segment hides a '.' or '..' segment behind an encoded slash or backslash.")
            name = name.replace("/", "%2F")
        forward.append(segment)
        match.append(name)
    end = "/" if trailing and forward else ""
    return _new_path(NormalPath, ("/" + "/".join(forward) + end, "/" + "/".join(match) + end, ";" in raw))


def _decoded(name: str) -> str:
    try:
        decoded = unquote_to_bytes(name).decode("utf-8")
    except UnicodeDecodeError:
        raise PathRejected("The path's percent-encoded bytes are not UTF-8.") from None
    if decoded[:1] == " " or decoded[-1:] == " ":
        raise PathRejected("A path segment begins or ends with a space.")
    return decoded


def _canonical_escape(escape: re.Match[str]) -> str:
    char = chr(int(escape.group(1), 16))
    return char if char in _UNRESERVED else "%" + escape.group(1).upper()
