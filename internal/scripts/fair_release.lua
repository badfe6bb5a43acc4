-- fair_release.lua: release one hold of a fair lock; on full release wake only the
-- head waiter, on its own channel (Redisson FairLock layout).
-- KEYS[1]  the lock hash
-- KEYS[2]  the queue list
-- KEYS[3]  the deadline sorted set
-- KEYS[4]  the unlock channel prefix, redisson_lock__channel:{name}
-- ARGV[1]  unlock message ("0")
-- ARGV[2]  lease in milliseconds, re-applied while the count stays above zero
-- ARGV[3]  owner field
-- ARGV[4]  now, milliseconds since the epoch
-- Reply: nil when the owner does not hold the lock (if the lock is free, the head is
--        still woken, so the queue keeps moving); 0 when the owner still holds it;
--        1 when the lock was released and the head (if any) woken.
local now = tonumber(ARGV[4])
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

local function wake_head()
    local head = redis.call('lindex', KEYS[2], 0)
    if head ~= false then
        redis.call('publish', KEYS[4] .. ':' .. head, ARGV[1])
    end
end

if redis.call('hexists', KEYS[1], ARGV[3]) == 0 then
    if redis.call('exists', KEYS[1]) == 0 then
        wake_head()
    end
    return nil
end
local count = redis.call('hincrby', KEYS[1], ARGV[3], -1)
if count > 0 then
    redis.call('pexpire', KEYS[1], ARGV[2])
    return 0
end
redis.call('del', KEYS[1])
wake_head()
return 1
