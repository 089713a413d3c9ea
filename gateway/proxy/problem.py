"""Error responses as RFC 9457 problem details (application/problem+json)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from aiohttp import web

PROBLEM_CONTENT_TYPE = "application/problem+json"
# Stands for the one value a ProblemTemplate leaves open; JSON writes it as \u0000,
# which no title, detail or limit name contains.
_BLANK = "\x00"
_BLANK_JSON = json.dumps(_BLANK)[1:-1].encode()


def problem_body(status: int, title: str, detail: str, **extra: object) -> bytes:
    body = {"type": "about:blank", "title": title, "status": status, "detail": detail, **extra}
    return json.dumps(body).encode()


def problem_response(status: int, body: bytes, *, headers: Mapping[str, str] | None = None) -> web.Response:
    """A response with a body from problem_body or a ProblemTemplate."""
    return web.Response(status=status, body=body, headers=headers, content_type=PROBLEM_CONTENT_TYPE, charset="utf-8")


def problem(
    status: int, title: str, detail: str, *, headers: Mapping[str, str] | None = None, **extra: object
) -> web.Response:
    return problem_response(status, problem_body(status, title, detail, **extra), headers=headers)


@dataclass(frozen=True, slots=True)
class ProblemTemplate:
    """A problem body serialised once around one blank in its detail, so a response
    that differs only in that value (the seconds to wait) costs a concatenation."""

    head: bytes
    tail: bytes

    @classmethod
    def of(cls, status: int, title: str, detail: str, **extra: object) -> ProblemTemplate:
        """`detail` holds "{}" where each body's value goes, or nothing for a fixed body."""
        head, _, tail = problem_body(status, title, detail.format(_BLANK), **extra).partition(_BLANK_JSON)
        return cls(head=head, tail=tail)

    def body(self, value: str = "") -> bytes:
        return self.head + value.encode() + self.tail
