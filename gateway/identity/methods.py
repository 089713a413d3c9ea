"""A request's method as a bounded value, for `method` identity sources and metric labels.

Trusts nothing: the method is whatever the client sent, so anything outside the
fixed set reads as OTHER, and no client can mint a bucket or a label series.
Pure; imported by gateway.metrics as well as by the identity code.
"""

from __future__ import annotations

# The methods of RFC 9110 §9 and PATCH; everything else a client sends is OTHER.
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "CONNECT", "TRACE"})


def method_label(method: str) -> str:
    """`method` if it is one of KNOWN_METHODS (as sent, so case counts), else "OTHER"."""
    return method if method in KNOWN_METHODS else "OTHER"
