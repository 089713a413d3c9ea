"""The gateway's own answers as aiohttp responses: RFC 9457 problem details (their bytes
are gateway.decision.problems'), and the response class that carries them and every other
answer made from parts built once.

Trusts its callers: bodies and fixed headers come from the config or from code, never
from a request; only the varying fields (Retry-After, the RateLimit fields, X-Request-ID)
are written per request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from aiohttp import hdrs, web
from multidict import CIMultiDict

from gateway.decision.problems import ABOUT_BLANK, PROBLEM_CONTENT_TYPE_HEADER, problem_body

RETRY_AFTER_ONE = {"Retry-After": "1"}  # the gateway's 503s; shared safely: a Response copies the headers it is given


class Answer(web.Response):
    """A response whose body is bytes and whose headers the caller has made, Content-Length
    among them: aiohttp's Response.__init__ copies the headers, checks the content type and
    sorts the body out, for every answer, which for parts built once is wasted work."""

    # Read only when compressing, which nothing enables on these answers.
    _zlib_executor_size = 0
    _zlib_executor = None

    def __init__(self, status: int, body: bytes, headers: CIMultiDict[str]) -> None:
        web.StreamResponse.__init__(self, status=status, _real_headers=headers)
        self._body = body


def answer_headers(content_type: str, body: bytes) -> CIMultiDict[str]:
    """The fixed headers of a prebuilt body, for `answer` to extend per request."""
    return CIMultiDict(((hdrs.CONTENT_TYPE, content_type), (hdrs.CONTENT_LENGTH, str(len(body)))))


def answer(
    status: int, body: bytes, fixed: CIMultiDict[str], headers: Mapping[str, str] | None = None
) -> web.Response:
    """A response with `fixed` (answer_headers) after the varying `headers`."""
    if headers:
        real = CIMultiDict(headers)
        real.extend(fixed)
    else:
        real = fixed.copy()
    return Answer(status, body, real)


def problem_response(status: int, body: bytes, *, headers: Mapping[str, str] | None = None) -> web.Response:
    """A response with a body from problem_body or a ProblemTemplate."""
    real = CIMultiDict(headers) if headers else CIMultiDict()
    real[hdrs.CONTENT_TYPE] = PROBLEM_CONTENT_TYPE_HEADER
    real[hdrs.CONTENT_LENGTH] = str(len(body))
    return Answer(status, body, real)


def problem(
    status: int,
    title: str,
    detail: str,
    *,
    headers: Mapping[str, str] | None = None,
    kind: str = ABOUT_BLANK,
    **extra: object,
) -> web.Response:
    return problem_response(status, problem_body(status, title, detail, kind=kind, **extra), headers=headers)


@dataclass(frozen=True, slots=True)
class Problem:
    """A fixed problem+json answer, serialised once with its headers."""

    status: int
    body: bytes
    fixed: CIMultiDict[str]

    @classmethod
    def of(cls, status: int, title: str, detail: str, *, kind: str = ABOUT_BLANK, **extra: object) -> Problem:
        body = problem_body(status, title, detail, kind=kind, **extra)
        return cls(status=status, body=body, fixed=answer_headers(PROBLEM_CONTENT_TYPE_HEADER, body))

    def response(self, headers: Mapping[str, str] | None = None) -> web.Response:
        return answer(self.status, self.body, self.fixed, headers)
