"""Which route a request takes: the first route in file order whose match fits.

A route's `path` is a prefix on whole segments: `/api` matches `/api` and
`/api/x`, never `/apix`. Matching runs on the decoded path with dot segments
and repeated slashes removed, so `/public/../api/reports` or
`/api%2freports` cannot slip past the limits of `/api/reports`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

from gateway.config.model import Match


def normalize_path(path: str) -> str:
    """Remove dot segments (RFC 3986 §5.2.4) and empty segments from a decoded path."""
    if path.startswith("/") and "//" not in path and "/." not in path:
        return path  # the usual case: no segment is empty, ".", or ".."
    segments: list[str] = []
    for segment in path.split("/"):
        if segment in ("", "."):
            continue
        if segment == "..":
            if segments:
                segments.pop()
            continue
        segments.append(segment)
    trailing = "/" if path.endswith(("/", "/.", "/..")) and segments else ""
    return "/" + "/".join(segments) + trailing


class Matchable(Protocol):
    @property
    def match(self) -> Match: ...


R = TypeVar("R", bound=Matchable)


class Router(Generic[R]):
    """Routes in file order: config `Route`s, or the plans compiled from them."""

    def __init__(self, routes: Sequence[R]) -> None:
        # Each prefix beside "prefix/", formed here once rather than on every request.
        self._routes = tuple(
            (route, route.match, route.match.path, "" if route.match.path == "/" else route.match.path + "/")
            for route in routes
        )

    def find(self, method: str, host: str, path: str) -> R | None:
        """`path` must already be normalized; `host` is the Host header without its port."""
        for route, match, prefix, under in self._routes:
            if match.methods is not None and method not in match.methods:
                continue
            if match.host is not None and match.host != host:
                continue
            if path == prefix or path.startswith(under):
                return route
        return None
