-- lock_release_owner.lua: drop holds of one owner at once (used when a hold is
-- abandoned: a grant nobody received, a lost hold, Client.Close). Serves both lock
-- kinds: with KEYS[3] (a fair lock's queue) the release wakes the queue's head on
-- its own channel, KEYS[2]:<head>; without it, it publishes on KEYS[2].
-- KEYS[1]  the lock hash
-- KEYS[2]  the unlock channel (reentrant lock) or channel prefix (fair lock)
-- KEYS[3]  optional: the fair lock's queue list
-- ARGV[1]  unlock message ("0")
-- ARGV[2]  owner field
-- ARGV[3]  how many holds to drop; "0" drops all of them
-- ARGV[4]  optional, with a count to drop: how many the caller expects the owner to
--          keep; no more is dropped than leaves that many (a retry of a release
--          that ran drops nothing), so a retry never takes holds the owner still has
-- Reply: 1 when the key was deleted and waiters woken; 0 when the key stays (the
--        owner still holds: fewer holds dropped than it had; or other fields
--        remain); -1 when the owner held nothing.
if redis.call('hexists', KEYS[1], ARGV[2]) == 0 then
    return -1
end
local drop = tonumber(ARGV[3])
local keep = tonumber(ARGV[4] or '0')
local held = tonumber(redis.call('hget', KEYS[1], ARGV[2]))
if drop > 0 and keep > 0 and held ~= nil then
    drop = math.min(drop, held - keep)
    if drop <= 0 then
        return 0
    end
end
if drop > 0 then
    local left = redis.call('hincrby', KEYS[1], ARGV[2], -drop)
    if left > 0 then
        return 0
    end
end
redis.call('hdel', KEYS[1], ARGV[2])
if redis.call('hlen', KEYS[1]) > 0 then
    return 0
end
redis.call('del', KEYS[1])
if KEYS[3] then
    local head = redis.call('lindex', KEYS[3], 0)
    if head ~= false then
        redis.call('publish', KEYS[2] .. ':' .. head, ARGV[1])
    end
else
    redis.call('publish', KEYS[2], ARGV[1])
end
return 1
