"""A limit's `cost` read from the response: `cost: {from: SOURCE, reserve: N, missing: M}`.

The reservation is taken before forwarding, with the route's other limits, all or nothing;
when the response has ended, what it says less the reservation is settled: the difference
goes back, or the bucket goes into debt (gateway.limiter.settlement). Trusts nothing in
the file: the source is checked for its form here; reading a response is the usage
reader's.
"""

from __future__ import annotations

import re
from typing import Any

from gateway.config.http_names import HTTP_TOKEN_RE
from gateway.config.model import ResponseCost
from gateway.config.reader import _Reader

# A member path in a JSON body: names separated by dots, as `usage.total_tokens`.
_JSON_PATH_RE = re.compile(r"^[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*$")
SOURCES = "json:PATH, sse-json:PATH, header:NAME or response-bytes"


def parse_response_cost(doc: Any, path: str, burst: float, r: _Reader) -> ResponseCost:
    """`burst`: the limit's; a reservation past it could never be taken."""
    spec = r.mapping(doc, path, required=("from",), optional=("reserve", "missing"))
    source = _source(spec["from"], f"{path}.from", r)
    if "reserve" not in spec:
        r.fail(path, "`reserve` is required: the units taken before forwarding, settled when the response says its cost")
    reserve = r.count(spec["reserve"], f"{path}.reserve")
    if reserve > burst:
        r.fail(f"{path}.reserve", f"a reservation of {reserve} is more than the burst {burst:g}; it could never be taken")
    # Without `missing`, a response that says nothing costs what was reserved: the budget a
    # client holds up front is what it may spend unseen.
    missing = r.integer(spec.get("missing", reserve), f"{path}.missing", minimum=0)
    return ResponseCost(source=source, reserve=reserve, missing=missing)


def _source(value: Any, path: str, r: _Reader) -> str:
    text = r.string(value, path)
    if text == "response-bytes":
        return text
    kind, sep, name = text.partition(":")
    if not sep or not name or kind not in ("json", "sse-json", "header"):
        r.fail(path, f"expected {SOURCES}, got {text!r}")
    if kind == "header":
        if not HTTP_TOKEN_RE.match(name):
            r.fail(path, f"{name!r} is not a valid header name")
        return f"header:{name.lower()}"
    if not _JSON_PATH_RE.match(name):
        r.fail(path, f"expected a member path such as usage.total_tokens, got {name!r}")
    return text
