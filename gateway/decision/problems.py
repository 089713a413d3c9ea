"""RFC 9457 problem details (application/problem+json) as bytes: the bodies of the gateway's
own refusals, serialised once and, where one value varies (the seconds to wait), split around
it. Pure: no I/O and no HTTP library. Trusts its callers: titles, details and names come from
the config or from code, never from a request."""

from __future__ import annotations

import json
from dataclasses import dataclass

PROBLEM_CONTENT_TYPE = "application/problem+json"
PROBLEM_CONTENT_TYPE_HEADER = PROBLEM_CONTENT_TYPE + "; charset=utf-8"
# Stands for the one value a ProblemTemplate leaves open; JSON writes it as \u0000,
# which no title, detail or limit name contains.
_BLANK = "\x00"
_BLANK_JSON = json.dumps(_BLANK)[1:-1].encode()

# The default problem type (RFC 9457 §4.2.1): the status alone says what happened.
ABOUT_BLANK = "about:blank"
# The problem types draft-ietf-httpapi-ratelimit-headers registers, each with the member
# "violated-policies": the names of the limits (policies) concerned.
QUOTA_EXCEEDED = "https://iana.org/assignments/http-problem-types#quota-exceeded"
REDUCED_CAPACITY = "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity"
VIOLATED_POLICIES = "violated-policies"


def problem_body(status: int, title: str, detail: str, *, kind: str = ABOUT_BLANK, **extra: object) -> bytes:
    """`kind`: the problem's type URI; about:blank says the status alone tells what happened."""
    body = {"type": kind, "title": title, "status": status, "detail": detail, **extra}
    return json.dumps(body).encode()


@dataclass(frozen=True, slots=True)
class ProblemTemplate:
    """A problem body serialised once around one blank in its detail, so a response
    that differs only in that value (the seconds to wait) costs a concatenation."""

    head: bytes
    tail: bytes

    @classmethod
    def of(cls, status: int, title: str, detail: str, *, kind: str = ABOUT_BLANK, **extra: object) -> ProblemTemplate:
        """`detail` holds "{}" where each body's value goes, or nothing for a fixed body."""
        head, _, tail = problem_body(status, title, detail.format(_BLANK), kind=kind, **extra).partition(_BLANK_JSON)
        return cls(head=head, tail=tail)

    def body(self, value: str = "") -> bytes:
        return self.head + value.encode() + self.tail
