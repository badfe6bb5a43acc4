-- lock_lib.lua: direct grants for the reentrant lock. scripts.go puts this text in
-- front of lock_acquire.lua, lock_release.lua and lock_handoff.lua.
--
-- A leash client whose head waiter was refused registers it: the hash
-- leash_lock_reg:{name} maps the client id to "<lease ms>|<stamp>|<waiter id>|<field>"
-- and the list leash_lock_regq:{name} holds the client ids in registration order.
-- <field> is a hash field made for that waiter alone ("<client-id>:<number>"), so a
-- grant to it can never be confused with a hold of any handle. A release that frees
-- the lock grants it to the oldest live registration of another client, and
-- publishes "<waiter id>|<stamp>|<lock name>" on that client's grant channel,
-- leash_lock_grant:<client-id>; the waiter needs no call of its own.
--
-- A registration is live while its client listens on its grant channel (a client
-- that died has closed its connection). A grant goes out only when every other
-- listener on the unlock channel is a registered leash client: a Redisson client
-- (or a leash client that did not register) waiting on the channel gets the unlock
-- message instead, and competes as Redisson expects, so it is never starved.
-- Registrations expire after reg_ttl without a new one; a waiter that finds its own
-- gone is then woken by the unlock message like everyone else.

local reg_ttl = 300000

local function register(regs, order, cid, value)
    if redis.call('hset', regs, cid, value) == 1 then
        redis.call('rpush', order, cid)
    end
    redis.call('pexpire', regs, reg_ttl)
    redis.call('pexpire', order, reg_ttl)
end

local function deregister(regs, order, cid)
    if redis.call('hdel', regs, cid) == 1 then
        redis.call('lrem', order, 0, cid)
    end
end

-- deregister_waiter drops cid's registration if it names waiter id.
local function deregister_waiter(regs, order, cid, id)
    local value = redis.call('hget', regs, cid)
    if value and string.match(value, '^%d+|%d+|(%d+)|') == id then
        deregister(regs, order, cid)
    end
end

local function grant_channel(cid)
    return 'leash_lock_grant:' .. cid
end

-- grant_next runs when lock has just been deleted. It grants the lock to the oldest
-- live registration of a client other than self, when every listener on channel
-- but self (self_sub: 1 when self listens) is a live registered client, and
-- reports whether it did. Dead or malformed registrations are dropped on the way.
local function grant_next(lock, channel, regs, order, self, self_sub)
    local cids = redis.call('lrange', order, 0, -1)
    if #cids == 0 then
        return false
    end
    local live, first, lease, stamp, id, field = 0, nil, nil, nil, nil, nil
    for _, cid in ipairs(cids) do
        local value = redis.call('hget', regs, cid)
        local l, s, i, f
        if value then
            l, s, i, f = string.match(value, '^(%d+)|(%d+)|(%d+)|(.+)$')
        end
        if l == nil or redis.call('pubsub', 'numsub', grant_channel(cid))[2] == 0 then
            redis.call('hdel', regs, cid)
            redis.call('lrem', order, 0, cid)
        elseif cid ~= self then
            live = live + 1
            if first == nil then
                first, lease, stamp, id, field = cid, l, s, i, f
            end
        end
    end
    if first == nil then
        return false
    end
    if redis.call('pubsub', 'numsub', channel)[2] - self_sub > live then
        return false
    end
    deregister(regs, order, first)
    redis.call('hset', lock, field, 1)
    redis.call('pexpire', lock, lease)
    redis.call('publish', grant_channel(first), id .. '|' .. stamp .. '|' .. lock)
    return true
end

