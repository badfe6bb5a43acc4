-- lock_renew.lua: the watchdog's batched renewal (Redisson renews up to 100 locks a call).
-- KEYS[i]    lock hashes (all in one cluster slot when run on a cluster)
-- ARGV[1]    lease in milliseconds
-- ARGV[i+1]  the owner field for KEYS[i]
-- Reply: an array, element i = 1 when KEYS[i] is still held by its owner and was
--        extended, 0 when the owner no longer holds it (the hold is lost).
local result = {}
for i = 1, #KEYS do
    if redis.call('hexists', KEYS[i], ARGV[i + 1]) == 1 then
        redis.call('pexpire', KEYS[i], ARGV[1])
        result[i] = 1
    else
        result[i] = 0
    end
end
return result
