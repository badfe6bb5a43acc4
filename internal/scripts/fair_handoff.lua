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
-- ARGV[8]  "1": the caller granted the receiving owner already (an early grant,
--          engine/handoff.go), believing it heads the queue; it gets the lock
--          whether it does or not (see below)
-- ARGV[9]  the field of the caller's next queued waiter, or ""
-- ARGV[10] "1" when this call retries an early one that may have run (its reply was
--          lost): the releasing owner's field gone and the receiving owner's there
--          then mean it did, so the reply is 2 (the receiving owner makes no other
--          call meanwhile); else "0" or absent
-- ARGV[11] optional: r, how many relayed fields follow ("0" or absent: none)
-- ARGV[12 .. 11+r]  relayed fields: owners the caller let hold the lock under the
--          releasing owner's field while this call's turn came (engine/relay.go).
--          They have had their turn: they leave the queue first, whatever the
--          outcome.
-- ARGV[12+r ..]     the fields of the caller's queued waiters after ARGV[9], in
--          its queue order (the run)
-- Reply: nil when the releasing owner does not hold the lock; 0 when it still holds
--        it; 1 when the lock was released and passed on to the head (another owner);
--        2 + n when the lock passed to the receiving owner and the queue now starts
--        with the first n fields of ARGV[9], ARGV[12+r], ARGV[13+r], ... (so 3: its
--        new head is ARGV[9]).
--
-- The caller believes the receiver heads the queue when the reply that made it
-- the head said so (2 + n, n >= 1): nothing can join ahead of a head, so only a purge can
-- make that wrong, by a stale deadline (a clock far ahead of the others', or a
-- waiter gone quiet for the whole wait allowance). Then the receiver jumps the
-- queue, once: FIFO already rests on synced clocks, while two holders at once
-- must never happen whatever the clocks say.
local now = tonumber(ARGV[6])
local wait = tonumber(ARGV[5])
local relayed = tonumber(ARGV[11] or '0')
for i = 12, 11 + relayed do
    redis.call('lrem', KEYS[2], 0, ARGV[i])
    redis.call('zrem', KEYS[3], ARGV[i])
    redis.call('hdel', KEYS[5], ARGV[i])
end
local head = purge_stale(KEYS[2], KEYS[3], KEYS[5], now)

local count = redis.call('hget', KEYS[1], ARGV[1])
if not count then
    if ARGV[10] == '1' and redis.call('hexists', KEYS[1], ARGV[3]) == 1 then
        return 2
    end
    return nil
end
if count ~= '1' and redis.call('hincrby', KEYS[1], ARGV[1], -1) > 0 then
    redis.call('pexpire', KEYS[1], ARGV[2])
    return 0
end
redis.call('del', KEYS[1])
if head == ARGV[3] or ARGV[8] == '1' then
    local new_head
    if head == ARGV[3] then
        new_head = pop_head(KEYS[2], KEYS[3], KEYS[5], ARGV[3], now, wait)
    else
        redis.call('lrem', KEYS[2], 0, ARGV[3])
        redis.call('zrem', KEYS[3], ARGV[3])
        redis.call('hdel', KEYS[5], ARGV[3])
        new_head = redis.call('lindex', KEYS[2], 0)
    end
    redis.call('hset', KEYS[1], ARGV[3], 1)
    redis.call('pexpire', KEYS[1], ARGV[4])
    if ARGV[9] == nil or ARGV[9] == '' or new_head ~= ARGV[9] then
        return 2
    end
    local first = 12 + relayed
    if ARGV[first] == nil then
        return 3
    end
    local front = redis.call('lrange', KEYS[2], 1, #ARGV - first + 1)
    local n = 1
    while front[n] ~= nil and front[n] == ARGV[first + n - 1] do
        n = n + 1
    end
    return 2 + n
end
pass_on(head, KEYS[1], KEYS[2], KEYS[3], KEYS[5], KEYS[4], now, wait, ARGV[7])
return 1
