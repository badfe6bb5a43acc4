-- fair_acquire.lua: take, re-enter or queue for a fair lock (Redisson FairLock layout).
-- KEYS[1]  the lock hash
-- KEYS[2]  the queue list, redisson_lock_queue:{name}
-- KEYS[3]  the deadline sorted set, redisson_lock_timeout:{name}
-- KEYS[4]  the direct-grants hash, leash_lock_grants:{name} (see fair_lib.lua)
-- ARGV[1]  lease in milliseconds
-- ARGV[2]  owner field
-- ARGV[3]  wait allowance in milliseconds (the fair wait timeout)
-- ARGV[4]  now, milliseconds since the epoch, from the caller's wall clock
-- ARGV[5]  "1": a single try that never queues; "0": queue when the lock is taken;
--          "2": queue, and never take (a lock found free is left to the head
--          that a release wakes, or to the caller's next attempt)
-- ARGV[6]  optional: "<lease ms>:<grant name>" (see fair_lib.lua) registers the owner, once queued, for
--          a direct grant; absent or "" does not
-- ARGV[7]  optional: "1" when the caller knows of no hold of the owner, so a hold
--          found in the hash is a direct grant it has not heard of yet: it is
--          claimed (its lease renewed) rather than re-entered
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
local register = ARGV[6] or ''

local head = purge_stale(KEYS[2], KEYS[3], KEYS[4], now)

if ARGV[5] ~= '2' and redis.call('exists', KEYS[1]) == 0 then
    if head == false or head == ARGV[2] then
        if head == ARGV[2] then
            pop_head(KEYS[2], KEYS[3], KEYS[4], ARGV[2], now, wait)
        end
        redis.call('hset', KEYS[1], ARGV[2], 1)
        redis.call('pexpire', KEYS[1], ARGV[1])
        return nil
    end
end

if redis.call('hexists', KEYS[1], ARGV[2]) == 1 then
    if ARGV[7] ~= '1' then
        redis.call('hincrby', KEYS[1], ARGV[2], 1)
    end
    redis.call('pexpire', KEYS[1], ARGV[1])
    return nil
end

if ARGV[5] == '1' then
    return 1
end

-- The registrations of waiters that are gone are cleared by leash's scripts, but
-- not by Redisson's purge; the hash expires three allowances after the last
-- registration (live waiters register again at least every allowance / 3).
local function set_registration()
    if register ~= '' then
        redis.call('hset', KEYS[4], ARGV[2], register)
        if redis.call('pttl', KEYS[4]) < 3 * wait then
            redis.call('pexpire', KEYS[4], 3 * wait)
        end
    else
        redis.call('hdel', KEYS[4], ARGV[2])
    end
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
    set_registration()
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
set_registration()
return ttl
