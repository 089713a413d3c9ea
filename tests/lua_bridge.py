"""A Lua 5.1 interpreter (lupa) that runs a Redis script's exact text against a
small stand-in for Redis: hashes with expiry, and a clock the test sets.

This is an interpreter harness for a pure script, not a mock of the store under
test: the real-Redis tests (tests/store/test_lua_token_bucket.py, the process tests)
remain, and `test_lua_model.py` checks this bridge against a real redis-server.
It copies Redis 7.0's Lua bridge (src/script_lua.c) only where the token-bucket
script can tell the difference:

- The script body runs as a function with `KEYS` and `ARGV` as globals, as
  Redis wraps it (`f_<sha>`).
- A number passed to `redis.call` becomes the string `%.17g` of it, not Lua's
  `tostring` (`%.14g`): Redis formats it itself so no precision is lost (later
  versions print an integral number as an integer and others as the shortest
  string that reads back as the same double; every version reads back exactly).
  Other argument types are an error.
- `TIME` returns two strings, {seconds, microseconds}, from the test's clock.
- `HMGET` returns `false` for a missing field or key (a nil bulk reply).
- `PTTL` is -2 for a missing key, -1 for one without expiry, else the whole
  milliseconds left (never below 0).
- `PEXPIRE` takes an integer only: a string Redis's `string2ll` would refuse
  (`1e+17`, `12.5`) is the error Redis gives. A key expires when the clock in
  whole milliseconds passes its deadline (`now > when`), as Redis decides.
- The reply goes through Redis's Lua-to-RESP rules: a number is truncated to an
  integer (one outside 64 bits, or NaN, comes back as -2^63, as x86-64 converts
  it), a table becomes an array that ends at its first nil, `false` is a nil
  reply and `true` is 1.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from lupa import lua51

# Redis's `string2ll`: an optional minus, then digits without leading zeros, within 64 bits.
_INTEGER = re.compile(r"-?(0|[1-9][0-9]*)")
_LLONG = 2**63

_BRIDGE = """
local call_redis = ...
redis = {}
function redis.call(command, ...)
  local args = {}
  for i = 1, select('#', ...) do
    local value = select(i, ...)
    if type(value) == 'number' then
      value = string.format('%.17g', value)
    elseif type(value) ~= 'string' then
      error('Lua redis() command arguments must be strings or integers')
    end
    args[i] = value
  end
  return call_redis(string.upper(command), args)
end
"""


class RedisScriptError(Exception):
    """What `redis.call` raises inside the script where Redis would answer an error."""


@dataclass
class FakeRedis:
    """The keyspace the bridge reads and writes: hashes of strings, and expiry deadlines in ms."""

    hashes: dict[str, dict[str, str]] = field(default_factory=dict)
    deadlines: dict[str, int] = field(default_factory=dict)
    seconds: int = 0
    microseconds: int = 0
    calls: list[tuple[str, ...]] = field(default_factory=list)

    def set_clock(self, total_microseconds: int) -> None:
        self.seconds, self.microseconds = divmod(total_microseconds, 1_000_000)

    @property
    def milliseconds(self) -> int:
        """Redis's `mstime()`, against which expiry deadlines are kept."""
        return self.seconds * 1000 + self.microseconds // 1000

    def _live(self, key: str) -> dict[str, str] | None:
        deadline = self.deadlines.get(key)
        if deadline is not None and self.milliseconds > deadline:
            del self.deadlines[key]
            self.hashes.pop(key, None)
        return self.hashes.get(key)

    def execute(self, command: str, args: list[str]) -> Any:
        self.calls.append((command, *args))
        if command == "TIME":
            return [str(self.seconds), str(self.microseconds)]
        if command == "HMGET":
            held = self._live(args[0]) or {}
            return [held.get(name, False) for name in args[1:]]
        if command == "HSET":
            held = self._live(args[0])
            if held is None:
                held = self.hashes[args[0]] = {}
            for name, value in zip(args[1::2], args[2::2], strict=True):
                held[name] = value
            return (len(args) - 1) // 2
        if command == "PEXPIRE":
            key, ttl = args
            if not _INTEGER.fullmatch(ttl) or not -_LLONG <= int(ttl) < _LLONG:
                raise RedisScriptError("ERR value is not an integer or out of range")
            if self._live(key) is None:
                return 0
            if int(ttl) <= 0:
                del self.hashes[key]
                self.deadlines.pop(key, None)
            else:
                self.deadlines[key] = self.milliseconds + int(ttl)
            return 1
        if command == "PTTL":
            if self._live(args[0]) is None:
                return -2
            deadline = self.deadlines.get(args[0])
            return -1 if deadline is None else max(0, deadline - self.milliseconds)
        raise RedisScriptError(f"ERR the bridge does not implement {command}")


class LuaScript:
    """One script's text, compiled once, run as Redis runs it against a `FakeRedis`."""

    def __init__(self, text: str, redis: FakeRedis) -> None:
        self.redis = redis
        self._lua = lua51.LuaRuntime(unpack_returned_tuples=False, register_eval=False)
        self._lua.execute(_BRIDGE, self._call_redis)
        self._body = self._lua.compile(text, name="@script")

    def _call_redis(self, command: str, args: Any) -> Any:
        reply = self.redis.execute(command, [args[i] for i in range(1, len(args) + 1)])
        return self._lua.table_from(reply) if isinstance(reply, list) else reply

    def __call__(self, keys: list[str], argv: list[str]) -> Any:
        globals_ = self._lua.globals()
        globals_.KEYS = self._lua.table_from(keys)
        globals_.ARGV = self._lua.table_from(argv)
        return to_resp(self._body())


def to_resp(value: Any) -> Any:
    """A Lua value as the client reads Redis's reply to it."""
    if value is None or value is False:
        return None
    if value is True:
        return 1
    if isinstance(value, (int, float)):
        if not -_LLONG <= value < _LLONG:  # also NaN
            return -_LLONG
        return int(value)  # (long long) in C: towards zero
    if isinstance(value, (str, bytes)):
        return value.decode() if isinstance(value, bytes) else value
    items = []
    index = 1
    while (item := value[index]) is not None:
        items.append(to_resp(item))
        index += 1
    return items
