-- fair_leave.lua: a queued waiter gives up (cancelled, or its wait ran out): it
-- leaves the queue at once and everyone behind it moves up one place. If a release
-- already granted it the lock directly (see fair_lib.lua) and it had not heard yet,
-- that grant is given back and the lock passed on.
-- KEYS[1]  the lock hash
-- KEYS[2]  the queue list
-- KEYS[3]  the deadline sorted set
-- KEYS[4]  the unlock channel prefix
-- KEYS[5]  the direct-grants hash
-- ARGV[1]  owner field
-- ARGV[2]  wait allowance in milliseconds
-- ARGV[3]  unlock message ("0")
-- ARGV[4]  now, milliseconds since the epoch
-- ARGV[5]  "1" when the caller knows of no hold of the owner, so a hold found in the
--          hash is an unheard direct grant, given back here
-- Deadlines behind the leaver drop by one allowance, but never below now + allowance
-- (see fair_acquire.lua).
-- Reply: 1 when the owner was queued and left, 0 when it was not queued, 2 when it
--        gave back a direct grant.
local wait = tonumber(ARGV[2])
local now = tonumber(ARGV[4])
redis.call('hdel', KEYS[5], ARGV[1])
if ARGV[5] == '1' and redis.call('hexists', KEYS[1], ARGV[1]) == 1 then
    redis.call('hdel', KEYS[1], ARGV[1])
    if redis.call('hlen', KEYS[1]) > 0 then
        return 2
    end
    redis.call('del', KEYS[1])
    pass_on(purge_stale(KEYS[2], KEYS[3], KEYS[5], now), KEYS[1], KEYS[2], KEYS[3], KEYS[5], KEYS[4], now, wait, ARGV[3])
    return 2
end
local queue = redis.call('lrange', KEYS[2], 0, -1)
local pos = 0
for i = 1, #queue do
    if queue[i] == ARGV[1] then
        pos = i
        break
    end
end
if pos == 0 then
    redis.call('zrem', KEYS[3], ARGV[1])
    return 0
end
for i = pos + 1, #queue do
    local d = tonumber(redis.call('zscore', KEYS[3], queue[i]))
    if d then
        redis.call('zadd', KEYS[3], math.max(d - wait, math.min(d, now + wait)), queue[i])
    end
end
redis.call('zrem', KEYS[3], ARGV[1])
redis.call('lrem', KEYS[2], 0, ARGV[1])
-- The head left while the lock is free: pass the lock on rather than let the new
-- head sleep until its deadline.
if pos == 1 and redis.call('exists', KEYS[1]) == 0 and #queue > 1 then
    pass_on(purge_stale(KEYS[2], KEYS[3], KEYS[5], now), KEYS[1], KEYS[2], KEYS[3], KEYS[5], KEYS[4], now, wait, ARGV[3])
end
return 1
