"""The access log: off by default; one line per request, as text or JSON, when asked for.

The lines go to stdout and nothing else does, so `--access-log json` output is
one JSON object per line; the gateway's own log stays on stderr.

Query values are never written: API keys travel in them (`query:NAME` identities,
`?token=`), and a log is read by more people than the keys are meant for. Each
parameter keeps its name and its value becomes `***`.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import TextIO

from aiohttp.abc import AbstractAccessLogger
from aiohttp.web import BaseRequest, StreamResponse


def redacted_target(request: BaseRequest) -> str:
    """The request target as received, each query value (or bare item) replaced by `***`."""
    path, question, query = request.raw_path.partition("?")
    if not question:
        return path
    items = (item.partition("=") for item in query.split("&"))
    return path + "?" + "&".join(name + "=***" if equals else "***" for name, equals, _ in items)


def _fields(request: BaseRequest, response: StreamResponse, duration: float) -> dict[str, object]:
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "remote": request.remote,
        "method": request.method,
        "path": redacted_target(request),
        "status": response.status,
        "bytes": response.body_length,
        "duration_ms": round(duration * 1000, 3),
        "user_agent": request.headers.get("User-Agent", ""),
    }


class TextAccessLogger(AbstractAccessLogger):
    def log(self, request: BaseRequest, response: StreamResponse, time: float) -> None:
        f = _fields(request, response, time)
        self.logger.info(
            '%s %s "%s %s" %s %s %.3fms "%s"',
            f["time"], f["remote"], f["method"], f["path"], f["status"], f["bytes"], f["duration_ms"], f["user_agent"],
        )


class JsonAccessLogger(AbstractAccessLogger):
    def log(self, request: BaseRequest, response: StreamResponse, time: float) -> None:
        self.logger.info(json.dumps(_fields(request, response, time)))


ACCESS_LOG_FORMATS = {"text": TextAccessLogger, "json": JsonAccessLogger}
access_logger = logging.getLogger("gateway.access")


def enable_access_log(stream: TextIO | None = None) -> None:
    """Write access lines, bare and unprefixed, to `stream` (stdout by default), whatever the log level."""
    handler = logging.StreamHandler(stream or sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    access_logger.handlers[:] = [handler]
    access_logger.setLevel(logging.INFO)
    access_logger.propagate = False
