-- fair_release.lua: release one hold of a fair lock; on full release pass the lock
-- on to the head waiter: a direct grant when it registered for one, otherwise a
-- wake-up on its own channel (Redisson FairLock layout; see fair_lib.lua).
-- KEYS[1]  the lock hash
-- KEYS[2]  the queue list
-- KEYS[3]  the deadline sorted set
-- KEYS[4]  the unlock channel prefix, redisson_lock__channel:{name}
-- KEYS[5]  the direct-grants hash
-- ARGV[1]  unlock message ("0")
-- ARGV[2]  lease in milliseconds, re-applied while the count stays above zero
-- ARGV[3]  owner field
-- ARGV[4]  now, milliseconds since the epoch
-- ARGV[5]  wait allowance in milliseconds
-- ARGV[6]  optional: the count the caller expects the owner to keep, as for
--          lock_release.lua's ARGV[7]: at that count or less, the reply is 0 and
--          nothing is decremented (a retry of a release that ran)
-- Reply: nil when the owner does not hold the lock (if the lock is free, it is still
--        passed on, so the queue keeps moving); 0 when the owner still holds it;
--        1 when the lock was released and passed on; 2 when it was released and
--        nobody was queued (after the purge of stale heads).
local now = tonumber(ARGV[4])
local wait = tonumber(ARGV[5])
local head = purge_stale(KEYS[2], KEYS[3], KEYS[5], now)

local count = redis.call('hget', KEYS[1], ARGV[3])
if not count then
    if redis.call('exists', KEYS[1]) == 0 then
        pass_on(head, KEYS[1], KEYS[2], KEYS[3], KEYS[5], KEYS[4], now, wait, ARGV[1])
    end
    return nil
end
local keep = tonumber(ARGV[6] or '0')
local held = tonumber(count)
if keep > 0 and held ~= nil and held <= keep then
    redis.call('pexpire', KEYS[1], ARGV[2])
    return 0
end
if count ~= '1' and redis.call('hincrby', KEYS[1], ARGV[3], -1) > 0 then
    redis.call('pexpire', KEYS[1], ARGV[2])
    return 0
end
redis.call('del', KEYS[1])
if head == false then
    return 2
end
pass_on(head, KEYS[1], KEYS[2], KEYS[3], KEYS[5], KEYS[4], now, wait, ARGV[1])
return 1
