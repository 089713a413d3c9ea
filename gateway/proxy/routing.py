"""Which route a request takes: the first route in file order whose match fits.

A route's `path` is a prefix on whole segments: `/api` matches `/api` and
`/api/x`, never `/apix`. Matching runs on the `match` view of the path that
`gateway.proxy.paths` reads by the one rule, which is also what is forwarded,
so `/public/../api/reports` cannot slip past the limits of `/api/reports`.
Case matters, unless a route says `case_sensitive: false` for an upstream that
ignores it; then both sides are compared case-folded (casefold folds more than
lower, so it errs towards taking the limited route).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

from gateway.config.model import Match


class Matchable(Protocol):
    @property
    def match(self) -> Match: ...


R = TypeVar("R", bound=Matchable)


class Router(Generic[R]):
    """Routes in file order: config `Route`s, or the plans compiled from them."""

    def __init__(self, routes: Sequence[R]) -> None:
        # Each prefix beside "prefix/", formed here once rather than on every request.
        self._routes = tuple(
            (route, route.match, prefix, "" if prefix == "/" else prefix + "/", route.match.case_sensitive)
            for route in routes
            for prefix in (route.match.path if route.match.case_sensitive else route.match.path.casefold(),)
        )

    def find(self, method: str, host: str, path: str) -> R | None:
        """`path` is the `match` of a NormalPath; `host` is the Host header without its port."""
        folded = None
        for route, match, prefix, under, case_sensitive in self._routes:
            if match.methods is not None and method not in match.methods:
                continue
            if match.host is not None and match.host != host:
                continue
            if case_sensitive:
                if path == prefix or path.startswith(under):
                    return route
            else:
                if folded is None:
                    folded = path.casefold()
                if folded == prefix or folded.startswith(under):
                    return route
        return None
