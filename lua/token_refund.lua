-- Give back what a check charged, when a request's later check in another
-- Redis Cluster slot denied it (all-or-nothing across slots; see the README).
--
-- KEYS[i]           the bucket of limit i (a hash: tokens, ts)
-- ARGV[2i-1 .. 2i]  capacity, cost of limit i
--
-- The tokens go back as of the bucket's own stamp, capped at its capacity, so a
-- bucket never holds more than it would had the charge not happened. A bucket
-- that expired meanwhile is full already and stays absent. Returns the number
-- of buckets refunded.

local refunded = 0
for i = 1, #KEYS do
  local held = tonumber(redis.call('HGET', KEYS[i], 'tokens'))
  if held ~= nil then
    local capacity = tonumber(ARGV[2 * i - 1])
    local cost = tonumber(ARGV[2 * i])
    redis.call('HSET', KEYS[i], 'tokens', math.min(capacity, held + cost))
    refunded = refunded + 1
  end
end
return refunded
