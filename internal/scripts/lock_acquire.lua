-- lock_acquire.lua: take or re-enter a reentrant lock (Redisson RLock layout).
-- KEYS[1]  the lock hash (the lock's name)
-- ARGV[1]  lease in milliseconds (PEXPIRE)
-- ARGV[2]  owner field "<client-id>:<owner-id>"
-- Reply: nil when the caller now holds the lock (its count was incremented);
--        otherwise the lock's PTTL in milliseconds (the longest sensible wait).
if (redis.call('exists', KEYS[1]) == 0) or (redis.call('hexists', KEYS[1], ARGV[2]) == 1) then
    redis.call('hincrby', KEYS[1], ARGV[2], 1)
    redis.call('pexpire', KEYS[1], ARGV[1])
    return nil
end
return redis.call('pttl', KEYS[1])
