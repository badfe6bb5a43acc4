-- fair_handoff.lua: release by one owner and, when the queue's head is the given
-- local waiter, grant to it in the same call; otherwise release as fair_release does
-- and wake the real head. FIFO across processes is kept either way.
-- KEYS[1]  the lock hash
-- KEYS[2]  the queue list
-- KEYS[3]  the deadline sorted set
-- KEYS[4]  the unlock channel prefix
-- ARGV[1]  the releasing owner's field
-- ARGV[2]  the releasing owner's lease in milliseconds
-- ARGV[3]  the receiving owner's field
-- ARGV[4]  the receiving owner's lease in milliseconds
-- ARGV[5]  wait allowance in milliseconds
-- ARGV[6]  now, milliseconds since the epoch
-- ARGV[7]  unlock message ("0")
-- Reply: nil when the releasing owner does not hold the lock; 0 when it still holds
--        it; 1 when the lock was released and the head (another owner) woken; 2 when
--        the lock passed to the receiving owner.
local now = tonumber(ARGV[6])
local wait = tonumber(ARGV[5])
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

if redis.call('hexists', KEYS[1], ARGV[1]) == 0 then
    return nil
end
local count = redis.call('hincrby', KEYS[1], ARGV[1], -1)
if count > 0 then
    redis.call('pexpire', KEYS[1], ARGV[2])
    return 0
end
redis.call('del', KEYS[1])
local head = redis.call('lindex', KEYS[2], 0)
if head == ARGV[3] then
    redis.call('lpop', KEYS[2])
    redis.call('zrem', KEYS[3], ARGV[3])
    -- the next one heads the queue now: it has one allowance to take its turn (see
    -- fair_acquire.lua)
    local next = redis.call('lindex', KEYS[2], 0)
    if next ~= false then
        redis.call('zadd', KEYS[3], 'LT', now + wait, next)
    end
    redis.call('hset', KEYS[1], ARGV[3], 1)
    redis.call('pexpire', KEYS[1], ARGV[4])
    return 2
end
if head ~= false then
    redis.call('publish', KEYS[4] .. ':' .. head, ARGV[7])
end
return 1
