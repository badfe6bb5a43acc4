-- lock_acquire.lua: take or re-enter a reentrant lock (Redisson RLock layout).
-- KEYS[1]  the lock hash (the lock's name)
-- KEYS[2]  optional: the registrations hash, leash_lock_reg:{name} (see lock_lib.lua)
-- KEYS[3]  optional: the registration order list, leash_lock_regq:{name}
-- ARGV[1]  lease in milliseconds (PEXPIRE)
-- ARGV[2]  owner field "<client-id>:<owner-id>"
-- ARGV[3]  optional: the caller's client id
-- ARGV[4]  optional: a queued waiter's registration, "<lease>|<stamp>|<id>|<field>",
--          written when the lock is refused and dropped when it is taken; "" for none
-- ARGV[5]  optional: that waiter's grant field, claimed if a direct grant to it is
--          on the key (its message not yet heard of); "" for none
-- Reply: nil when the caller now holds the lock (its count was incremented);
--        -3 when the waiter's grant field holds the lock (its lease re-applied);
--        otherwise the lock's PTTL in milliseconds (the longest sensible wait).
local registry = KEYS[2] ~= nil and ARGV[4] ~= nil and ARGV[4] ~= ''
if ARGV[5] ~= nil and ARGV[5] ~= '' and redis.call('hexists', KEYS[1], ARGV[5]) == 1 then
    redis.call('pexpire', KEYS[1], ARGV[1])
    if registry then
        deregister(KEYS[2], KEYS[3], ARGV[3])
    end
    return -3
end
if (redis.call('exists', KEYS[1]) == 0) or (redis.call('hexists', KEYS[1], ARGV[2]) == 1) then
    redis.call('hincrby', KEYS[1], ARGV[2], 1)
    redis.call('pexpire', KEYS[1], ARGV[1])
    if registry then
        deregister(KEYS[2], KEYS[3], ARGV[3])
    end
    return nil
end
if registry then
    register(KEYS[2], KEYS[3], ARGV[3], ARGV[4])
end
return redis.call('pttl', KEYS[1])
