-- fair_leave.lua: a queued waiter gives up (cancelled, or its wait ran out): it
-- leaves the queue at once and everyone behind it moves up one place.
-- KEYS[1]  the lock hash
-- KEYS[2]  the queue list
-- KEYS[3]  the deadline sorted set
-- KEYS[4]  the unlock channel prefix
-- ARGV[1]  owner field
-- ARGV[2]  wait allowance in milliseconds
-- ARGV[3]  unlock message ("0")
-- ARGV[4]  now, milliseconds since the epoch
-- Deadlines behind the leaver drop by one allowance, but never below now + allowance
-- (see fair_acquire.lua).
-- Reply: 1 when the owner was queued and left, 0 when it was not queued.
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
local wait = tonumber(ARGV[2])
local now = tonumber(ARGV[4])
for i = pos + 1, #queue do
    local d = tonumber(redis.call('zscore', KEYS[3], queue[i]))
    if d then
        redis.call('zadd', KEYS[3], math.max(d - wait, math.min(d, now + wait)), queue[i])
    end
end
redis.call('zrem', KEYS[3], ARGV[1])
redis.call('lrem', KEYS[2], 0, ARGV[1])
-- The head left while the lock is free: wake the new head rather than let it sleep
-- until its deadline.
if pos == 1 and redis.call('exists', KEYS[1]) == 0 and #queue > 1 then
    redis.call('publish', KEYS[4] .. ':' .. queue[2], ARGV[3])
end
return 1
