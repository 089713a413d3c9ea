"""The access log: off by default; one line per request, as text or JSON, when asked for.

The lines go to stdout and nothing else does, so `--access-log json` output is
one JSON object per line; the gateway's own log stays on stderr.

Each line carries the peer (`remote`) and the client address as resolved
through `trusted_proxies` (`client`), the route, the limit decision with each
limit's outcome, the upstream's status and latency, and the request id. The
handler fills an `AccessRecord` with references only; everything written is
formed here, and only when the log is on.

Query values are never written: API keys travel in them (`query:NAME` identities,
`?token=`), and a log is read by more people than the keys are meant for. Each
parameter keeps its name and its value becomes `***`. A limit's identity (an API
key, a token claim, an address) appears only as a keyed hash: 64 bits of BLAKE2b
keyed by `store.key_secret` when set, so lines of every process and restart
agree, else by a secret drawn when the process starts, good within it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import TextIO

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.web import BaseRequest, StreamResponse

from gateway.limiter.limiter import Decision
from gateway.limiter.store import LimitCheck
from gateway.proxy.client_identity import ClientIdentity, IdentityRejected

# What X-Request-ID may hold to be passed on as the client sent it: short, and nothing
# that could break a text log line or a header. Anything else is replaced by a new id.
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:+/=@-]{1,128}")
# 16 hex digits: enough to tell a log's clients apart, too short to be worth reversing.
IDENTITY_HASH_BYTES = 8


def request_id(sent: str | None) -> str:
    """The id of a request: the client's X-Request-ID when it is a plain token, else 128 random bits in hex."""
    if sent is not None and _REQUEST_ID_RE.fullmatch(sent):
        return sent
    return os.urandom(16).hex()


class AccessRecord:
    """What the handler learnt of one request, for its access line."""

    __slots__ = (
        "request_id", "identity", "secret", "route", "client", "checks", "decision", "upstream_status", "upstream_ms"
    )

    def __init__(self, request_id: str, identity: ClientIdentity, secret: bytes) -> None:
        self.request_id = request_id
        self.identity = identity
        self.secret = secret
        self.route: str | None = None
        self.client: str | None = None  # resolved by the limiter's path; else resolved when logged
        self.checks: Sequence[LimitCheck] = ()
        self.decision: Decision | None = None
        self.upstream_status: int | None = None
        self.upstream_ms: float | None = None


# Keys identity hashes when store.key_secret is not set: one per process, so a reload keeps it.
PROCESS_LOG_SECRET = os.urandom(32)
ACCESS_RECORD = web.RequestKey("gateway.access_record", AccessRecord)


def identity_hash(secret: bytes, identity: str) -> str:
    data = identity.encode("utf-8", "surrogateescape")
    return hashlib.blake2b(data, key=secret[:64], digest_size=IDENTITY_HASH_BYTES).hexdigest()


def redacted_target(request: BaseRequest) -> str:
    """The request target as received, each query value (or bare item) replaced by `***`."""
    path, question, query = request.raw_path.partition("?")
    if not question:
        return path
    items = (item.partition("=") for item in query.split("&"))
    return path + "?" + "&".join(name + "=***" if equals else "***" for name, equals, _ in items)


def _client(request: BaseRequest, record: AccessRecord | None) -> str | None:
    if record is None:
        return request.remote
    if record.client is None:
        try:
            record.client = record.identity.client_ip(request)
        except IdentityRejected:
            return request.remote  # its X-Forwarded-For could not be read
    return record.client


def _limits(record: AccessRecord | None) -> tuple[str | None, list[dict[str, str]]]:
    decision = record.decision if record is not None else None
    if decision is None or not decision.statuses:
        return None, []
    overall = "allow" if decision.allowed else ("store_failed" if decision.store_failed else "deny")
    limits = [
        {"name": status.limit.name, "decision": status.outcome, "identity": identity_hash(record.secret, check.identity)}
        for status, check in zip(decision.statuses, record.checks)
    ]
    return overall, limits


def _fields(request: BaseRequest, response: StreamResponse, duration: float) -> dict[str, object]:
    record = request.get(ACCESS_RECORD)
    decision, limits = _limits(record)
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "remote": request.remote,
        "method": request.method,
        "path": redacted_target(request),
        "status": response.status,
        "bytes": response.body_length,
        "duration_ms": round(duration * 1000, 3),
        "user_agent": request.headers.get("User-Agent", ""),
        "client": _client(request, record),
        "request_id": record.request_id if record is not None else None,
        "route": record.route if record is not None else None,
        "decision": decision,
        "limits": limits,
        "upstream_status": record.upstream_status if record is not None else None,
        "upstream_ms": record.upstream_ms if record is not None else None,
    }


def _text(value: object) -> str:
    return "-" if value is None else str(value)


class TextAccessLogger(AbstractAccessLogger):
    def log(self, request: BaseRequest, response: StreamResponse, time: float) -> None:
        f = _fields(request, response, time)
        limits = ",".join(f"{x['name']}:{x['decision']}:{x['identity']}" for x in f["limits"]) or "-"  # type: ignore[attr-defined]
        self.logger.info(
            '%s %s "%s %s" %s %s %.3fms "%s" client=%s request_id=%s route=%s decision=%s limits=%s upstream_status=%s upstream_ms=%s',
            f["time"], f["remote"], f["method"], f["path"], f["status"], f["bytes"], f["duration_ms"], f["user_agent"],
            _text(f["client"]), _text(f["request_id"]), "-" if f["route"] is None else f'"{f["route"]}"',
            _text(f["decision"]), limits, _text(f["upstream_status"]), _text(f["upstream_ms"]),
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
