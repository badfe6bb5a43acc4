-- lock_release.lua: release one hold of a reentrant lock (Redisson RLock layout).
-- KEYS[1]  the lock hash
-- KEYS[2]  the unlock channel, redisson_lock__channel:{name}
-- ARGV[1]  unlock message ("0": wake one waiter)
-- ARGV[2]  lease in milliseconds, re-applied while the count stays above zero
-- ARGV[3]  owner field
-- Reply: nil when the owner does not hold the lock;
--        0 when the owner still holds it (count decremented);
--        1 when the lock was released (key deleted, message published).
-- The count is read first (Redisson's unlock checks HEXISTS, then decrements): the
-- last hold's release, the common case, then needs no write but the DEL. Any other
-- value takes Redisson's path, HINCRBY and all (and its error on a non-integer).
local count = redis.call('hget', KEYS[1], ARGV[3])
if not count then
    return nil
end
if count ~= '1' and redis.call('hincrby', KEYS[1], ARGV[3], -1) > 0 then
    redis.call('pexpire', KEYS[1], ARGV[2])
    return 0
end
redis.call('del', KEYS[1])
redis.call('publish', KEYS[2], ARGV[1])
return 1
