-- Token buckets and fixed-window quotas: one or more checks, each of several limits and each
-- all-or-nothing across its own limits, in one atomic step.
--
-- The checks of a call run one after another, as that many calls in that order would: a
-- later check sees what an earlier one charged. Check j, whose first key is KEYS[k] and whose
-- letters are ARGV[p] (k and p start at 1 and move past each check in turn):
-- ARGV[p]                 one letter per limit: 'b' a token bucket, 'q' a quota, in capitals ('B',
--                         'Q') when its charge is owed; n letters, n limits
-- KEYS[k + i - 1]         limit i: a bucket is a hash {tokens, ts}, a quota a hash {n, w}
-- ARGV[p + 4i - 3 .. +3]  a bucket: capacity, rate (tokens per second), cost, debt (tokens it may owe)
--                         a quota:  limit, period_ms (0: a calendar month), cost, offset_ms
--
-- Returns five values per check, one check after another in one flat list:
-- allowed (1|0), {remaining per limit, as strings}, retry_after_ms, wait_ms,
-- {ms until each quota's window ends; -1 for a bucket}. A call of one check returns exactly
-- {allowed, {remaining, ...}, retry_after_ms, wait_ms, {reset_ms, ...}}.
-- Remaining is after the charge when allowed, else as found (a quota: its limit less its
-- count). retry_after_ms is 0 when allowed and -1 when some cost exceeds its capacity or
-- limit and can never pass. wait_ms is how long an allowed request waits first: a bucket
-- that may owe (max_delay × rate) admits a request it cannot pay now by going into debt,
-- and the request waits until the tokens it took would have refilled. Remaining values
-- are strings because Redis truncates Lua numbers to integers.
--
-- An owed charge (a capital letter: settled after the response, or a rule that charges every
-- hit) is taken even when the check is refused and past what the bucket holds, into debt
-- (a quota: past its limit). It refuses as any limit does when it could not pay, and a read
-- (cost 0) is refused while the bucket is below zero; its retry is when such a read passes.
-- Its debt is 0. The other limits of the check stay all or nothing.
--
-- The clock is Redis's own TIME, never the caller's, read once per call: a gateway whose
-- clock runs fast gains nothing. It is the model of gateway/limiter/bucket.py and quota.py,
-- in milliseconds.

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
local DAY_MS = 86400000

-- Days since 1970-01-01 of a Gregorian date, and back (Howard Hinnant's algorithms).
local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local mp = m > 2 and m - 3 or m + 9
  local doy = math.floor((153 * mp + 2) / 5) + d - 1
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy
  return era * 146097 + doe - 719468
end

local function civil_from_days(z)
  z = z + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y, m
end

-- The window holding t: its start and end in ms since the epoch.
local function window(period, offset, t)
  if period == 0 then
    -- Before the reset time, the 1st still belongs to the month before.
    local y, m = civil_from_days(math.floor((t - offset) / DAY_MS))
    local start = days_from_civil(y, m, 1) * DAY_MS + offset
    if m == 12 then y, m = y + 1, 1 else m = m + 1 end
    return start, days_from_civil(y, m, 1) * DAY_MS + offset
  end
  local start = math.floor((t - offset) / period) * period + offset
  return start, start + period
end

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + tonumber(time[2]) / 1000

-- One check: its first key KEYS[k], its letters ARGV[p], `count` limits.
local function check(k, p, count)
  local kinds = ARGV[p]
  local held, stamps, ends, costs, used, kept, owed, quotas = {}, {}, {}, {}, {}, {}, {}, {}
  local allowed = 1
  local retry_ms = 0
  local wait_ms = 0

  local function deny(ms)
    allowed = 0
    if ms < 0 then
      retry_ms = -1
    elseif retry_ms >= 0 then
      retry_ms = math.max(retry_ms, math.ceil(ms))
    end
  end

  for i = 1, count do
    local a = p + 4 * i - 3
    local cost = tonumber(ARGV[a + 2])
    local kind = string.sub(kinds, i, i)
    costs[i] = cost
    owed[i] = kind == 'B' or kind == 'Q'
    quotas[i] = kind == 'q' or kind == 'Q'
    if quotas[i] then
      local limit, period, offset = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 3])
      local state = redis.call('HMGET', KEYS[k + i - 1], 'n', 'w')
      local n, w = tonumber(state[1]), tonumber(state[2])
      kept[i] = n ~= nil
      local start, finish = window(period, offset, now)
      if n == nil or w == nil or w < start then
        n = 0
      elseif w > start then
        -- A clock that stepped back across a boundary never resets a quota.
        start, finish = window(period, offset, w)
      end
      held[i], stamps[i], ends[i], used[i] = limit - n, start, finish, n
      if n + cost > limit then
        -- An owed charge past the limit is read again in the next window.
        deny((cost > limit and not owed[i]) and -1 or finish - now)
      end
    else
      local capacity, rate, debt = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 3])
      local state = redis.call('HMGET', KEYS[k + i - 1], 'tokens', 'ts')
      local tokens = tonumber(state[1])
      local ts = tonumber(state[2])
      kept[i] = tokens ~= nil
      if tokens == nil or ts == nil then
        tokens = capacity
        ts = now
      end
      -- A clock that stepped back (a failover to another host) refills nothing,
      -- and the stamp never moves backwards.
      local elapsed = math.max(0, now - ts)
      tokens = math.min(capacity, tokens + elapsed / 1000 * rate)
      held[i], stamps[i], ends[i] = tokens, math.max(ts, now), -1
      if owed[i] then
        if tokens < cost then
          -- Until a read passes again: the charge is taken all the same.
          deny((stamps[i] - now) + (cost - tokens) / rate * 1000)
        end
      elseif tokens < cost then
        if cost > capacity then
          deny(-1)
        else
          -- A stamp ahead of now refills nothing until now reaches it.
          local until_ms = (stamps[i] - now) + (cost - tokens) / rate * 1000
          if tokens - cost < -debt then
            -- A bucket that may owe admits again once its debt would cover the rest.
            deny(math.max(0, until_ms - debt / rate * 1000))
          else
            wait_ms = math.max(wait_ms, math.ceil(until_ms))
          end
        end
      end
    end
  end

  local remaining, resets = {}, {}
  for i = 1, count do
    local quota = quotas[i]
    local charged = allowed == 1 or owed[i]
    if charged then
      held[i] = held[i] - costs[i]
      if costs[i] > 0 then
        local a = p + 4 * i - 3
        if quota then
          redis.call('HSET', KEYS[k + i - 1], 'n', used[i] + costs[i], 'w', stamps[i])
          -- Gone when the window ends.
          redis.call('PEXPIRE', KEYS[k + i - 1], math.max(1, math.ceil(ends[i] - now)))
        else
          local capacity, rate = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
          redis.call('HSET', KEYS[k + i - 1], 'tokens', held[i], 'ts', stamps[i])
          -- Long enough to refill completely, from empty or from its debt, so a partly
          -- full bucket never expires early and comes back full.
          local deficit = math.max(capacity, capacity - held[i])
          local ttl = math.min(math.ceil((stamps[i] - now) + deficit / rate * 1000) + 1000, MAX_TTL_MS)
          redis.call('PEXPIRE', KEYS[k + i - 1], ttl)
        end
      end
    end
    if not charged and kept[i] then
      -- A denial writes nothing, but a key must still outlive its state: a reload that
      -- lowered the rate (or raised the burst or lengthened the window) makes the bucket take
      -- longer to fill than the TTL its last charge set, and expiring early it would come
      -- back full (or the quota empty) too soon.
      local ttl = redis.call('PTTL', KEYS[k + i - 1])  -- -1: none, and none is needed
      if quota then
        -- Gone when the window ends, as a charge sets it. PTTL is in whole milliseconds, so
        -- only a deadline more than one short is moved: the window's own is left alone.
        local need = math.max(1, math.ceil(ends[i] - now))
        if ttl >= 0 and ttl + 1 < need then
          redis.call('PEXPIRE', KEYS[k + i - 1], need)
        end
      else
        local a = p + 4 * i - 3
        local capacity, rate = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
        local need = (stamps[i] - now) + (capacity - held[i]) / rate * 1000
        if ttl >= 0 and ttl < need then
          redis.call('PEXPIRE', KEYS[k + i - 1], math.min(math.ceil(need) + 1000, MAX_TTL_MS))
        end
      end
    end
    remaining[i] = exact(held[i])
    resets[i] = quota and math.ceil(ends[i] - now) or -1
  end

  if allowed == 1 then
    retry_ms = 0
  else
    wait_ms = 0
  end
  return allowed, remaining, retry_ms, wait_ms, resets
end

local replies, k, p = {}, 1, 1
local last = #ARGV
while p <= last do
  local count = #ARGV[p]
  local r = #replies
  replies[r + 1], replies[r + 2], replies[r + 3], replies[r + 4], replies[r + 5] = check(k, p, count)
  k, p = k + count, p + 1 + 4 * count
end
return replies
