-- Lease tokens from one token bucket, in one atomic step: take as many whole
-- tokens as the gateway wants or the bucket holds, whichever is fewer, but at
-- least the request's cost; deny when the bucket holds less than the cost. The
-- gateway spends the tokens beyond the cost locally (a limit's `lease`).
--
-- KEYS[1]  the bucket (a hash: tokens, ts), kept as lua/token_bucket.lua keeps it
-- ARGV     capacity, rate (tokens per second), cost, want (tokens wanted, >= cost)
--
-- Returns {allowed (1|0), granted, remaining tokens as a string, retry_after_ms}.
-- granted is 0 when denied; remaining is after the grant when allowed, else as
-- found; retry_after_ms is 0 when allowed and -1 when the cost exceeds the
-- capacity and can never pass.
--
-- The clock is Redis's own TIME. It is the model `lease` of
-- gateway/limiter/bucket.py, in milliseconds. Redis scripts cannot share code,
-- so `exact` and the TTL rule are token_bucket.lua's, repeated.

local function exact(x)
  local text = string.format('%.14g', x)
  if tonumber(text) ~= x then
    text = string.format('%.17g', x)
  end
  return text
end

local MAX_TTL_MS = 1e16

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + tonumber(time[2]) / 1000

local capacity = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local want = tonumber(ARGV[4])

local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local held = tonumber(state[1])
local ts = tonumber(state[2])
local kept = held ~= nil
if held == nil or ts == nil then
  held = capacity
  ts = now
end
held = math.min(capacity, held + math.max(0, now - ts) / 1000 * rate)
local stamp = math.max(ts, now)

if held < cost then
  -- As token_bucket.lua does: a denied key still outlives its state, which a reload that
  -- lowered the rate or raised the burst makes take longer to fill than its TTL allows.
  local need = (stamp - now) + (capacity - held) / rate * 1000
  local ttl = kept and redis.call('PTTL', KEYS[1]) or -1  -- -1: none, and none is needed
  if ttl >= 0 and ttl < need then
    redis.call('PEXPIRE', KEYS[1], math.min(math.ceil(need) + 1000, MAX_TTL_MS))
  end
  if cost > capacity then
    return {0, 0, exact(held), -1}
  end
  return {0, 0, exact(held), math.ceil((stamp - now) + (cost - held) / rate * 1000)}
end

local granted = math.max(cost, math.min(want, math.floor(held)))
if granted > 0 then
  held = held - granted
  redis.call('HSET', KEYS[1], 'tokens', held, 'ts', stamp)
  local ttl = math.min(math.ceil((stamp - now) + capacity / rate * 1000) + 1000, MAX_TTL_MS)
  redis.call('PEXPIRE', KEYS[1], ttl)
end
return {1, granted, exact(held), 0}
