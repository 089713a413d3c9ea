"""A test-only build of lua/token_bucket.lua that logs every decision, and the replay
of that log through the reference model (gateway/limiter/bucket.py).

The instrumented text is built here from the shipped text at run time, so it can
never drift from what production runs, and production never sees it (only
`tests.instrumented_gateway` loads it). The shipped text is wrapped, not edited:

- it becomes the body of a local function, as Redis itself wraps a script;
- inside it, `redis` is a local table whose `call` passes every command to the
  real `redis.call` and keeps the reply to `TIME`: the very clock the decision
  was made with (a second TIME would read a later one);
- after it returns, for each key of each check in the call, `INCR KEY:seq` numbers the decision per key and
  `RPUSH KEY:log` appends {seq, seconds, microseconds, key, capacity, rate,
  cost, allowed, remaining, retry_ms} as JSON (every number the decision used is
  a string there, so nothing is rounded);
- the reply is returned unchanged.

The script runs atomically, so the sequence is the order in which Redis made the
decisions, whichever gateway sent them. `:seq` and `:log` share the bucket's hash
tag. The replay starts from an empty bucket and compares each call with the model
as tests/model_check.py explains: in milliseconds, on the logged TIME.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from gateway.limiter import bucket
from tests.model_check import agree

LOG_SUFFIX = ":log"
SEQ_SUFFIX = ":seq"

_WRAPPER = """-- Test-only build of lua/token_bucket.lua (tests/replay_script.py): same reply, and a log.
local shipped_redis = redis
local decided_at
local redis = setmetatable({
  call = function(command, ...)
    local reply = shipped_redis.call(command, ...)
    if command == 'TIME' then
      decided_at = reply
    end
    return reply
  end,
}, {__index = shipped_redis})

local function shipped()
%s
end

local reply = shipped()
-- One call may carry several checks: walk them as the shipped script does.
local k, p, r = 1, 1, 0
while p <= #ARGV do
  local count = #ARGV[p]
  for i = 1, count do
    local key, a = KEYS[k + i - 1], p + 4 * i - 3
    local seq = shipped_redis.call('INCR', key .. '%s')
    shipped_redis.call('RPUSH', key .. '%s', cjson.encode({
      tostring(seq), decided_at[1], decided_at[2], key, ARGV[a], ARGV[a + 1], ARGV[a + 2],
      tostring(reply[r + 1]), reply[r + 2][i], tostring(reply[r + 3]),
    }))
  end
  k, p, r = k + count, p + 1 + 4 * count, r + 5
end
return reply
"""


def instrumented(shipped_text: str) -> str:
    return _WRAPPER % (shipped_text, SEQ_SUFFIX, LOG_SUFFIX)


@dataclass(frozen=True)
class Decision:
    """One logged script call, for one key."""

    seq: int
    seconds: int
    microseconds: int
    key: str
    capacity: float
    rate: float  # tokens per second
    cost: int
    allowed: bool
    remaining: str
    retry_ms: int

    @classmethod
    def parse(cls, entry: str) -> Decision:
        seq, seconds, micros, key, capacity, rate, cost, allowed, remaining, retry_ms = json.loads(entry)
        return cls(
            seq=int(seq), seconds=int(seconds), microseconds=int(micros), key=key, capacity=float(capacity),
            rate=float(rate), cost=int(float(cost)), allowed=allowed == "1", remaining=remaining, retry_ms=int(retry_ms),
        )

    @property
    def now_ms(self) -> float:
        """The script's `now`, by the same IEEE operations."""
        return float(self.seconds) * 1000 + float(self.microseconds) / 1000


@dataclass(frozen=True)
class Replay:
    decisions: int
    allowed: int  # by the model; it differs from the script only by rounding ties
    ties: int
    script_over_model: int  # ties the script allowed and the model denied
    widest_tie: float
    mismatches: list[str]


def replay(log: list[Decision]) -> Replay:
    """Run the log, in sequence order, through the model (tests/model_check.py); list every disagreement."""
    ordered = sorted(log, key=lambda d: d.seq)
    mismatches = []
    if [d.seq for d in ordered] != list(range(1, len(ordered) + 1)):
        mismatches.append("the sequence has gaps or repeats")
    state: bucket.BucketState | None = None
    allowed = ties = script_over_model = 0
    widest_tie = 0.0
    for d in ordered:
        spec = bucket.BucketSpec(capacity=d.capacity, rate=d.rate / 1000, cost=d.cost)
        agreement = agree([state], [spec], d.now_ms, d.allowed, [float(d.remaining)])
        mismatches += [f"seq {d.seq}: {problem}" for problem in agreement.problems]
        allowed += agreement.model.allowed
        ties += agreement.ties
        script_over_model += agreement.script_over_model
        widest_tie = max(widest_tie, agreement.widest_tie)
        state = agreement.states[0]
    return Replay(
        decisions=len(ordered), allowed=allowed, ties=ties, script_over_model=script_over_model,
        widest_tie=widest_tie, mismatches=mismatches,
    )
