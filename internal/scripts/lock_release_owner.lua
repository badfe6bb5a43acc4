-- lock_release_owner.lua: drop every hold of one owner at once (used when a hold is
-- abandoned: a grant nobody received, a lost hold, Client.Close).
-- KEYS[1]  the lock hash
-- KEYS[2]  the unlock channel
-- ARGV[1]  unlock message ("0")
-- ARGV[2]  owner field
-- ARGV[3]  how many holds to drop; "0" drops all of them
-- Reply: 1 when the key was deleted and the message published, 0 when the owner still
--        holds (fewer holds dropped than it had), -1 when the owner held nothing.
if redis.call('hexists', KEYS[1], ARGV[2]) == 0 then
    return -1
end
local drop = tonumber(ARGV[3])
if drop > 0 then
    local left = redis.call('hincrby', KEYS[1], ARGV[2], -drop)
    if left > 0 then
        return 0
    end
end
redis.call('hdel', KEYS[1], ARGV[2])
if redis.call('hlen', KEYS[1]) == 0 then
    redis.call('del', KEYS[1])
    redis.call('publish', KEYS[2], ARGV[1])
    return 1
end
return 0
