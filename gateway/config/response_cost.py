"""A limit's `cost` read from the response: `cost: {from: SOURCE, reserve: N, missing: M}`.

The reservation is taken before forwarding, with the route's other limits, all or nothing;
when the response has ended, what it says less the reservation is settled: the difference
goes back, or the bucket goes into debt (gateway.limiter.settlement). Trusts nothing in
the file: the source is checked for its form here; reading a response is the usage
reader's.
"""

from __future__ import annotations

from typing import Any

from gateway.config.model import ResponseCost
from gateway.config.reader import _Reader
from gateway.config.usage import UsageSource, parse_usage_source


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


def _source(value: Any, path: str, r: _Reader) -> UsageSource:
    text = r.string(value, path)
    try:
        return parse_usage_source(text)
    except ValueError as exc:
        r.fail(path, str(exc))
