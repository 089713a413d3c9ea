"""A streaming scan of one JSON text for the value at a path of keys, in bounded memory.

gateway.config.usage reads a response's cost with it when a body (or one server-sent
event's data) is too long to hold and parse whole. It is fed the text in chunks of any
size and keeps a bracket depth, a few flags and at most one key or number of the path
(MAX_TOKEN bytes): never a value off the path, whatever the body's length or depth.

On the path (inside the objects that lead to it) it reads tokens; any other value is
skipped by C: one regex match reads it whole, brackets nested up to _NESTING deep and
strings with their escapes, and a long run of string bytes is found with bytes.find. Strings
are read whole, so no text inside a string can pose as a key. Off the path it checks structure only (strings
closed, brackets balanced, one top-level value): not the text of skipped values, nor that
a `]` closes a `[` rather than a `{`. A key or number longer than MAX_TOKEN is skipped
unread (no path has such a key, no count is such a number). Duplicate keys: the last one wins,
as with Python's json. Trusts nothing in the text.
"""

from __future__ import annotations

import json
import re

# The longest key or number on the path kept while it straddles chunks. A usage member's
# key and value are a few bytes. Kept small because a token fed in many small chunks is
# rescanned from its start on each: at worst MAX_TOKEN**2 / 2 bytes scanned (8 MB here).
MAX_TOKEN = 4 * 1024
# JSON numbers are IEEE doubles to most parsers: past 2**53 a count is no longer exact.
MAX_COUNT = 2**53

_WHITESPACE = re.compile(rb"[ \t\r\n]*+")
# Byte classes spelled as ranges: sre reads those through a 256-bit map, at about 450 MB/s
# here, where a negated class of a few bytes such as [^"\\] is tested op by op, at 100.
_STRING_BYTE = rb"[\x00-\x21\x23-\x5b\x5d-\xff]"  # any but " and \
_PLAIN_BYTE = rb"[\x00-\x21\x23-\x5a\x5c\x5e-\x7a\x7c\x7e-\xff]"  # any but " [ ] { }
# A run of string bytes past this is left to bytes.find (memchr, GB/s) rather than the regex:
# about what one more round of the Python loop costs.
_RUN = 256
_SHORT_STRING = rb'"' + _STRING_BYTE + rb"{0,%d}+(?:\\." % _RUN + _STRING_BYTE + rb'{0,%d}+)*+"' % _RUN
# Off the path: everything up to the next bracket that opens a value nested deeper than
# _NESTING or going on past the chunk, an unmatched closing bracket, a long or unterminated
# string, in one match (possessive: no backtracking). Each level is one more copy of the
# level below in brackets, so a usual value (an object of objects and arrays) is one match
# rather than a round of the Python loop per bracket; a bracket it stops at costs at most a
# rescan of the next _NESTING levels.
_NESTING = 4
_SKIP_PATTERN = rb"(?:" + _PLAIN_BYTE + rb"++|" + _SHORT_STRING + rb")*+"
for _ in range(_NESTING):
    _SKIP_PATTERN = rb"(?:" + _PLAIN_BYTE + rb"++|" + _SHORT_STRING + rb"|[\[{]" + _SKIP_PATTERN + rb"[\]}])*+"
_SKIP = re.compile(_SKIP_PATTERN, re.S)
# Inside a string from a backslash on: escapes and the short runs between them.
_ESCAPES = re.compile(rb"(?:\\." + _STRING_BYTE + rb"{0,%d}+)*+" % _RUN, re.S)
_STRING = re.compile(rb'"' + _STRING_BYTE + rb"*+(?:\\." + _STRING_BYTE + rb'*+)*+"', re.S)
_SCALAR = re.compile(rb"[-+.0-9A-Za-z]*+")
_NUMBER = re.compile(rb"-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")


def count(value: object) -> int | None:
    """A JSON value as a count: a whole number from 0 to MAX_COUNT, else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float):
        if not value.is_integer():
            return None
        value = int(value)
    return value if 0 <= value <= MAX_COUNT else None


def _string_rest(data: bytes, pos: int, end: int) -> int:
    """Where the string that `pos` is inside (not just after a backslash) stops: at its
    closing quote, at `end`, or at a backslash at `end - 1` whose escaped byte is in the next
    chunk. Runs between escapes are found with bytes.find; the escapes, read by a regex."""
    quote = data.find(b'"', pos, end)  # the first quote at or after pos, kept while it is
    while True:
        stop = end if quote < 0 else quote
        backslash = data.find(b"\\", pos, stop)
        if backslash < 0:
            return stop
        pos = _ESCAPES.match(data, backslash, end).end()  # type: ignore[union-attr]
        if pos == end or data[pos] == 0x22 or (pos == end - 1 and data[pos] == 0x5C):
            return pos
        if 0 <= quote < pos:  # that quote was escaped
            quote = data.find(b'"', pos, end)


# What the JSON scanner expects next, on the path (inside the objects that lead to it).
_TOP, _KEY_OR_END, _KEY, _COLON, _VALUE, _COMMA_OR_END, _DONE = range(7)
# What outcome() says when the path is not in the text (or the text is cut or malformed);
# a value at the path that is no count is None.
ABSENT = -1


class PathScan:
    """A streaming scan of one JSON text for the value at a path of keys.

    On the path (`_level` objects deep, each entered by the path's next key) it reads
    tokens; any other value is skipped by `_skip`, a bracket depth, plus whether it is
    inside a string and just after a backslash there. `_found` is ABSENT until the path's
    last key is met; meeting any key of the path again replaces what was found under it."""

    __slots__ = ("_carry", "_escape", "_expect", "_failed", "_found", "_in_scalar", "_in_string", "_keys", "_level", "_matched", "_skip")

    def __init__(self, keys: tuple[bytes, ...]) -> None:
        self._keys = keys
        self._level = 0
        self._expect = _TOP
        self._matched = False  # the key being read or whose value follows is the path's next
        self._skip = 0
        self._in_string = False
        self._escape = False
        self._carry = b""
        self._found: int | None = ABSENT
        self._failed = False
        self._in_scalar = False  # inside a number or literal too long to read, on the path

    def feed(self, chunk: bytes) -> None:
        if self._failed or not chunk:
            return
        data = self._carry + chunk if self._carry else chunk
        self._carry = b""
        try:
            self._scan(data)
        except _Malformed:
            self._failed = True

    def outcome(self) -> int | None:
        """ABSENT if the body is whole and well formed but lacks the path (or is not whole,
        or is malformed); else the count, or None for a value that is no count."""
        if self._failed or self._carry or self._expect != _DONE or self._skip or self._in_string or self._in_scalar:
            return ABSENT
        return self._found

    def _scan(self, data: bytes) -> None:
        pos, end = 0, len(data)
        while pos < end:
            if self._in_string:
                pos = self._skip_string(data, pos, end)
            elif self._in_scalar:
                pos = _SCALAR.match(data, pos).end()  # type: ignore[union-attr]
                if pos < end:
                    self._in_scalar = False
                    self._after_value()
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
        pos = _string_rest(data, pos, end)
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
            self._found = None if last else ABSENT
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
        if stop - pos >= MAX_TOKEN:  # no count is that long: skipped unread, not held
            self._in_scalar = stop == end
            if not self._in_scalar:
                self._after_value()
            return stop
        if stop == end:  # the token may go on in the next chunk
            self._carry = data[pos:]
            return end
        token = data[pos:stop]
        number = _NUMBER.fullmatch(token)
        if number is None and token not in (b"true", b"false", b"null"):
            raise _Malformed
        if self._matched and last and number is not None:
            if number.group(1) or number.group(2):
                self._found = count(float(token))
            else:  # past 20 digits it is too large; int() would also refuse 4,300
                self._found = count(int(token)) if len(token) <= 20 else None
        self._after_value()
        return stop


class _Malformed(Exception):
    """The body is not JSON; raised inside the scan only, never out of feed."""
