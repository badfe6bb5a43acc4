-- fair_force_release.lua: delete a fair lock whoever holds it and wake the head.
-- The head is woken even when it registered for direct grants: it takes the lock
-- with its own call, so no hold is ever granted that the force-release's caller
-- could mistake for one it deleted.
-- KEYS[1]  the lock hash
-- KEYS[2]  the queue list
-- KEYS[3]  the deadline sorted set
-- KEYS[4]  the unlock channel prefix
-- KEYS[5]  the direct-grants hash
-- ARGV[1]  unlock message ("0")
-- ARGV[2]  now, milliseconds since the epoch
-- Reply: 1 when the lock existed and was deleted, 0 otherwise.
local now = tonumber(ARGV[2])
local head = purge_stale(KEYS[2], KEYS[3], KEYS[5], now)
local existed = redis.call('del', KEYS[1])
if head ~= false then
    redis.call('publish', KEYS[4] .. ':' .. head, ARGV[1])
end
return existed
