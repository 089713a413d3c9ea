"""The `routes` list: each route's `match` (path syntax, methods, host, header and query
conditions), the limits it applies, its header rewrites and its timeouts.

Trusts nothing in the file. A path that could never match a request as
gateway.proxy.paths reads it is refused, as is a header rule that would rewrite what
the gateway writes itself, or a value that could end a header line early.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from gateway.config.http_names import FORWARDING, HOP_BY_HOP, HOST_RE, HTTP_TOKEN_RE
from gateway.config.model import ConcurrencyLimit, HeaderRules, Limit, Match, PathForm, Route, RouteLimit, UpstreamTimeout, ValueMatch
from gateway.config.pool_model import UpstreamPool
from gateway.config.reader import _join, _Reader, _suggestion, _type_name
from gateway.config.regex import Regex
from gateway.config.units import parse_duration, parse_size
from gateway.config.upstreams import _pool, _SharedTargets, _upstream_url

DEFAULT_CONNECT_TIMEOUT = "5s"
DEFAULT_READ_TIMEOUT = "60s"
# A request waits this long for a free connection to its upstream before a 503: a
# saturated upstream answers at once that it is, instead of queueing clients unboundedly.
DEFAULT_QUEUE_TIMEOUT = "1s"
# The IANA HTTP Method Registry, less CONNECT (never routed: the gateway is no tunnel) and
# PRI (the HTTP/2 preface). A method outside it in `match.methods` is a typo such as GTE.
ROUTABLE_METHODS = frozenset(
    {
        "ACL", "BASELINE-CONTROL", "BIND", "CHECKIN", "CHECKOUT", "COPY", "DELETE", "GET", "HEAD", "LABEL",
        "LINK", "LOCK", "MERGE", "MKACTIVITY", "MKCALENDAR", "MKCOL", "MKREDIRECTREF", "MKWORKSPACE", "MOVE",
        "OPTIONS", "ORDERPATCH", "PATCH", "POST", "PROPFIND", "PROPPATCH", "PUT", "QUERY", "REBIND", "REPORT",
        "SEARCH", "TRACE", "UNBIND", "UNCHECKOUT", "UNLINK", "UNLOCK", "UPDATE", "UPDATEREDIRECTREF",
        "VERSION-CONTROL",
    }
)
# Headers a route may not rewrite. Hop-by-hop fields describe one connection, and
# Content-Length is set by the HTTP library from the body each leg actually carries.
# Going upstream, the forwarding headers, Host (see preserve_host) and X-Request-ID
# are the gateway's to write; coming back, X-Request-ID and the RateLimit fields.
_UNREWRITABLE = HOP_BY_HOP | {"content-length", "x-request-id"}
_UNREWRITABLE_REQUEST_HEADERS = _UNREWRITABLE | FORWARDING | {"host"}
_UNREWRITABLE_RESPONSE_HEADERS = _UNREWRITABLE | {
    "ratelimit", "ratelimit-policy", "x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-reset"
}
_WILDCARD_HOST_PREFIX = "*."
_NOT_IN_ROUTE_PATH = re.compile(r"[%;?#\\\x00-\x1f\x7f]")
# A header value as a route sets it: visible ASCII, spaces and tabs inside (RFC 9110 §5.5),
# so no value can end a header line early.
_HEADER_VALUE_RE = re.compile(r"[!-~](?:[ \t!-~]*[!-~])?|")


def _route(
    doc: Any, path: str, limits: Mapping[str, Limit | ConcurrencyLimit | None], targets: _SharedTargets, r: _Reader
) -> Route:
    spec = r.mapping(
        doc,
        path,
        required=("match", "upstream"),
        optional=(
            "limits",
            "strip_prefix",
            "preserve_host",
            "allow_path_parameters",
            "timeout",
            "max_body_size",
            "request_headers",
            "response_headers",
        ),
    )
    match = _match(spec["match"], f"{path}.match", r)
    strip_prefix = r.boolean(spec.get("strip_prefix", False), f"{path}.strip_prefix")
    if strip_prefix and match.form is not PathForm.PREFIX:
        r.fail(f"{path}.strip_prefix", f"needs a prefix to strip: match.path, not match.{match.form.value}")
    if isinstance(spec["upstream"], dict):
        upstream: str | UpstreamPool = _pool(spec["upstream"], f"{path}.upstream", targets, r)
    elif isinstance(spec["upstream"], list):
        r.fail(f"{path}.upstream", "expected a URL, or a pool as {targets: [URL, ...]}, got a list")
    else:
        upstream = _upstream_url(spec["upstream"], f"{path}.upstream", r)
    # Each entry read on its own, so every undefined name is reported; one that names a
    # broken limit (None) was reported with that limit.
    entries = (
        r.attempt(f"{path}.limits[{i}]", None, _route_limit, item, f"{path}.limits[{i}]", limits, r)
        for i, item in enumerate(r.sequence(spec.get("limits", []), f"{path}.limits"))
    )
    listed = [entry for entry in entries if entry is not None]
    route_limits = [entry for entry in listed if isinstance(entry, RouteLimit)]
    concurrency = tuple(entry for entry in listed if isinstance(entry, ConcurrencyLimit))
    names = [entry.name if isinstance(entry, ConcurrencyLimit) else entry.limit.name for entry in listed]
    if len(set(names)) != len(names):
        r.fail(f"{path}.limits", "a limit may appear only once per route")
    preserve_host = r.boolean(spec.get("preserve_host", False), f"{path}.preserve_host")
    for i, entry in enumerate(listed):
        limit = entry if isinstance(entry, ConcurrencyLimit) else entry.limit
        if not preserve_host and any(leaf.kind == "header" and leaf.name == "host" for s in limit.key for leaf in s.leaves):
            # The upstream would be charged one client and see another.
            r.fail(
                f"{path}.limits[{i}]",
                f"limit {limit.name!r} reads header:Host, which this route replaces with the upstream's host; "
                "set preserve_host: true",
            )
    request_headers = _header_rules(
        spec.get("request_headers", {}), f"{path}.request_headers", _UNREWRITABLE_REQUEST_HEADERS, r
    )
    rewritten = set(request_headers.remove) | {name.lower() for name, _ in request_headers.set + request_headers.add}
    for i, rl in enumerate(route_limits):
        for source in rl.limit.key:
            read = {"header": source.name, "cookie": "cookie", "jwt": "authorization"}.get(source.kind)
            if read in rewritten:
                # The limit would charge the client by one value and the upstream see another.
                r.fail(
                    f"{path}.request_headers",
                    f"rewrites {read}, which limit {rl.limit.name!r} (limits[{i}]) reads as its identity",
                )
    timeout_doc = r.mapping(spec.get("timeout", {}), f"{path}.timeout", optional=("connect", "read", "queue", "total"))
    timeout = UpstreamTimeout(
        connect=r.parsed(parse_duration, timeout_doc.get("connect", DEFAULT_CONNECT_TIMEOUT), f"{path}.timeout.connect"),
        read=r.parsed(parse_duration, timeout_doc.get("read", DEFAULT_READ_TIMEOUT), f"{path}.timeout.read"),
        queue=r.parsed(parse_duration, timeout_doc.get("queue", DEFAULT_QUEUE_TIMEOUT), f"{path}.timeout.queue"),
        total=(
            r.parsed(parse_duration, timeout_doc["total"], f"{path}.timeout.total") if "total" in timeout_doc else None
        ),
    )
    max_body_size = spec.get("max_body_size")
    return Route(
        match=match,
        upstream=upstream,
        limits=tuple(route_limits),
        strip_prefix=strip_prefix,
        preserve_host=preserve_host,
        timeout=timeout,
        allow_path_parameters=r.boolean(spec.get("allow_path_parameters", False), f"{path}.allow_path_parameters"),
        max_body_size=r.parsed(parse_size, max_body_size, f"{path}.max_body_size") if max_body_size is not None else None,
        concurrency=concurrency,
        request_headers=request_headers,
        response_headers=_header_rules(
            spec.get("response_headers", {}), f"{path}.response_headers", _UNREWRITABLE_RESPONSE_HEADERS, r
        ),
    )


def _route_limit(
    item: Any, path: str, limits: Mapping[str, Limit | ConcurrencyLimit | None], r: _Reader
) -> RouteLimit | ConcurrencyLimit | None:
    """The entry, or None when it names a limit that is defined but broken."""
    if isinstance(item, str):
        name, cost, name_path = item, 1, path
    elif not isinstance(item, dict):
        r.fail(path, f"expected a limit name or {{name: NAME, cost: N}}, got {_type_name(item)}")
    else:
        spec = r.mapping(item, path, required=("name",), optional=("cost",))
        name, name_path = r.string(spec["name"], f"{path}.name"), f"{path}.name"
        cost = r.integer(spec.get("cost", 1), f"{path}.cost", minimum=0)
    if name not in limits:
        defined = ", ".join(limits) or "none"
        r.fail(
            name_path,
            f"no limit named {name!r} is defined under `limits` (defined: {defined}){_suggestion(name, limits)}",
        )
    limit = limits[name]
    if limit is None:
        return None
    if isinstance(limit, ConcurrencyLimit):
        if cost != 1:
            r.fail(f"{path}.cost", f"limit {name!r} counts requests in flight, one each; a cost does not apply")
        return limit
    if limit.cost is not None:
        if isinstance(item, dict) and "cost" in item:
            r.fail(f"{path}.cost", f"limit {name!r} takes its cost from the response, reserving {limit.cost.reserve} (its cost.reserve)")
        cost = limit.cost.reserve
    if cost > limit.burst:
        r.fail(f"{path}.cost", f"cost {cost} is greater than the burst {limit.burst:g} of limit {name!r}; it could never pass")
    for tier in limit.tiers.limits.values() if limit.tiers else ():
        if cost > tier.burst:
            r.fail(
                f"{path}.cost",
                f"cost {cost} is greater than the burst {tier.burst:g} of tier {tier.name!r}; its clients could never pass",
            )
    return RouteLimit(limit=limit, cost=cost)


def _match(doc: Any, path: str, r: _Reader) -> Match:
    spec = r.mapping(
        doc, path, optional=("path", "exact", "regex", "methods", "host", "case_sensitive", "headers", "query")
    )
    forms = [form for form in PathForm if form.value in spec]
    if len(forms) != 1:
        r.fail(path, "expected exactly one of path (a prefix), exact or regex")
    form = forms[0]
    where = f"{path}.{form.value}"
    written = r.string(spec[form.value], where)
    case_sensitive = r.boolean(spec.get("case_sensitive", True), f"{path}.case_sensitive")
    regex = None
    if form is PathForm.REGEX:
        regex = r.parsed(lambda text: Regex.compile(text, case_sensitive=case_sensitive), written, where)
    else:
        error = _route_path_error(written)
        if error is not None:
            r.fail(where, f"{error}, got {written!r}")
        if form is PathForm.PREFIX:
            written = written.rstrip("/") or "/"
    methods = None
    if "methods" in spec:
        items = r.sequence(spec["methods"], f"{path}.methods")
        for i, method in enumerate(items):
            if not isinstance(method, str) or not HTTP_TOKEN_RE.match(method):
                r.fail(f"{path}.methods[{i}]", f"expected an HTTP method such as GET, got {method!r}")
            if method.upper() == "CONNECT":
                r.fail(f"{path}.methods[{i}]", "CONNECT is never routed: the gateway is a reverse proxy, not a tunnel")
            if method.upper() not in ROUTABLE_METHODS:
                r.fail(f"{path}.methods[{i}]", f"{method!r} is not a registered HTTP method (IANA), such as GET or POST")
        if not items:
            r.fail(f"{path}.methods", "an empty list matches no request; leave methods out to match every method")
        methods = frozenset(m.upper() for m in items)
    host = r.string(spec["host"], f"{path}.host").lower().rstrip(".") if "host" in spec else None
    if host is not None and not HOST_RE.match(host.removeprefix(_WILDCARD_HOST_PREFIX)):
        r.fail(
            f"{path}.host",
            f"expected a host name without a port, such as api.example.com or *.example.com, got {spec['host']!r}",
        )
    return Match(
        path=written,
        form=form,
        regex=regex,
        methods=methods,
        host=host,
        case_sensitive=case_sensitive,
        headers=_value_matches(spec.get("headers", {}), f"{path}.headers", "header", r),
        query=_value_matches(spec.get("query", {}), f"{path}.query", "query parameter", r),
    )


def _value_matches(doc: Any, path: str, kind: str, r: _Reader) -> tuple[ValueMatch, ...]:
    """`{NAME: "v"}` (exactly v), `{NAME: {present: true|false}}`, `{NAME: {exact: "v"}}` or
    `{NAME: {regex: "..."}}`, for each header (names compared case-insensitively) or query parameter."""
    if not isinstance(doc, dict):
        r.fail(path, f"expected a mapping of {kind} names, got {_type_name(doc)}")
    matches: dict[str, ValueMatch] = {}
    for name, value in doc.items():
        where = _join(path, str(name))
        if not isinstance(name, str) or not name or (kind == "header" and not HTTP_TOKEN_RE.match(name)):
            r.fail(where, f"{name!r} is not a valid {kind} name")
        key = name.lower() if kind == "header" else name
        if key in matches:
            r.fail(where, f"{kind} {name!r} is given twice (header names ignore case)")
        if isinstance(value, str):
            matches[key] = ValueMatch(name=key, exact=value)
            continue
        if not isinstance(value, dict):
            r.fail(
                where,
                "expected a string (the exact value) or {present: true|false}, {exact: ...} or {regex: ...}, "
                f"got {_type_name(value)}",
            )
        form = r.mapping(value, where, optional=("present", "exact", "regex"))
        if len(form) != 1:
            r.fail(where, "expected exactly one of present, exact or regex")
        if "present" in form:
            matches[key] = ValueMatch(name=key, present=r.boolean(form["present"], f"{where}.present"))
        elif "exact" in form:
            exact = form["exact"]
            if not isinstance(exact, str):
                r.fail(f"{where}.exact", f"expected a string (quote numbers: \"2\"), got {_type_name(exact)}")
            matches[key] = ValueMatch(name=key, exact=exact)
        else:
            pattern = r.string(form["regex"], f"{where}.regex")
            matches[key] = ValueMatch(name=key, regex=r.parsed(Regex.compile, pattern, f"{where}.regex"))
    return tuple(matches.values())


def _header_rules(doc: Any, path: str, unrewritable: frozenset[str], r: _Reader) -> HeaderRules:
    """A route's `request_headers` or `response_headers`: `set` and `add` map names to values,
    `remove` lists names; a name may appear in only one of them."""
    spec = r.mapping(doc, path, optional=("set", "add", "remove"))
    seen: set[str] = set()

    def name_at(name: Any, where: str) -> str:
        if not isinstance(name, str) or not HTTP_TOKEN_RE.match(name):
            r.fail(where, f"{name!r} is not a valid header name")
        lower = name.lower()
        if lower in unrewritable:
            r.fail(
                where,
                f"{name} is the gateway's to write (hop-by-hop, framing, forwarding, request id or rate-limit fields); "
                "a route may not rewrite it",
            )
        if lower in seen:
            r.fail(where, f"{name} is named more than once in set, add and remove (header names ignore case)")
        seen.add(lower)
        return lower

    def pairs(key: str) -> tuple[tuple[str, str], ...]:
        items = spec.get(key, {})
        if not isinstance(items, dict):
            r.fail(f"{path}.{key}", f"expected a mapping of header names to values, got {_type_name(items)}")
        out = []
        for name, value in items.items():
            where = _join(f"{path}.{key}", str(name))
            name_at(name, where)
            if not isinstance(value, str):
                r.fail(where, f"expected a string (quote numbers: \"2\"), got {_type_name(value)}")
            if not _HEADER_VALUE_RE.fullmatch(value):
                r.fail(where, f"a header value may hold visible ASCII, with spaces and tabs inside only; {_misfit(value)}")
            out.append((name, value))
        return tuple(out)

    rules_set, rules_add = pairs("set"), pairs("add")
    removed = r.sequence(spec.get("remove", []), f"{path}.remove")
    remove = tuple(name_at(name, f"{path}.remove[{i}]") for i, name in enumerate(removed))
    return HeaderRules(set=rules_set, add=rules_add, remove=remove)


def _misfit(value: str) -> str:
    """Where a header value breaks the rule, without quoting it: values are often secrets
    from the environment (`Authorization: "Bearer ${TOKEN}"`)."""
    if value[:1] in (" ", "\t") or value[-1:] in (" ", "\t"):
        return f"this one of {len(value)} characters starts or ends with a space or tab"
    position = next(i for i, char in enumerate(value) if not (" " <= char <= "~" or char == "\t"))
    return f"character {position + 1} of {len(value)} is {value[position]!a}"


def _route_path_error(path: str) -> str | None:
    """Why a route's `match.path` could never match a request path as gateway.proxy.paths
    reads it, or None if it can. It is written decoded, as the upstream's own routes are
    (`/files/my docs`, not `my%20docs`), and none of these survive into a decoded path."""
    if path.startswith(("^", "~")):
        return "a path is a literal prefix; nginx's `~` and a leading `^` are regex syntax: write match.regex"
    if not path.startswith("/"):
        return "expected a path starting with /"
    foreign = _foreign_path_syntax(path)
    if foreign is not None:
        return foreign
    if _NOT_IN_ROUTE_PATH.search(path):
        return "write the path decoded, without %, ;, ?, #, \\ or control characters"
    for segment in path.rstrip("/").split("/")[1:]:
        if segment in ("", ".", ".."):
            return "expected a path without empty, '.' or '..' segments"
        if segment != segment.strip(" "):
            return "a segment may not begin or end with a space"
    return None


def _foreign_path_syntax(path: str) -> str | None:
    """The pattern syntax of other gateways and frameworks, which a literal path would
    match only as written (`/static/*` matches no path but `/static/*` itself)."""
    segments = path.rstrip("/").split("/")[1:]
    # A glob as users write one: `*`, `**`, `api*`, `*.js`; a `*` inside a segment is a sub-delim.
    starred = next((i for i, seg in enumerate(segments) if seg.endswith("*") or seg.startswith("*.")), None)
    if starred is not None:
        prefix = "/" + "/".join(segments[:starred])
        return (
            f"a path is a prefix on whole segments and * is no wildcard: `path: {prefix}` already matches "
            f"{prefix} and everything under it; for a pattern write match.regex"
        )
    if any(segment.startswith(":") or (segment.startswith("{") and segment.endswith("}")) for segment in segments):
        return (
            "a segment such as :id or {id} is a parameter in Express, OpenAPI or Kong, but a literal here: "
            "match the prefix before it, or write match.regex, such as '/users/[^/]+'"
        )
    if path.endswith("$"):
        return "a trailing $ is regex syntax: for this path alone write match.exact, for a pattern match.regex"
    return None
