"""Which route a request takes: the first route in file order whose match fits.

A route's `path` is a prefix on whole segments: `/api` matches `/api` and
`/api/x`, never `/apix`. Matching runs on the decoded path with dot segments
and repeated slashes removed, so `/public/../api/reports` or
`/api%2freports` cannot slip past the limits of `/api/reports`.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.config.model import Route


def normalize_path(path: str) -> str:
    """Remove dot segments (RFC 3986 §5.2.4) and empty segments from a decoded path."""
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


def path_has_prefix(path: str, prefix: str) -> bool:
    return prefix == "/" or path == prefix or path.startswith(prefix + "/")


class Router:
    def __init__(self, routes: Sequence[Route]) -> None:
        self._routes = tuple(routes)

    def find(self, method: str, host: str, path: str) -> Route | None:
        """`path` must already be normalized; `host` is the Host header without its port."""
        for route in self._routes:
            match = route.match
            if match.methods is not None and method not in match.methods:
                continue
            if match.host is not None and match.host != host:
                continue
            if path_has_prefix(path, match.path):
                return route
        return None
