-- lock_release.lua: release one hold of a reentrant lock (Redisson RLock layout).
-- KEYS[1]  the lock hash
-- KEYS[2]  the unlock channel, redisson_lock__channel:{name}
-- KEYS[3]  optional: the registrations hash (see lock_lib.lua)
-- KEYS[4]  optional: the registration order list
-- ARGV[1]  unlock message ("0": wake one waiter)
-- ARGV[2]  lease in milliseconds, re-applied while the count stays above zero
-- ARGV[3]  owner field
-- ARGV[4]  optional: the caller's client id
-- ARGV[5]  optional: "1" when the caller listens on the unlock channel
-- ARGV[6]  optional: "1" when the caller may be registered and has no waiter left
--          (its registration goes, whatever the reply)
-- ARGV[7]  optional: the count the caller expects the owner to keep (its holds
--          less this one); when the count is that or less already, the release has
--          run (a retry whose first try's reply was lost), and the reply is 0 with
--          nothing decremented, so a retry never takes a re-entered lock's last
--          count. "0" or absent: no such floor.
-- Reply: nil when the owner does not hold the lock;
--        0 when the owner still holds it (count decremented);
--        1 when the lock was released (key deleted; granted to a registered waiter
--          of another client, or the unlock message published);
--        2 (with the leash arguments) when it was released and nobody listens,
--          so nothing was published (a waiter whose subscription is on its way
--          retries once it is made).
-- The count is read first (Redisson's unlock checks HEXISTS, then decrements): the
-- last hold's release, the common case, then needs no write but the DEL. Any other
-- value takes Redisson's path, HINCRBY and all (and its error on a non-integer).
-- The caller's registration goes first, whatever the count says: the caller has
-- no waiter left (a release that keeps a count, or finds the field gone, would
-- otherwise leave it with nothing to drop it later).
if KEYS[3] ~= nil and ARGV[4] ~= nil and ARGV[6] == '1' then
    deregister(KEYS[3], KEYS[4], ARGV[4])
end
local count = redis.call('hget', KEYS[1], ARGV[3])
if not count then
    return nil
end
local keep = tonumber(ARGV[7] or '0')
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
if KEYS[3] ~= nil and ARGV[4] ~= nil then
    -- A registered waiter listens on the channel (one whose subscription is still
    -- on its way retries once it is made), so with no listener at all there is
    -- nobody to grant to, and nobody to publish to either. (The caller's own
    -- subscription is not subtracted here: the caller may believe it listens
    -- while its connection is being replaced. PUBSUB NUMSUB does not count
    -- pattern subscribers: a listener on a pattern that matches the channel is
    -- not published to when nobody else listens, where Redisson would.)
    local listeners = redis.call('pubsub', 'numsub', KEYS[2])[2]
    if listeners == 0 then
        return 2
    end
    if listeners > tonumber(ARGV[5])
        and grant_next(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[4], tonumber(ARGV[5])) then
        return 1
    end
end
redis.call('publish', KEYS[2], ARGV[1])
return 1
