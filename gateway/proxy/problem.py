"""Error responses as RFC 9457 problem details (application/problem+json)."""

from __future__ import annotations

import json
from collections.abc import Mapping

from aiohttp import web

PROBLEM_CONTENT_TYPE = "application/problem+json"


def problem(
    status: int, title: str, detail: str, *, headers: Mapping[str, str] | None = None, **extra: object
) -> web.Response:
    body = {"type": "about:blank", "title": title, "status": status, "detail": detail, **extra}
    response = web.Response(status=status, text=json.dumps(body), headers=headers)
    response.content_type = PROBLEM_CONTENT_TYPE
    return response
