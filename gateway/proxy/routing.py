"""Which route a request takes: the first route in file order whose match fits.

A route's `path` is a prefix on whole segments: `/api` matches `/api` and
`/api/x`, never `/apix`; `exact` is the whole path, and `regex` a pattern the
whole path must match (RE2, in time linear in the path; see
gateway.config.regex). Matching runs on the `match` view of the path that
`gateway.proxy.paths` reads by the one rule, which is also what is forwarded,
so `/public/../api/reports` cannot slip past the limits of `/api/reports`.
Case matters, unless a route says `case_sensitive: false` for an upstream that
ignores it; then both sides are compared case-folded (casefold folds more than
lower, so it errs towards taking the limited route).

`host: *.example.com` takes any name of one or more labels under example.com
(`a.example.com`, `a.b.example.com`), never `example.com` itself, as Envoy's
and nginx's suffix wildcards and the Kubernetes Gateway API do. A header
condition reads that header's one line, a query condition the parameter's one
value, decoded. Both are what the client chose to send, so a route they select
should not be more lenient than the route the client would take without them;
and what a condition matched must be exactly what the upstream receives. So,
as for identity sources (gateway.identity.values), a header or query
parameter a condition reads is refused with 400 (ConditionRejected) when it is
given twice (first-value and last-value readers would see different values
from the gateway's), when it holds characters outside visible ASCII (the
header writer drops bytes it cannot encode, so `\x801` would reach the upstream
as `1`), when Connection names it or another line's name reads as it under CGI
rules (`X_Debug`), or when a server that splits queries on ";" would read it
otherwise (`?x=0;debug=1`). Only conditions that are evaluated judge anything.

Everything a route's match needs is formed once, when the Router is built, so a
plain prefix route pays nothing for the other forms.
`shadowed` tells, for `gateway check`, which routes an earlier one certainly hides.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

from multidict import CIMultiDict, CIMultiDictProxy, MultiMapping
from yarl import URL

from gateway.config.http_names import cgi_name
from gateway.config.model import Match, PathForm, ValueMatch

WILDCARD = "*."


class ConditionRejected(ValueError):
    """A header or query parameter a route's condition reads could reach the upstream as
    another value; the request is answered 400. The message names config, never client bytes."""


class Matchable(Protocol):
    @property
    def match(self) -> Match: ...


R = TypeVar("R", bound=Matchable)

# A condition beyond method, exact host and prefix: (host, path, headers, target) -> fits.
_Condition = Callable[[str, str, MultiMapping[str], URL], bool]
_NO_HEADERS: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())
_NO_TARGET = URL("/")
_CHOSEN = "a route is chosen by it, and the upstream could read it otherwise"


class Router(Generic[R]):
    """Routes in file order: config `Route`s, or the plans compiled from them."""

    def __init__(self, routes: Sequence[R]) -> None:
        self._routes = tuple(_compiled(route) for route in routes)

    def find(
        self,
        method: str,
        host: str,
        path: str,
        headers: MultiMapping[str] = _NO_HEADERS,
        target: URL = _NO_TARGET,
    ) -> R | None:
        """`path` is the `match` of a NormalPath; `host` is the Host header without its port;
        `headers` the request's; `target` its URL, whose query is parsed only if a route asks."""
        folded = None
        for route, methods, exact_host, prefix, under, case_sensitive, conditions in self._routes:
            if methods is not None and method not in methods:
                continue
            if exact_host is not None and exact_host != host:
                continue
            if case_sensitive:
                if path != prefix and not path.startswith(under):
                    continue
            else:
                if folded is None:
                    folded = path.casefold()
                if folded != prefix and not folded.startswith(under):
                    continue
            if conditions is None or _all_hold(conditions, host, path, headers, target):
                return route
        return None


def _all_hold(conditions: tuple[_Condition, ...], host: str, path: str, headers: MultiMapping[str], target: URL) -> bool:
    # A loop, not all() over a generator: this runs for every candidate route of every request.
    for condition in conditions:  # noqa: SIM110
        if not condition(host, path, headers, target):
            return False
    return True


def _compiled(route: R) -> tuple:
    """The route as `find` reads it: (route, methods, exact host, prefix, prefix + "/",
    case-sensitive, the other conditions or None). An exact or regex route has the prefix ""
    and leaves the path to its conditions."""
    match = route.match
    conditions: list[_Condition] = []
    host = match.host
    if host is not None and host.startswith(WILDCARD):
        conditions.append(_wildcard_host(host[1:]))
        host = None
    if match.form is PathForm.PREFIX:
        prefix = match.path if match.case_sensitive else match.path.casefold()
        under = "" if prefix == "/" else prefix + "/"
    else:
        prefix = under = ""  # every path starts with "": the path's own condition decides
        conditions.append(_path_condition(match))
    conditions.extend(_header_condition(value) for value in match.headers)
    conditions.extend(_query_condition(value) for value in match.query)
    return (route, match.methods, host, prefix, under, match.case_sensitive, tuple(conditions) or None)


def _wildcard_host(suffix: str) -> _Condition:
    # `suffix` is ".example.com": at least one label must come before it.
    return lambda host, path, headers, target: host.endswith(suffix) and len(host) > len(suffix)


def _path_condition(match: Match) -> _Condition:
    if match.form is PathForm.REGEX:
        fullmatch = match.regex.fullmatch  # type: ignore[union-attr]
        return lambda host, path, headers, target: fullmatch(path)
    exact = match.path
    if match.case_sensitive:
        return lambda host, path, headers, target: path == exact
    folded = exact.casefold()
    return lambda host, path, headers, target: path.casefold() == folded


def _value_fits(condition: ValueMatch) -> Callable[[str | None], bool]:
    """Whether a value (None: absent) fits `condition`."""
    if not condition.present:
        return lambda value: value is None
    if condition.exact is not None:
        exact = condition.exact
        return lambda value: value == exact
    if condition.regex is not None:
        fullmatch = condition.regex.fullmatch
        return lambda value: value is not None and fullmatch(value)
    return lambda value: value is not None


def _header_condition(condition: ValueMatch) -> _Condition:
    name, fits = condition.name, _value_fits(condition)
    alias = cgi_name(name)

    def header(host: str, path: str, headers: MultiMapping[str], target: URL) -> bool:
        lines = headers.getall(name, ())
        if len(lines) > 1:
            raise ConditionRejected(f"The {name} header appears more than once; {_CHOSEN}.")
        value = lines[0] if lines else None
        if value and not _visible(value):
            raise ConditionRejected(f"The {name} header has characters outside visible ASCII; {_CHOSEN}.")
        if "Connection" in headers and any(
            token.strip().lower() == name for line in headers.getall("Connection") for token in line.split(",")
        ):
            raise ConditionRejected(f"The Connection header names {name}; {_CHOSEN}.")
        if any("_" in n and cgi_name(n) == alias and n.lower() != name for n in headers):
            raise ConditionRejected(f"A header's name reads as {name} under CGI rules (`_` for `-`); {_CHOSEN}.")
        return fits(value)

    return header


def _query_condition(condition: ValueMatch) -> _Condition:
    name, fits = condition.name, _value_fits(condition)
    shown = f"The query parameter {name!r}"

    def query(host: str, path: str, headers: MultiMapping[str], target: URL) -> bool:
        raw = target.raw_query_string
        if not raw:
            return fits(None)
        if not _visible(raw) or " " in raw:
            # Raw bytes outside ASCII are re-encoded on the way out, and may name `name` there.
            raise ConditionRejected(f"The query string has characters outside visible ASCII; {_CHOSEN}.")
        if ";" in raw and _named_after_semicolon(raw, name):
            # Rack 2 and Python's parse_qs before 3.9.2 split on ";" too: `x=0;debug=1` names debug.
            raise ConditionRejected(f"{shown} follows a ';', which some servers split queries on; {_CHOSEN}.")
        values = target.query.getall(name, ())
        if len(values) > 1:
            raise ConditionRejected(f"{shown} appears more than once; {_CHOSEN}.")
        value = values[0] if values else None
        if value and (";" in value or not _visible(value)):
            raise ConditionRejected(f"{shown} holds ';' or characters outside visible ASCII; {_CHOSEN}.")
        return fits(value)

    return query


def _visible(value: str) -> bool:
    """Non-empty `value` is visible ASCII, spaces only inside: read by the upstream as by us
    (the same rule as gateway.identity.values', whose package imports this module)."""
    return value.isascii() and value.isprintable() and value[0] != " " and value[-1] != " "


def _named_after_semicolon(query: str, name: str) -> bool:
    """Whether a parameter called `name` follows a ";" in the raw `query`."""
    return any(
        urllib.parse.unquote_plus(piece.partition("=")[0]) == name
        for pair in query.split("&")
        for piece in pair.split(";")[1:]
    )


# --- shadowing, for `gateway check` ---------------------------------------------------


def shadowed(routes: Sequence[Matchable]) -> list[tuple[int, int]]:
    """(later, earlier) index pairs: every request the later route could match, the earlier
    one matches first, so the later is never reached. Only certain cases are reported: an
    earlier route's conditions must be a subset of the later's, and its path cover the later's.

    An earlier prefix or exact route can cover a later one only when its path is the later
    path or one of its segment prefixes, so only those are looked up, by path: a config of
    thousands of plain routes is checked in linear time, not in the square of its size."""
    pairs = []
    everywhere: list[int] = []  # regex routes and `/`: they may cover any later route
    by_path: dict[str, list[int]] = {}  # case-sensitive prefix and exact routes
    by_folded: dict[str, list[int]] = {}  # the others, by casefolded path
    for later, route in enumerate(routes):
        match = route.match
        candidates = list(everywhere)
        for table, path in ((by_path, match.path), (by_folded, match.path.casefold())):
            for ancestor in _segment_prefixes(path):
                candidates += table.get(ancestor, ())
        for earlier in sorted(candidates):
            if covers(routes[earlier].match, match):
                pairs.append((later, earlier))
                break
        if match.form is PathForm.REGEX or (match.form is PathForm.PREFIX and match.path == "/"):
            everywhere.append(later)
        elif match.case_sensitive:
            by_path.setdefault(match.path, []).append(later)
        else:
            by_folded.setdefault(match.path.casefold(), []).append(later)
    return pairs


def _segment_prefixes(path: str) -> list[str]:
    """The prefixes `p` for which `path == p or path.startswith(p + "/")`."""
    return [path, *(path[:i] for i, char in enumerate(path) if char == "/")]


def covers(earlier: Match, later: Match) -> bool:
    """Whether every request `later` matches is certainly matched by `earlier` too."""
    if earlier.methods is not None and (later.methods is None or not later.methods <= earlier.methods):
        return False
    if not _host_covers(earlier.host, later.host):
        return False
    if not set(earlier.headers) <= set(later.headers) or not set(earlier.query) <= set(later.query):
        return False
    return _path_covers(earlier, later)


def _host_covers(earlier: str | None, later: str | None) -> bool:
    if earlier is None or earlier == later:
        return True
    if later is None or not earlier.startswith(WILDCARD):
        return False
    # `*.example.com` covers `a.example.com`, `*.a.example.com` and `*.example.com`.
    return later.removeprefix(WILDCARD).endswith(earlier[1:])


def _path_covers(earlier: Match, later: Match) -> bool:
    if earlier.form is PathForm.PREFIX and earlier.path == "/":
        return True  # every path, whatever its case
    if earlier.case_sensitive:
        if not later.case_sensitive:
            return False  # the later route also takes paths in another case
        fold: Callable[[str], str] = str
    else:
        fold = str.casefold  # casefold maps each character alone, so it keeps prefixes prefixes
    if earlier.form is PathForm.PREFIX:
        if later.form is PathForm.REGEX:
            return False
        prefix, path = fold(earlier.path), fold(later.path)
        return path == prefix or path.startswith(prefix + "/")
    if earlier.form is PathForm.EXACT:
        return later.form is PathForm.EXACT and fold(later.path) == fold(earlier.path)
    if later.form is PathForm.REGEX:
        return later.path == earlier.path  # the same pattern; earlier's case rules checked above
    # An exact path is one string, which the earlier regex matches or not; a later prefix is
    # many, which are not all checked.
    return later.form is PathForm.EXACT and earlier.regex is not None and earlier.regex.fullmatch(later.path)
