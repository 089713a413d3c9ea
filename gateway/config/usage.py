"""Where a response says what it cost, and a reader that finds it as the body streams past.

A limit's cost can come from the response (`cost.from` in the config):

    json:usage.total_tokens       a dotted path of keys into a JSON body
    sse-json:usage.total_tokens   the same path in the data of server-sent events;
                                  the last event that carries it wins
    header:X-Usage-Units          a response header's integer value
    response-bytes                the body's length as relayed

The API, for the proxy and the Envoy service:

    parse_usage_source(text) -> UsageSource       ValueError, one line, for a bad spelling
    source.reads_body -> bool                     False for header: the body need not be fed
    reader = source.reader(headers)               one per response; headers: a Mapping (a
                                                  plain dict is searched ignoring case) or a get()
    reader.feed(chunk: bytes) -> None             every body chunk, as relayed
    reader.result() -> int | None                 at the end; None: the response did not say

A count is a whole number from 0 to 2**53 (a JSON float with an integral value is one);
a negative, fractional, boolean, textual or larger value says nothing, and neither does a
body that is malformed, cut short, or compressed (a Content-Encoding other than identity).
Duplicate keys: the last one wins, as with Python's json. In a stream, an event not ended
by a blank line (a stream cut short) is dropped, as the HTML standard says.

It lives in gateway.config, the lowest layer, because the config loader parses `cost.from`
into a UsageSource; the proxy and the Envoy service above only call it.

Memory is bounded whatever the body. A JSON text (a body, or one event's data) of up to
HELD_TEXT bytes is held and read by Python's json, in C: most LLM answers and every SSE
chunk are that small; one in which the path's last key cannot be (a few memory searches
tell) is not read at all. Past it, the text streams through gateway.config.json_scan, which
keeps a depth counter and one key or number of the path, never a value off the path;
its few differences from json on malformed text are in its docstring. No event or body
is held past HELD_TEXT, and the caller's chunks are neither changed nor kept.

Trust: the body is the upstream's, and its strings carry what clients wrote (prompts
echoed back, completions). Strings are read whole with their escapes, so no text inside
a string poses as a key.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from gateway.config.http_names import HTTP_TOKEN_RE
from gateway.config.json_scan import ABSENT, PathScan, count

# A JSON text up to this size is held and parsed by json (about 3 µs for an SSE chunk, against
# about 20 µs for the streaming scan in Python); per response, this is all that is held.
HELD_TEXT = 16 * 1024
# A path is a handful of keys (`usage.total_tokens`); the bound only keeps config sane.
MAX_PATH_KEYS = 32
MAX_KEY = 256
# Escapes looked at to tell that a held text cannot hold the path's last key: a few µs at
# most, a tenth of what json takes for a 16 KiB text.
_ESCAPES_LOOKED_AT = 32
# An SSE field name is `data`, `event`, `id` or `retry`: past this, the line is ignored.
_MAX_FIELD = 16

_BOM = b"\xef\xbb\xbf"

Headers = Mapping[str, str] | Callable[[str], str | None]


class UsageReader(Protocol):
    def feed(self, chunk: bytes) -> None: ...

    def result(self) -> int | None: ...


@dataclass(frozen=True, slots=True)
class UsageSource:
    """A parsed `cost.from`: kind is json, sse-json, header or response-bytes; argument the
    dotted path, the header name, or "". Compared and shown by its config spelling."""

    kind: str
    argument: str
    _path: tuple[str, ...] = field(default=(), compare=False, repr=False)
    # Each key as it appears raw in a body, for the scan.
    _keys: tuple[bytes, ...] = field(default=(), compare=False, repr=False)

    def __str__(self) -> str:
        return f"{self.kind}:{self.argument}" if self.argument else self.kind

    def _lacks_last_key(self, text: bytes | bytearray) -> bool:
        """Whether no key in `text` can be the path's last, so json need not read it (every
        SSE chunk of a stream but the one with the usage): the key's raw spelling is nowhere,
        nor is any escape that could spell it otherwise, a `\\u` (or `\\/` for a slash).
        The other escapes are of characters its raw spelling already writes escaped."""
        key = self._keys[-1]
        if key in text:
            return False
        other = b"u/" if b"/" in key else b"u"
        # A backslash and the byte it escapes are stepped over as a pair, so an escaped
        # backslash before a `u` is not taken for one; past a few escapes, json decides.
        at = text.find(b"\\")
        for _ in range(_ESCAPES_LOOKED_AT):
            if at < 0:
                return True
            if text[at + 1 : at + 2] in other:
                return False
            at = text.find(b"\\", at + 2)
        return False

    @property
    def reads_body(self) -> bool:
        return self.kind != "header"

    def reader(self, headers: Headers) -> UsageReader:
        """A fresh reader for one response, given that response's headers."""
        if self.kind == "header":
            return _HeaderReader(_header(headers, self.argument))
        if self.kind == "response-bytes":
            return _ByteCounter()
        encoding = _header(headers, "Content-Encoding")
        if encoding is not None and encoding.strip().lower() not in ("", "identity"):
            return SILENT
        if self.kind == "json" and not _event_stream(headers):
            return _JsonText(self)
        # sse-json, or json: answered as a server-sent stream (an OpenAI-style API answers
        # either on one path, as the request's `stream` asks), read at the same path.
        return _SseReader(self)


def parse_usage_source(text: str) -> UsageSource:
    """The source a `cost.from` string names; ValueError saying why in one line."""
    if not isinstance(text, str):
        raise ValueError(f"expected a string such as json:usage.total_tokens, got {type(text).__name__}")
    if text == "response-bytes":
        return UsageSource("response-bytes", "")
    kind, colon, argument = text.partition(":")
    if not colon or kind not in ("json", "sse-json", "header"):
        raise ValueError(f"expected json:PATH, sse-json:PATH, header:NAME or response-bytes, got {text!r}")
    if kind == "header":
        if not HTTP_TOKEN_RE.match(argument):
            raise ValueError(f"expected a header name after 'header:', got {argument!r}")
        return UsageSource(kind, argument)
    keys = argument.split(".")
    if not argument or "" in keys:
        raise ValueError(f"expected a dotted path of keys after '{kind}:' such as usage.total_tokens, got {argument!r}")
    if len(keys) > MAX_PATH_KEYS or max(map(len, keys)) > MAX_KEY:
        raise ValueError(f"expected a path of at most {MAX_PATH_KEYS} keys of at most {MAX_KEY} characters, got {argument[:80]!r}")
    raw = tuple(json.dumps(key, ensure_ascii=False).encode() for key in keys)
    return UsageSource(kind, argument, tuple(keys), raw)


def _line_end(chunk: bytes, pos: int, end: int) -> int:
    """Where the first CR or LF at or after `pos` is, or -1: bytes.find, memchr in C, runs at
    memory speed, where a regex character class read the stream at about 140 MB/s. The CR
    search stops at the first LF, so a stream without CR is not searched twice."""
    lf = chunk.find(b"\n", pos, end)
    cr = chunk.find(b"\r", pos, lf if lf >= 0 else end)
    return cr if cr >= 0 else lf


def _event_stream(headers: Headers) -> bool:
    content_type = _header(headers, "Content-Type")
    return content_type is not None and content_type.partition(";")[0].strip().lower() == "text/event-stream"


def _header(headers: Headers, name: str) -> str | None:
    if callable(headers):
        return headers(name)
    value = headers.get(name)
    if value is None:
        lowered = name.lower()
        value = next((v for k, v in headers.items() if k.lower() == lowered), None)
    return value


class _HeaderReader:
    def __init__(self, value: str | None) -> None:
        text = value.strip(" \t") if value is not None else ""
        self._value = count(int(text)) if text.isascii() and text.isdigit() and len(text) <= 17 else None

    def feed(self, chunk: bytes) -> None:
        pass

    def result(self) -> int | None:
        return self._value


class _ByteCounter:
    def __init__(self) -> None:
        self._count = 0

    def feed(self, chunk: bytes) -> None:
        self._count += len(chunk)

    def result(self) -> int:
        return self._count


class Silent:
    """A reader that says nothing, so the limit is charged its `missing`: for a body it
    cannot read (compressed), and for one nobody reads (a WebSocket's frames). Holds no
    state, so one serves every response."""

    __slots__ = ()

    def feed(self, chunk: bytes) -> None:
        pass

    def result(self) -> None:
        return None


SILENT = Silent()


class _JsonText:
    """One JSON text, fed in chunks: held and parsed by json up to HELD_TEXT bytes, streamed
    through a PathScan past that. outcome() is ABSENT when the text lacks the path (or is
    cut or malformed), else the value at the path as a count, or None for no count."""

    __slots__ = ("_held", "_scan", "_source")

    def __init__(self, source: UsageSource) -> None:
        self._source = source
        self._held = bytearray()
        self._scan: PathScan | None = None

    def feed(self, chunk: bytes) -> None:
        if self._scan is not None:
            self._scan.feed(chunk)
        elif len(self._held) + len(chunk) <= HELD_TEXT:
            self._held += chunk
        else:
            self._scan = PathScan(self._source._keys)
            self._scan.feed(bytes(self._held))
            self._scan.feed(chunk)
            self._held = bytearray()

    def outcome(self) -> int | None:
        if self._scan is not None:
            return self._scan.outcome()
        if self._source._lacks_last_key(self._held):
            return ABSENT
        try:
            value = json.loads(self._held.decode())
        except (ValueError, RecursionError):
            # Not UTF-8 or not JSON, or past json's own bounds (4,300 digits, its stack): the
            # scan decides, so that a text reads the same whatever its length.
            scan = PathScan(self._source._keys)
            scan.feed(bytes(self._held))
            return scan.outcome()
        for key in self._source._path:
            if not isinstance(value, dict) or key not in value:
                return ABSENT
            value = value[key]
        return count(value)

    def result(self) -> int | None:
        found = self.outcome()
        return None if found == ABSENT else found


class _SseReader:
    """Server-sent events (the HTML standard's event-stream format): lines end in CRLF, LF
    or CR; `data:` lines of one event are joined by LF and the event ends at a blank line;
    lines starting with `:` are comments; an event not ended by a blank line is dropped.
    Each event's data goes to its own _JsonText, and the count of the last event whose JSON
    has the path (`data: [DONE]` has not) is the result."""

    __slots__ = ("_cr", "_event", "_field", "_found", "_head", "_source", "_state")

    _FIELD, _DATA_START, _DATA, _IGNORE = range(4)

    def __init__(self, source: UsageSource) -> None:
        self._source = source
        self._state = self._FIELD
        self._field = b""
        self._event: _JsonText | None = None
        self._cr = False  # the last chunk ended in CR: an LF first in the next belongs to it
        self._head: bytes | None = b""  # the stream's first bytes, until a byte-order mark is ruled out
        self._found: int | None = ABSENT

    def feed(self, chunk: bytes) -> None:
        if self._head is not None:
            head = self._head + chunk
            if len(head) < 3 and _BOM.startswith(head):
                self._head = head
                return
            self._head = None
            chunk = head[3:] if head.startswith(_BOM) else head
        pos, end = 0, len(chunk)
        if self._cr and end:
            self._cr = False
            if chunk[0] == 0x0A:
                pos = 1
        while pos < end:
            stop = _line_end(chunk, pos, end)
            if stop < 0:
                self._line_part(chunk, pos, end)
                return
            self._line_part(chunk, pos, stop)
            pos = stop + 1
            if chunk[stop] == 0x0D:
                if pos == end:
                    self._cr = True
                elif chunk[pos] == 0x0A:
                    pos += 1
            self._line_end()

    def _line_part(self, chunk: bytes, pos: int, stop: int) -> None:
        state = self._state
        if state == self._FIELD:
            colon = chunk.find(b":", pos, stop)
            name = self._field + chunk[pos : stop if colon < 0 else colon]
            if colon < 0:
                self._field = name if len(name) <= _MAX_FIELD else b""
                self._state = self._FIELD if len(name) <= _MAX_FIELD else self._IGNORE
                return
            if name != b"data":
                self._state = self._IGNORE  # a comment (empty name), event, id, retry
                return
            self._field = b""
            self._start_data()
            pos, state = colon + 1, self._DATA_START
        if state == self._DATA_START and pos < stop:
            if chunk[pos] == 0x20:
                pos += 1
            state = self._state = self._DATA
        if state == self._DATA and pos < stop:
            self._event.feed(chunk[pos:stop])  # type: ignore[union-attr]

    def _start_data(self) -> None:
        if self._event is None:
            self._event = _JsonText(self._source)
        else:
            self._event.feed(b"\n")
        self._state = self._DATA_START

    def _line_end(self) -> None:
        if self._state == self._FIELD:
            if self._field == b"":
                self._dispatch()
            elif self._field == b"data":  # `data` alone: an empty data line
                self._start_data()
        self._state = self._FIELD
        self._field = b""

    def _dispatch(self) -> None:
        event, self._event = self._event, None
        if event is not None:
            found = event.outcome()
            if found != ABSENT:
                self._found = found

    def result(self) -> int | None:
        return None if self._found == ABSENT else self._found
