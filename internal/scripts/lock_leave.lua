-- lock_leave.lua: a registered waiter of the reentrant lock is gone (it gave up, or
-- a direct grant came for it that nobody can take): its registration goes, if it
-- still names it, and a direct grant to its field goes back. When that frees the
-- lock, the lock passes on as a release's would (lock_lib.lua).
-- KEYS[1]  the lock hash
-- KEYS[2]  the unlock channel
-- KEYS[3]  the registrations hash
-- KEYS[4]  the registration order list
-- ARGV[1]  the caller's client id
-- ARGV[2]  the gone waiter's id; "*": whatever waiter the caller's registration
--          names (the caller has no waiter left on the lock)
-- ARGV[3]  the gone waiter's grant field
-- ARGV[4]  unlock message ("0")
-- ARGV[5]  "1" when the caller listens on the unlock channel
-- ARGV[6]  a registration to write in the caller's name instead (its next waiter),
--          "" for none
-- Reply: 1 when a grant went back and freed the lock; 0 otherwise.
if ARGV[2] == '*' then
    deregister(KEYS[3], KEYS[4], ARGV[1])
else
    deregister_waiter(KEYS[3], KEYS[4], ARGV[1], ARGV[2])
end
if ARGV[6] ~= '' then
    register(KEYS[3], KEYS[4], ARGV[1], ARGV[6])
end
if redis.call('hexists', KEYS[1], ARGV[3]) == 0 then
    return 0
end
redis.call('hdel', KEYS[1], ARGV[3])
if redis.call('hlen', KEYS[1]) > 0 then
    return 0
end
redis.call('del', KEYS[1])
if not grant_next(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1], tonumber(ARGV[5])) then
    redis.call('publish', KEYS[2], ARGV[4])
end
return 1
