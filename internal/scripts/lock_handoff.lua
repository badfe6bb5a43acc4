-- lock_handoff.lua: release by one owner and grant to the next local waiter in one
-- call, without a pub/sub hop. The lock is never free in between, so nothing is
-- published; the hash stays in Redisson's layout at every step.
--
-- Fairness to other processes: when the caller's chain of handoffs has reached its
-- bound (ARGV[5] = "1") and anyone besides the caller listens on the unlock channel
-- (waiters of other processes, Redisson clients), the lock is released to everyone
-- instead. When nobody else listens, nobody else waits for a wake-up, and the
-- handoff goes ahead. Below the bound, a caller that passes ARGV[12] = "1" learns
-- whether anyone else listened (reply 5): the engine then skips the check at
-- its next bound when nobody did (see engine/handoff.go).
-- KEYS[1]  the lock hash
-- KEYS[2]  the unlock channel
-- ARGV[1]  the releasing owner's field
-- ARGV[2]  the releasing owner's lease in milliseconds (re-applied if it still holds)
-- ARGV[3]  the receiving owner's field
-- ARGV[4]  the receiving owner's lease in milliseconds
-- ARGV[5]  "1" when the chain bound is reached, else "0"
-- ARGV[6]  unlock message ("0")
-- ARGV[7]  "1" when this call retries one that may have run (its reply was lost):
--          the releasing owner's field gone and the receiving owner's there then
--          mean it did, so the reply is 2 (the receiving owner makes no other call
--          meanwhile); else "0"
-- ARGV[8]  optional: the caller's client id
-- ARGV[9]  optional: "1" when the caller listens on the unlock channel (default "1")
-- ARGV[10] optional: the receiving waiter's registration (see lock_acquire.lua)
-- ARGV[11] optional: the receiving waiter's id: a registration of the caller's that
--          names it goes when the lock passes to it
-- ARGV[12] optional: "1" asks a handoff below the bound to tell whether anyone
--          besides the caller listens on the unlock channel (reply 5)
-- Reply: nil when the releasing owner does not hold the lock (nothing changed);
--        0 when it still holds it after the decrement (no handoff);
--        1 when the lock was released to everyone (deleted, message published);
--        2 when the lock passed to the receiving owner with a count of 1 (and,
--          at the bound or with ARGV[12] = "1", nobody else listened);
--        4 when it was granted to another client's registered waiter (and the
--          receiving waiter registered);
--        5 when it passed to the receiving owner below the bound, ARGV[12] was
--          "1", and somebody besides the caller listened.
if redis.call('hexists', KEYS[1], ARGV[1]) == 0 then
    if ARGV[7] == '1' and redis.call('hexists', KEYS[1], ARGV[3]) == 1 then
        return 2
    end
    return nil
end
local count = redis.call('hincrby', KEYS[1], ARGV[1], -1)
if count > 0 then
    redis.call('pexpire', KEYS[1], ARGV[2])
    return 0
end
redis.call('del', KEYS[1])
if ARGV[5] == '1' then
    local self_sub = tonumber(ARGV[9] or '1')
    if KEYS[3] ~= nil and ARGV[8] ~= nil and grant_next(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[8], self_sub) then
        if ARGV[10] ~= nil and ARGV[10] ~= '' then
            register(KEYS[3], KEYS[4], ARGV[8], ARGV[10])
        end
        return 4
    end
    if redis.call('pubsub', 'numsub', KEYS[2])[2] > self_sub then
        redis.call('publish', KEYS[2], ARGV[6])
        return 1
    end
end
redis.call('hset', KEYS[1], ARGV[3], 1)
redis.call('pexpire', KEYS[1], ARGV[4])
if KEYS[3] ~= nil and ARGV[11] ~= nil then
    deregister_waiter(KEYS[3], KEYS[4], ARGV[8], ARGV[11])
end
if ARGV[12] == '1' and ARGV[5] ~= '1' and
    redis.call('pubsub', 'numsub', KEYS[2])[2] > tonumber(ARGV[9] or '1') then
    return 5
end
return 2
