-- Give back what a check charged, when a request's later check in another
-- Redis Cluster slot denied it (all-or-nothing across slots; see docs/limit-policies.md).
--
-- KEYS[i]           limit i: a bucket (a hash: tokens, ts) or a quota (a hash: n, w)
-- ARGV[2i-1 .. 2i]  capacity (a quota: its limit), cost of limit i
--
-- A bucket's tokens go back as of its own stamp, capped at its capacity, so a
-- bucket never holds more than it would had the charge not happened; a quota's
-- count goes down by the cost, never below zero. One that expired meanwhile is
-- full already and stays absent. Returns the number of limits refunded.

local refunded = 0
for i = 1, #KEYS do
  local state = redis.call('HMGET', KEYS[i], 'tokens', 'n')
  local held, used = tonumber(state[1]), tonumber(state[2])
  local capacity = tonumber(ARGV[2 * i - 1])
  local cost = tonumber(ARGV[2 * i])
  if held ~= nil then
    redis.call('HSET', KEYS[i], 'tokens', math.min(capacity, held + cost))
    refunded = refunded + 1
  elseif used ~= nil then
    redis.call('HSET', KEYS[i], 'n', math.max(0, used - cost))
    refunded = refunded + 1
  end
end
return refunded
