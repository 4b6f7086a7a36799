-- Extend a partition lease, only if this processor still holds it.
-- KEYS: 1 the partition's lease key
-- ARGV: 1 owner id, 2 lease TTL (ms)
-- Returns 1 if renewed, 0 if the lease is gone or another processor's.
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
