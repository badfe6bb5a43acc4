-- fair_handoff.lua: release by one owner and, when the queue's head is the given
-- local waiter, grant to it in the same call; otherwise release as fair_release does
-- and pass the lock on to the real head. FIFO across processes is kept either way.
-- KEYS[1]  the lock hash
-- KEYS[2]  the queue list
-- KEYS[3]  the deadline sorted set
-- KEYS[4]  the unlock channel prefix
-- KEYS[5]  the direct-grants hash
-- ARGV[1]  the releasing owner's field
-- ARGV[2]  the releasing owner's lease in milliseconds
-- ARGV[3]  the receiving owner's field
-- ARGV[4]  the receiving owner's lease in milliseconds
-- ARGV[5]  wait allowance in milliseconds
-- ARGV[6]  now, milliseconds since the epoch
-- ARGV[7]  unlock message ("0")
-- Reply: nil when the releasing owner does not hold the lock; 0 when it still holds
--        it; 1 when the lock was released and passed on to the head (another owner);
--        2 when the lock passed to the receiving owner.
local now = tonumber(ARGV[6])
local wait = tonumber(ARGV[5])
purge_stale(KEYS[2], KEYS[3], KEYS[5], now)

if redis.call('hexists', KEYS[1], ARGV[1]) == 0 then
    return nil
end
local count = redis.call('hincrby', KEYS[1], ARGV[1], -1)
if count > 0 then
    redis.call('pexpire', KEYS[1], ARGV[2])
    return 0
end
redis.call('del', KEYS[1])
if redis.call('lindex', KEYS[2], 0) == ARGV[3] then
    pop_head(KEYS[2], KEYS[3], KEYS[5], ARGV[3], now, wait)
    redis.call('hset', KEYS[1], ARGV[3], 1)
    redis.call('pexpire', KEYS[1], ARGV[4])
    return 2
end
pass_on(KEYS[1], KEYS[2], KEYS[3], KEYS[5], KEYS[4], now, wait, ARGV[7])
return 1
