-- fair_force_release.lua: delete a fair lock whoever holds it and wake the head.
-- KEYS[1]  the lock hash
-- KEYS[2]  the queue list
-- KEYS[3]  the deadline sorted set
-- KEYS[4]  the unlock channel prefix
-- ARGV[1]  unlock message ("0")
-- ARGV[2]  now, milliseconds since the epoch
-- Reply: 1 when the lock existed and was deleted, 0 otherwise.
local now = tonumber(ARGV[2])
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
local existed = redis.call('del', KEYS[1])
local head = redis.call('lindex', KEYS[2], 0)
if head ~= false then
    redis.call('publish', KEYS[4] .. ':' .. head, ARGV[1])
end
return existed
