-- Token bucket over several limits, all-or-nothing, in one atomic step.
--
-- KEYS[i]           the bucket of limit i (a hash: tokens, ts)
-- ARGV[3i-2 .. 3i]  capacity, rate (tokens per second), cost of limit i
--
-- Returns {allowed (1|0), {remaining tokens per limit, as strings}, retry_after_ms}.
-- Remaining is after the charge when allowed, else as found. retry_after_ms is
-- 0 when allowed and -1 when some cost exceeds its capacity and can never pass.
-- Remaining values are strings because Redis truncates Lua numbers to integers.
--
-- The clock is Redis's own TIME, never the caller's: a gateway whose clock runs
-- fast gains nothing. It is the model of gateway/limiter/bucket.py, in milliseconds.

-- The number as a string that reads back as the same double: tostring's 14
-- digits when they do, else 17, so 0.999999999999999 tokens never read as "1".
local function exact(x)
  local text = string.format('%.14g', x)
  if tonumber(text) ~= x then
    text = string.format('%.17g', x)
  end
  return text
end

-- The longest TTL a bucket gets, about 317,000 years. PEXPIRE takes only an
-- integer, and Redis 7.0 passes a Lua number as '%.17g', which from 1e17 on is
-- '1e+17': an error, raised after HSET has charged the bucket. So a bucket that
-- takes longer than this to refill expires after this long.
local MAX_TTL_MS = 1e16

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + tonumber(time[2]) / 1000

local count = #KEYS
local tokens, stamps, capacities, rates, costs = {}, {}, {}, {}, {}
local allowed = 1
local retry_ms = 0

for i = 1, count do
  local capacity = tonumber(ARGV[3 * i - 2])
  local rate = tonumber(ARGV[3 * i - 1])
  local cost = tonumber(ARGV[3 * i])
  local state = redis.call('HMGET', KEYS[i], 'tokens', 'ts')
  local held = tonumber(state[1])
  local ts = tonumber(state[2])
  if held == nil or ts == nil then
    held = capacity
    ts = now
  end
  -- A clock that stepped back (a failover to another host) refills nothing,
  -- and the stamp never moves backwards.
  local elapsed = math.max(0, now - ts)
  held = math.min(capacity, held + elapsed / 1000 * rate)
  tokens[i], stamps[i] = held, math.max(ts, now)
  capacities[i], rates[i], costs[i] = capacity, rate, cost
  if held < cost then
    allowed = 0
    if cost > capacity then
      retry_ms = -1
    elseif retry_ms >= 0 then
      -- A stamp ahead of now refills nothing until now reaches it.
      retry_ms = math.max(retry_ms, math.ceil((stamps[i] - now) + (cost - held) / rate * 1000))
    end
  end
end

local remaining = {}
for i = 1, count do
  if allowed == 1 and costs[i] > 0 then
    tokens[i] = tokens[i] - costs[i]
    redis.call('HSET', KEYS[i], 'tokens', tokens[i], 'ts', stamps[i])
    -- Long enough to refill completely, so a partly full bucket never
    -- expires early and comes back full.
    local ttl = math.min(math.ceil((stamps[i] - now) + capacities[i] / rates[i] * 1000) + 1000, MAX_TTL_MS)
    redis.call('PEXPIRE', KEYS[i], ttl)
  end
  remaining[i] = exact(tokens[i])
end

if allowed == 1 then
  retry_ms = 0
end
return {allowed, remaining, retry_ms}
