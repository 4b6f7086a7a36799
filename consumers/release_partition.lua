-- Give a partition lease up, only if this processor still holds it.
-- KEYS: 1 the partition's lease key
-- ARGV: 1 owner id
-- Returns 1 if deleted, 0 if the lease is gone or another processor's.
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
