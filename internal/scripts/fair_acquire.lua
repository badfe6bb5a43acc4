-- fair_acquire.lua: take, re-enter or queue for a fair lock (Redisson FairLock layout).
-- KEYS[1]  the lock hash
-- KEYS[2]  the queue list, redisson_lock_queue:{name}
-- KEYS[3]  the deadline sorted set, redisson_lock_timeout:{name}
-- ARGV[1]  lease in milliseconds
-- ARGV[2]  owner field
-- ARGV[3]  wait allowance in milliseconds (the fair wait timeout)
-- ARGV[4]  now, milliseconds since the epoch, from the caller's wall clock
-- ARGV[5]  "1": a single try that never queues; "0": queue when the lock is taken
-- Reply: nil when the owner now holds the lock; otherwise how long until the entry
--        ahead of the owner could go stale, in milliseconds (the lock's PTTL when the
--        owner heads the queue; -1 when the lock has no expiry), or 1 for a single try
--        that failed.
--
-- Deadlines: a queued owner's deadline starts, as in Redisson, as the one ahead of it
-- plus the wait allowance. Two differences keep every grant O(1) and live waiters in
-- place, and stay readable by Redisson (which only compares deadlines with now):
--   * a queued owner that asks again refreshes its own deadline to at least
--     now + allowance, so a live waiter never loses its place;
--   * when the head takes the lock, only the new head's deadline is brought down to
--     at most now + allowance (Redisson lowers every deadline behind by one
--     allowance: O(waiters) per grant). Only heads are ever purged, so a gone waiter
--     still loses its place one allowance after it reaches the head.
local now = tonumber(ARGV[4])
local wait = tonumber(ARGV[3])

-- Purge stale heads: queued owners whose deadline passed without them taking their
-- turn. Only heads are purged; a deadline missing from the set (a torn queue) counts
-- as stale rather than failing the script.
while true do
    local head = redis.call('lindex', KEYS[2], 0)
    if head == false then
        break
    end
    local deadline = tonumber(redis.call('zscore', KEYS[3], head))
    if deadline == nil or deadline <= now then
        redis.call('zrem', KEYS[3], head)
        redis.call('lpop', KEYS[2])
    else
        break
    end
end

if redis.call('exists', KEYS[1]) == 0 then
    local head = redis.call('lindex', KEYS[2], 0)
    if head == false or head == ARGV[2] then
        if head == ARGV[2] then
            redis.call('lpop', KEYS[2])
            redis.call('zrem', KEYS[3], ARGV[2])
            -- the next one heads the queue now: it has one allowance to take its turn
            local next = redis.call('lindex', KEYS[2], 0)
            if next ~= false then
                redis.call('zadd', KEYS[3], 'LT', now + wait, next)
            end
        end
        redis.call('hset', KEYS[1], ARGV[2], 1)
        redis.call('pexpire', KEYS[1], ARGV[1])
        return nil
    end
end

if redis.call('hexists', KEYS[1], ARGV[2]) == 1 then
    redis.call('hincrby', KEYS[1], ARGV[2], 1)
    redis.call('pexpire', KEYS[1], ARGV[1])
    return nil
end

if ARGV[5] == '1' then
    return 1
end

local mine = redis.call('zscore', KEYS[3], ARGV[2])
if mine ~= false then
    if tonumber(mine) < now + wait then
        redis.call('zadd', KEYS[3], now + wait, ARGV[2])
    end
    local pos = redis.call('lpos', KEYS[2], ARGV[2])
    if pos == false then
        -- in the set but not the list (a torn queue): take the last place
        redis.call('rpush', KEYS[2], ARGV[2])
        pos = redis.call('llen', KEYS[2]) - 1
    end
    if pos == 0 then
        return redis.call('pttl', KEYS[1])
    end
    local ahead = redis.call('lindex', KEYS[2], pos - 1)
    return (tonumber(redis.call('zscore', KEYS[3], ahead)) or now) - now
end

local tail = redis.call('lindex', KEYS[2], -1)
local ttl
if tail ~= false and tail ~= ARGV[2] then
    ttl = (tonumber(redis.call('zscore', KEYS[3], tail)) or now) - now
else
    ttl = redis.call('pttl', KEYS[1])
end
if redis.call('zadd', KEYS[3], ttl + wait + now, ARGV[2]) == 1 then
    redis.call('rpush', KEYS[2], ARGV[2])
end
return ttl
