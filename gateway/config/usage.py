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
    reader = source.reader(headers)               one per response; headers: a Mapping
                                                  (case-insensitive, as multidict's) or a get()
    reader.feed(chunk: bytes) -> None             every body chunk, as relayed
    reader.result() -> int | None                 at the end; None: the response did not say

A count is a whole number from 0 to 2**53 (a JSON float with an integral value is one);
a negative, fractional, boolean, textual or larger value says nothing, and neither does a
body that is malformed, cut short, or past the reader's bounds. `feed` never changes, keeps
or copies the caller's bytes beyond one token that straddles two chunks.

Trust: the body is the upstream's, and its strings carry what clients wrote (prompts echoed
back, completions). Strings are skipped whole, escapes included, so no text inside a
string can pose as a key. Memory is bounded whatever the body: the JSON scanner keeps a
depth counter and at most one key or number (MAX_TOKEN bytes; a longer key is skipped,
a longer number on the path gives up), never a value off the path; the SSE reader streams each event's data through such a scanner, so no event is
buffered either. To stay fast off the path the scanner checks structure only (strings
closed, brackets balanced, one top-level value); it does not validate the text of the
values it skips, nor that a `]` closes a `[` rather than a `{` there. Duplicate keys: the
last one wins, as with Python's json. A body with a Content-Encoding other than identity
is not decoded, and says nothing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from gateway.config.http_names import HTTP_TOKEN_RE

# The longest key or number on the path kept while it straddles chunks. A usage member's
# key and value are a few bytes. Kept small because a token fed in many small chunks is
# rescanned from its start on each: at worst MAX_TOKEN**2 / 2 bytes scanned (8 MB here).
MAX_TOKEN = 4 * 1024
# JSON numbers are IEEE doubles to most parsers: past 2**53 a count is no longer exact.
MAX_COUNT = 2**53
# A path is a handful of keys (`usage.total_tokens`); the bound only keeps config sane.
MAX_PATH_KEYS = 32
MAX_KEY = 256
# An SSE field name is `data`, `event`, `id` or `retry`: past this, the line is ignored.
_MAX_FIELD = 16

_WHITESPACE = re.compile(rb"[ \t\r\n]*+")
# Off the path: everything up to the next bracket or an unterminated string, complete
# strings included, in one C-level match (possessive: no backtracking).
_SKIP = re.compile(rb'(?:[^"\[\]{}]++|"[^"\\]*+(?:\\.[^"\\]*+)*+")*+', re.S)
_STRING_REST = re.compile(rb'[^"\\]*+(?:\\.[^"\\]*+)*+', re.S)
_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"', re.S)
_SCALAR = re.compile(rb"[-+.0-9A-Za-z]*+")
_NUMBER = re.compile(rb"-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")
_LINE_END = re.compile(rb"[\r\n]")
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
    _keys: tuple[bytes, ...] = field(default=(), compare=False, repr=False)

    def __str__(self) -> str:
        return f"{self.kind}:{self.argument}" if self.argument else self.kind

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
            return _Silent()
        if self.kind == "json":
            return _JsonReader(self._keys)
        return _SseReader(self._keys)


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
    # A key as it appears raw in a body; a key written with escapes is decoded to compare.
    raw = tuple(json.dumps(key, ensure_ascii=False).encode() for key in keys)
    return UsageSource(kind, argument, raw)


def _header(headers: Headers, name: str) -> str | None:
    if callable(headers):
        return headers(name)
    value = headers.get(name)
    if value is None:
        lowered = name.lower()
        value = next((v for k, v in headers.items() if k.lower() == lowered), None)
    return value


def _count(value: int | float) -> int | None:
    if isinstance(value, float):
        if not value.is_integer():
            return None
        value = int(value)
    return value if 0 <= value <= MAX_COUNT else None


class _HeaderReader:
    def __init__(self, value: str | None) -> None:
        text = value.strip(" \t") if value is not None else ""
        self._value = _count(int(text)) if text.isascii() and text.isdigit() and len(text) <= 17 else None

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


class _Silent:
    def feed(self, chunk: bytes) -> None:
        pass

    def result(self) -> None:
        return None


# What the JSON scanner expects next, on the path (inside the objects that lead to it).
_TOP, _KEY_OR_END, _KEY, _COLON, _VALUE, _COMMA_OR_END, _DONE = range(7)
# The path's value before and after it is seen; a value that is no count is None.
_ABSENT = -1


class _JsonReader:
    """A streaming scan of one JSON text for the value at a path of keys.

    On the path (`_level` objects deep, each entered by the path's next key) it reads
    tokens; any other value is skipped by `_skip`, a bracket depth, plus whether it is
    inside a string and just after a backslash there. `_found` is _ABSENT until the path's
    last key is met; meeting any key of the path again replaces what was found under it."""

    __slots__ = ("_carry", "_escape", "_expect", "_failed", "_found", "_in_string", "_keys", "_level", "_matched", "_skip")

    def __init__(self, keys: tuple[bytes, ...]) -> None:
        self._keys = keys
        self._level = 0
        self._expect = _TOP
        self._matched = False  # the key being read or whose value follows is the path's next
        self._skip = 0
        self._in_string = False
        self._escape = False
        self._carry = b""
        self._found: int | None = _ABSENT
        self._failed = False

    def feed(self, chunk: bytes) -> None:
        if self._failed or not chunk:
            return
        data = self._carry + chunk if self._carry else chunk
        self._carry = b""
        try:
            self._scan(data)
        except _Malformed:
            self._failed = True

    def result(self) -> int | None:
        found = self.outcome()
        return None if found == _ABSENT else found

    def outcome(self) -> int | None:
        """_ABSENT if the body is whole and well formed but lacks the path (or is not whole,
        or is malformed); else the count, or None for a value that is no count."""
        if self._failed or self._carry or self._expect != _DONE or self._skip or self._in_string:
            return _ABSENT
        return self._found

    def _scan(self, data: bytes) -> None:
        pos, end = 0, len(data)
        while pos < end:
            if self._in_string:
                pos = self._skip_string(data, pos, end)
            elif self._skip:
                pos = self._skip_value(data, pos, end)
            else:
                pos = self._step(data, _WHITESPACE.match(data, pos).end(), end)  # type: ignore[union-attr]

    def _skip_string(self, data: bytes, pos: int, end: int) -> int:
        if self._escape:
            self._escape = False
            pos += 1
            if pos >= end:
                return pos
        pos = _STRING_REST.match(data, pos).end()  # type: ignore[union-attr]
        if pos == end:
            return pos
        if pos == end - 1 and data[pos] == 0x5C:  # a backslash whose escaped byte is in the next chunk
            self._escape = True
            return end
        self._in_string = False  # data[pos] is the closing quote
        if not self._skip and self._expect != _COLON:  # a value on the path, not a long key
            self._after_value()
        return pos + 1

    def _skip_value(self, data: bytes, pos: int, end: int) -> int:
        pos = _SKIP.match(data, pos).end()  # type: ignore[union-attr]
        if pos == end:
            return pos
        byte = data[pos]
        if byte == 0x22:  # a string that goes on past this chunk
            self._in_string = True
        elif byte in b"[{":
            self._skip += 1
        else:
            self._skip -= 1
            if not self._skip:
                self._after_value()
        return pos + 1

    def _after_value(self) -> None:
        self._matched = False
        self._expect = _DONE if self._level == 0 else _COMMA_OR_END

    def _step(self, data: bytes, pos: int, end: int) -> int:
        """One token on the path, or the start of a value to skip."""
        if pos == end:
            return pos
        byte, expect = data[pos], self._expect
        if expect in (_KEY_OR_END, _KEY):
            if byte == 0x22:
                return self._key(data, pos, end)
            if byte == 0x7D and expect == _KEY_OR_END:
                return self._close(pos)
        elif expect == _COLON:
            if byte == 0x3A:
                self._expect = _VALUE
                return pos + 1
        elif expect == _COMMA_OR_END:
            if byte == 0x2C:
                self._expect = _KEY
                return pos + 1
            if byte == 0x7D:
                return self._close(pos)
        elif expect in (_VALUE, _TOP):
            return self._value(data, pos, end)
        raise _Malformed

    def _close(self, pos: int) -> int:
        self._level -= 1
        self._after_value()
        return pos + 1

    def _key(self, data: bytes, pos: int, end: int) -> int:
        match = _STRING.match(data, pos, pos + MAX_TOKEN)
        if match is None:
            if end - pos < MAX_TOKEN:
                self._carry = data[pos:]
                return end
            # Longer than any key of a path: skipped as a string, not held.
            self._matched = False
            self._expect = _COLON
            self._in_string = True
            return pos + 1
        raw = match.group()
        wanted = self._keys[self._level - 1]
        if raw != wanted and b"\\" in raw:
            try:
                raw = json.dumps(json.loads(raw), ensure_ascii=False).encode()
            except ValueError:
                raise _Malformed from None
        self._matched = raw == wanted
        self._expect = _COLON
        return match.end()

    def _value(self, data: bytes, pos: int, end: int) -> int:
        byte = data[pos]
        on_path = self._matched or self._level == 0
        last = self._level == len(self._keys)
        if self._matched:  # this value replaces any earlier one under the same key
            self._found = None if last else _ABSENT
        if byte == 0x7B and on_path and not last:
            self._level += 1
            self._matched = False
            self._expect = _KEY_OR_END
            return pos + 1
        if byte == 0x7B or byte == 0x5B:
            self._skip = 1
            return pos + 1
        if byte == 0x22:
            self._in_string = True
            return pos + 1
        stop = _SCALAR.match(data, pos).end()  # type: ignore[union-attr]
        if stop - pos > MAX_TOKEN:
            raise _Malformed
        if stop == end:  # the token may go on in the next chunk
            self._carry = data[pos:]
            return end
        token = data[pos:stop]
        number = _NUMBER.fullmatch(token)
        if number is None and token not in (b"true", b"false", b"null"):
            raise _Malformed
        if self._matched and last and number is not None:
            if number.group(1) or number.group(2):
                self._found = _count(float(token))
            else:  # past 20 digits it is too large; int() would also refuse 4,300
                self._found = _count(int(token)) if len(token) <= 20 else None
        self._after_value()
        return stop


class _Malformed(Exception):
    """The body is not JSON; raised inside the scan only, never out of feed."""


class _SseReader:
    """Server-sent events (the HTML standard's event-stream format): lines end in CRLF, LF
    or CR; `data:` lines of one event are joined by LF and the event ends at a blank line;
    lines starting with `:` are comments; an event not ended by a blank line is dropped.
    Each event's data streams through its own _JsonReader, and the count of the last event
    whose JSON has the path (`data: [DONE]` has not) is the result."""

    __slots__ = ("_cr", "_event", "_field", "_found", "_head", "_keys", "_state")

    _FIELD, _DATA_START, _DATA, _IGNORE = range(4)

    def __init__(self, keys: tuple[bytes, ...]) -> None:
        self._keys = keys
        self._state = self._FIELD
        self._field = b""
        self._event: _JsonReader | None = None
        self._cr = False  # the last chunk ended in CR: an LF first in the next belongs to it
        self._head: bytes | None = b""  # the stream's first bytes, until a byte-order mark is ruled out
        self._found: int | None = _ABSENT

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
            match = _LINE_END.search(chunk, pos)
            stop = match.start() if match else end
            self._line_part(chunk, pos, stop)
            if match is None:
                return
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
            self._event = _JsonReader(self._keys)
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
            if found != _ABSENT:
                self._found = found

    def result(self) -> int | None:
        return None if self._found == _ABSENT else self._found
