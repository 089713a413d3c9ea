-- Take (or renew) a concurrency lease, in one atomic step.
--
-- KEYS[1]  one identity's leases under one limit: a sorted set of lease ids,
--          each scored by the Redis time (ms) it expires
-- ARGV[1]  the lease id, unique per request
-- ARGV[2]  capacity: the most leases live at once
-- ARGV[3]  ttl_ms: how long the lease lives unless renewed or released
--
-- Returns {admitted (1|0), live leases after the call}. Expired leases are
-- dropped first, so a gateway that died holding leases frees them within their
-- TTL. A lease already held is renewed and not counted twice. Release is a
-- plain ZREM. The clock is Redis's own TIME. It is the model of
-- gateway/limiter/leases.py, in milliseconds.

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local lease, capacity, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])

redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local held = redis.call('ZSCORE', KEYS[1], lease)
local count = redis.call('ZCARD', KEYS[1])
if not held and count >= capacity then
  return {0, count}
end
redis.call('ZADD', KEYS[1], now + ttl, lease)
-- The set lives as long as its last lease: one taken under a longer TTL before
-- a reload keeps it alive for its full time.
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
redis.call('PEXPIRE', KEYS[1], math.max(1, tonumber(last[2]) - now))
if held then
  return {1, count}
end
return {1, count + 1}
