-- lock_force_release.lua: delete the lock whoever holds it (Redisson forceUnlock).
-- KEYS[1]  the lock hash
-- KEYS[2]  the unlock channel
-- ARGV[1]  unlock message ("0")
-- Reply: 1 when the lock existed and was deleted (message published), 0 otherwise.
if redis.call('del', KEYS[1]) == 1 then
    redis.call('publish', KEYS[2], ARGV[1])
    return 1
end
return 0
