-- fair_lib.lua: functions shared by the fair-lock scripts. scripts.go puts this
-- text in front of every fair_*.lua script, so each script is self-contained on
-- the server (Redis scripts cannot call each other).
--
-- Direct grants: a leash waiter registers itself in the grants hash
-- (leash_lock_grants:{name}, field = owner, value = "<lease ms>:<grant name>") when
-- it queues; the grant name is "<waiter id>.<registration number>" (or, from older
-- clients, "<waiter id>"). When such a waiter heads the queue at a release, the
-- release gives it the lock in the same call and publishes "leash:grant:<grant
-- name>" on its channel, so the waiter needs no call of its own; the number lets
-- the waiter tell a grant made to its latest registration from an earlier one's. A head that did not register (a Redisson
-- client) is woken with the unlock message instead, exactly as Redisson does, and
-- takes the lock itself.

-- purge_stale drops queued owners at the head whose deadline passed without them
-- taking their turn, and returns the head left (false when the queue is empty).
-- Only heads are purged; a deadline missing from the set (a torn queue) counts as
-- stale rather than failing the script.
local function purge_stale(queue, timeout, grants, now)
    while true do
        local head = redis.call('lindex', queue, 0)
        if head == false then
            return false
        end
        local deadline = tonumber(redis.call('zscore', timeout, head))
        if deadline ~= nil and deadline > now then
            return head
        end
        redis.call('zrem', timeout, head)
        redis.call('lpop', queue)
        redis.call('hdel', grants, head)
    end
end

-- pop_head takes the head, owner, out of the queue; the one behind it heads the
-- queue now and gets one allowance to take its turn (see fair_acquire.lua). It
-- returns the new head (false when the queue is empty now).
local function pop_head(queue, timeout, grants, owner, now, wait)
    redis.call('lpop', queue)
    redis.call('zrem', timeout, owner)
    redis.call('hdel', grants, owner)
    local new_head = redis.call('lindex', queue, 0)
    if new_head ~= false then
        redis.call('zadd', timeout, 'LT', now + wait, new_head)
    end
    return new_head
end

-- pass_on runs when the lock has just become free: the head (what purge_stale
-- returned; false for an empty queue), if it registered for direct grants, gets
-- the lock now; any other head is woken with msg.
local function pass_on(head, lock, queue, timeout, grants, prefix, now, wait, msg)
    if head == false then
        return
    end
    local reg = redis.call('hget', grants, head)
    local lease, id
    if reg then
        lease, id = string.match(reg, '^(%d+):(%d+%.?%d*)$')
    end
    if lease == nil then
        redis.call('publish', prefix .. ':' .. head, msg)
        return
    end
    pop_head(queue, timeout, grants, head, now, wait)
    redis.call('hset', lock, head, 1)
    redis.call('pexpire', lock, lease)
    redis.call('publish', prefix .. ':' .. head, 'leash:grant:' .. id)
end

