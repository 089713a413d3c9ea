"""The access log: off by default; one line per request, as text or JSON, when asked for.

The lines go to stdout and nothing else does, so `--access-log json` output is
one JSON object per line; the gateway's own log stays on stderr.

The event loop never writes to stdout: the lines go through
gateway.log_lines.QueuedLines, so a reader of stdout that stalls costs lines,
never requests. At most QUEUE_LINES wait; a line that finds them waiting is
dropped and counted. A clean stop writes the lines queued, giving stdout up to
FLUSH_SECONDS to take them.

Each line carries the peer (`remote`) and the client address as resolved
through `trusted_proxies` (`client`), the route, the limit decision with each
limit's outcome, the upstream's status and latency, and the request id. The
handler fills an `AccessRecord` with references only; everything written is
formed here, and only when the log is on.

Query values are never written: API keys travel in them (`query:NAME` identities,
`?token=`), and a log is read by more people than the keys are meant for. Each
parameter keeps its name and its value becomes `***`; so does the user and password
of an absolute-form target (`GET http://user:pw@host/path`). A limit's identity (an API
key, a token claim, an address) appears only as a keyed hash: 64 bits of BLAKE2b
keyed by `store.key_secret` when set, so lines of every process and restart
agree, else by the process's own secret (`gateway.limiter.keys.PROCESS_SECRET`),
good within it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.web import BaseRequest, StreamResponse

from gateway.identity.sources import ClientIdentity
from gateway.identity.values import IdentityRejected
from gateway.limiter.concurrency import Admission
from gateway.limiter.decision import Decision
from gateway.limiter.keys import identity_digest
from gateway.limiter.store import LimitCheck
from gateway.log_lines import FLUSH_SECONDS, QueuedLines

# What X-Request-ID may hold to be passed on as the client sent it: short, and nothing
# that could break a text log line or a header. Anything else is replaced by a new id.
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:+/=@-]{1,128}")
# 16 hex digits: enough to tell a log's clients apart, too short to be worth reversing.
IDENTITY_HASH_BYTES = 8
# What a text line writes as it is: printable ASCII but `"` and `\`. Everything else a client
# can send (a quote or backslash in its User-Agent or target, a control character, any
# non-ASCII byte, U+2028 and U+0085 among them, which some readers take for line breaks)
# becomes \xHH per byte, as nginx writes it, so no field can end early or forge another.
_TEXT_UNSAFE = re.compile(r'[^\x20\x21\x23-\x5b\x5d-\x7e]+')
# A byte that is not UTF-8 arrives as a lone surrogate (surrogateescape), which json.dumps
# writes as "\udcff": valid to Python, refused by strict parsers (Perl's JSON::PP), so a
# shipper may drop the line. A JSON line writes such bytes as \xHH, as a text line does.
_SURROGATES = re.compile("[\ud800-\udfff]+")


# Fresh ids are cut from random bytes drawn this many at a time: one getrandom call
# for 256 requests rather than one each (~1 µs), 4 KiB held.
IDS_PER_DRAW = 256


def _fresh_ids() -> Iterator[str]:
    while True:
        drawn = os.urandom(16 * IDS_PER_DRAW).hex()
        for start in range(0, len(drawn), 32):
            yield drawn[start : start + 32]


_ids = _fresh_ids()


def _new_ids_after_fork() -> None:
    # A forked worker must not hand out the ids its parent had drawn and not yet used.
    global _ids
    _ids = _fresh_ids()


os.register_at_fork(after_in_child=_new_ids_after_fork)


def request_id(sent: str | None) -> str:
    """The id of a request: the client's X-Request-ID when it is a plain token, else 128 random bits in hex."""
    if sent is not None and _REQUEST_ID_RE.fullmatch(sent):
        return sent
    return next(_ids)


class AccessRecord:
    """What the handler learnt of one request, for its access line."""

    __slots__ = (
        "admission",
        "checks",
        "client",
        "decision",
        "identity",
        "lease_identities",
        "request_id",
        "route",
        "secret",
        "started",
        "upstream_ms",
        "upstream_status",
        "upstream_target",
    )

    def __init__(self, request_id: str, identity: ClientIdentity, secret: bytes) -> None:
        # Not aiohttp's loop.time(): uvloop keeps it in whole milliseconds, read once per loop
        # iteration, too coarse for answers that take a fraction of one.
        self.started = time.perf_counter()
        self.request_id = request_id
        self.identity = identity
        self.secret = secret
        self.route: str | None = None
        self.client: str | None = None  # resolved by the limiter's path; else resolved when logged
        self.checks: Sequence[LimitCheck] = ()
        self.decision: Decision | None = None
        self.upstream_status: int | None = None
        self.upstream_ms: float | None = None
        self.upstream_target: str | None = None  # the pool target that answered (the last one tried), by name
        self.admission: Admission | None = None  # the route's concurrency limits, asked after its rate limits allowed
        self.lease_identities: Sequence[str] = ()


ACCESS_RECORD = web.RequestKey("gateway.access_record", AccessRecord)


def redacted_target(request: BaseRequest) -> str:
    """The request target as received, each query value (or bare item) replaced by `***`, and
    the user information of an absolute-form target (`http://user:password@host/`) by `***`."""
    path, question, query = request.raw_path.partition("?")
    scheme, authority_follows, rest = path.partition("://")
    if authority_follows and not path.startswith("/"):
        authority, slash, tail = rest.partition("/")
        _, at, host = authority.rpartition("@")
        if at:
            path = f"{scheme}://***@{host}{slash}{tail}"
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
    if record is None:
        return None, []
    decision, admission = record.decision, record.admission
    outcomes = []
    if decision is not None:
        outcomes += [(s.limit.name, s.outcome, c.identity) for s, c in zip(decision.statuses, record.checks)]
    if admission is not None:
        outcomes += [(s.limit.name, s.outcome, who) for s, who in zip(admission.statuses, record.lease_identities)]
    if not outcomes:
        return None, []
    if decision is not None and not decision.allowed:
        overall = "store_failed" if decision.store_failed else "deny"
    elif admission is not None and not admission.admitted:
        overall = "store_failed" if admission.store_failed else "deny"
    else:
        overall = "allow"
    limits = [
        {"name": name, "decision": outcome, "identity": identity_digest(record.secret, identity, IDENTITY_HASH_BYTES)}
        for name, outcome, identity in outcomes
    ]
    return overall, limits


def _fields(request: BaseRequest, response: StreamResponse, duration: float) -> dict[str, object]:
    """`duration`: aiohttp's, used only for a request the handler never saw (one the parser refused)."""
    record = request.get(ACCESS_RECORD)
    decision, limits = _limits(record)
    if record is not None:
        duration = time.perf_counter() - record.started
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
        "upstream_target": record.upstream_target if record is not None else None,
    }


def _text(value: object) -> str:
    return "-" if value is None else str(value)


def _hex_bytes(unsafe: re.Match[str]) -> str:
    return "".join(f"\\x{byte:02X}" for byte in unsafe.group().encode("utf-8", "surrogateescape"))


def _escaped(value: object) -> str:
    """`value` as a text line writes it: see _TEXT_UNSAFE."""
    return _TEXT_UNSAFE.sub(_hex_bytes, str(value))


def _undecodable_bytes(unsafe: re.Match[str]) -> str:
    # surrogatepass for a surrogate no byte became (none is expected): never a traceback.
    return "".join(
        f"\\x{byte:02X}"
        for char in unsafe.group()
        for byte in char.encode("utf-8", "surrogateescape" if "\udc80" <= char <= "\udcff" else "surrogatepass")
    )


def _json_text(value: str | None) -> str | None:
    """A client's text for a JSON line: its undecodable bytes as \\xHH (see _SURROGATES)."""
    if value is None or value.isascii():
        return value
    return _SURROGATES.sub(_undecodable_bytes, value)


class TextAccessLogger(AbstractAccessLogger):
    def log(self, request: BaseRequest, response: StreamResponse, time: float) -> None:
        f = _fields(request, response, time)
        limits = ",".join(f"{x['name']}:{x['decision']}:{x['identity']}" for x in f["limits"]) or "-"  # type: ignore[attr-defined]
        self.logger.info(
            '%s %s "%s %s" %s %s %.3fms "%s" client=%s request_id=%s route=%s decision=%s limits=%s upstream_status=%s upstream_ms=%s'
            " upstream_target=%s",
            f["time"], f["remote"], _escaped(f["method"]), _escaped(f["path"]), f["status"], f["bytes"], f["duration_ms"],
            _escaped(f["user_agent"]),
            _text(f["client"]), _text(f["request_id"]), "-" if f["route"] is None else f'"{_escaped(f["route"])}"',
            _text(f["decision"]), limits, _text(f["upstream_status"]), _text(f["upstream_ms"]), _text(f["upstream_target"]),
        )


class JsonAccessLogger(AbstractAccessLogger):
    def log(self, request: BaseRequest, response: StreamResponse, time: float) -> None:
        fields = _fields(request, response, time)
        for name in _CLIENT_TEXT:
            fields[name] = _json_text(fields[name])  # type: ignore[arg-type]
        self.logger.info(json.dumps(fields))


# The fields whose text the client chose, byte for byte; the rest are numbers, addresses or config.
_CLIENT_TEXT = ("method", "path", "user_agent")


ACCESS_LOG_FORMATS = {"text": TextAccessLogger, "json": JsonAccessLogger}
access_logger = logging.getLogger("gateway.access")
log = logging.getLogger(__name__)  # the gateway's own log, on stderr


# About 4 MB of JSON lines: some seconds of a busy worker's lines, held while a log
# reader catches up, and a bound on what a stalled one costs in memory.
QUEUE_LINES = 10_000


def enable_access_log(dropped: Callable[[int], None]) -> None:
    """Write access lines, bare and unprefixed, to stdout, whatever the log level; pass
    `dropped` the lines lost because stdout did not take them. Once per process: the
    writer thread does not survive a fork."""
    handler = QueuedLines(sys.stdout.fileno(), "stdout", QUEUE_LINES)
    handler.count_dropped(dropped)
    access_logger.handlers[:] = [handler]
    access_logger.setLevel(logging.INFO)
    access_logger.propagate = False


def close_access_log() -> None:
    """At a clean stop, after the last request: write the lines still queued, giving
    stdout up to FLUSH_SECONDS to take them (see QueuedLines.close)."""
    for handler in access_logger.handlers[:]:
        access_logger.removeHandler(handler)
        if isinstance(handler, QueuedLines) and handler.queued:
            log.info("writing the %d access log lines still queued (up to %gs)", handler.queued, FLUSH_SECONDS)
        handler.close()
