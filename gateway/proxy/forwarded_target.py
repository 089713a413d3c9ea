"""The original request's method and target, as a proxy beside the gateway will forward them.

On the public listener the gateway forwards the path as it matched it (gateway.proxy.paths),
so what the upstream receives is what was decided. Beside a proxy (gateway.proxy.decision)
the proxy forwards the client's target as sent, and the gateway cannot change it: a decision
on a normalised copy is a decision on another request. `/api/reports//..` read as `/api/`
picks the lenient route, while the upstream resolves it to `/api/reports/`; a `?x=1#&y=1`
read without its fragment hides `y=1`, which Go and PHP upstreams read. So a target is
decided only when the public listener would take it and forward it unchanged, and refused
(`TargetRefused`, a 400 of the original request) otherwise:

1. The method and target go through the public listener's own parser (llhttp, as
   aiohttp's server runs it), as the request line `METHOD TARGET HTTP/1.1`: a method it
   does not know (`post`, `FOO`) or a target it refuses (a raw non-ASCII byte, a space) is
   refused with the public listener's words. `CONNECT` is refused before, as the public
   listener refuses it: this gateway is no tunnel.
2. The target is origin-form (`/path?query`): the public listener would rewrite an
   absolute-form target before forwarding.
3. The query holds no `#`: the public listener would drop it and what follows.
4. The path is one the path rule (the `path_normalization` setting) refuses nothing of and
   forwards unchanged: no empty segment it merges, no dot segment, no escape it decodes or
   rewrites (`%2e`, `%2F` under `escaped_slashes: decode`, lower-case hex).

Trusts nothing in the method or the target: both are the client's, as the proxy saw them.
No I/O; the parser is fed from memory.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from aiohttp import web_protocol
from aiohttp.http_exceptions import HttpProcessingError
from yarl import URL

from gateway.config.model import PathNormalization
from gateway.proxy.paths import NormalPath, PathRejected, normalize_path
from gateway.proxy.protocol import parser_refusal

NOT_ORIGIN_FORM = "Only origin-form request targets such as /path are served."
FRAGMENT = (
    "The request target holds a '#', which the gateway would drop with what follows it; the "
    "proxy forwards it, and an upstream may read the query on past it."
)
NORMALISED = (
    "The path rule would read this path as another one (an empty or dot segment, or an escape "
    "it decodes or rewrites); the proxy forwards it as sent, so the gateway does not decide on it."
)
# A request line's end and the one header a request needs: what llhttp reads past the target.
_LINE_END = b" HTTP/1.1\r\nHost: original\r\n\r\n"
# A bodiless request streams nothing: the parser wants a protocol (aiohttp's pure-Python one
# asserts it has one) and a loop only to make a body's reader, which it never makes here.
_NO_STREAM: Any = object()


class TargetRefused(Exception):
    """The original request is refused (400) before any route or limit: `detail` quotes
    nothing from it."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class ForwardedTarget(NamedTuple):
    url: URL  # the target as the public listener's parser builds it: path, query
    path: NormalPath  # as the path rule reads it; `forward` is the target's path itself


def forwarded_target(method: str, target: str, rule: PathNormalization) -> ForwardedTarget:
    """The original request's target, read as the public listener reads it, if the proxy
    forwarding it as sent forwards what the gateway decides on; else TargetRefused."""
    if method == "CONNECT":
        raise TargetRefused(NOT_ORIGIN_FORM)
    url = _parsed(method, target)
    if target[:1] != "/":
        raise TargetRefused(NOT_ORIGIN_FORM)
    raw_path, _, query = target.partition("?")
    try:
        path = normalize_path(raw_path, rule)  # which refuses a "#" in the path, as the public listener does
    except PathRejected as exc:
        raise TargetRefused(str(exc)) from None
    if "#" in query:
        raise TargetRefused(FRAGMENT)
    if path.forward != raw_path:
        raise TargetRefused(NORMALISED)
    return ForwardedTarget(url, path)


def _parsed(method: str, target: str) -> URL:
    """The target as aiohttp's server parses it with `method`, or TargetRefused with the
    public listener's answer to a request line it refuses."""
    try:
        # Header values are read as UTF-8 with surrogate escapes: these are the bytes sent.
        line = b"%s %s%s" % (method.encode("utf-8", "surrogateescape"), target.encode("utf-8", "surrogateescape"), _LINE_END)
    except UnicodeEncodeError:
        raise TargetRefused(parser_refusal(None)) from None
    parser = web_protocol.HttpRequestParser(_NO_STREAM, None, 2**16)
    try:
        messages, _, _ = parser.feed_data(line)
    except (HttpProcessingError, ValueError) as exc:
        raise TargetRefused(parser_refusal(exc)) from None
    # The target must be read whole: a trailing space is the line's separator to llhttp, so
    # `/? ` would be decided as `/?` while the proxy forwards the space.
    if len(messages) != 1 or messages[0][0].path != target:
        raise TargetRefused(parser_refusal(None))
    url: URL = messages[0][0].url
    return url
