-- fair_acquire.lua: take, re-enter or queue for a fair lock (Redisson FairLock layout).
-- KEYS[1]  the lock hash
-- KEYS[2]  the queue list, redisson_lock_queue:{name}
-- KEYS[3]  the deadline sorted set, redisson_lock_timeout:{name}
-- ARGV[1]  lease in milliseconds
-- ARGV[2]  owner field
-- ARGV[3]  wait allowance in milliseconds (the fair wait timeout)
-- ARGV[4]  now, milliseconds since the epoch, from the caller's wall clock
-- ARGV[5]  "1": a single try that never queues; "0": queue when the lock is taken
-- Reply: nil when the owner now holds the lock; otherwise how long to wait, in
--        milliseconds, before trying again (1 for a single try that failed).
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
            -- everyone behind moves up one place: their allowance shrinks by one wait
            local rest = redis.call('zrange', KEYS[3], 0, -1)
            for i = 1, #rest do
                redis.call('zincrby', KEYS[3], -wait, rest[i])
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
    return tonumber(mine) - wait - now
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
