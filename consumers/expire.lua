-- Remove a dead worker's pages once its lease has run out (checked again here, atomically,
-- so a heartbeat that arrived meanwhile wins). Keeps the bookkeeping, marked stale, for a day.
-- KEYS: 1 state hash, 2 leases zset, 3..6 the worker's tier sets
-- ARGV: 1 worker, 2 now (unix ms)
-- Returns the number of (page, tier) entries removed, or -1 if the lease is still live.
local state, leases = KEYS[1], KEYS[2]
local worker, now = ARGV[1], tonumber(ARGV[2])
local expiry = redis.call('ZSCORE', leases, worker)
if not expiry or tonumber(expiry) > now then return -1 end
local removed = 0
for k = 3, 6 do removed = removed + redis.call('SCARD', KEYS[k]) end
redis.call('UNLINK', KEYS[3], KEYS[4], KEYS[5], KEYS[6])
redis.call('ZREM', leases, worker)
redis.call('HSET', state, 'stale', 1, 'stale_reason', 'lease_expired', 'stale_since_ms', now)
redis.call('EXPIRE', state, 86400)
return removed
