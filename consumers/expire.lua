-- Remove a dead worker's pages once its lease has run out (checked again here, atomically,
-- so a heartbeat that arrived meanwhile wins). Keeps the bookkeeping, marked stale, for a day.
-- KEYS: 1 state hash, 2 pages hash, 3 leases zset
-- ARGV: 1 worker, 2 now (unix ms)
local state, pages, leases = KEYS[1], KEYS[2], KEYS[3]
local worker, now = ARGV[1], tonumber(ARGV[2])
local expiry = redis.call('ZSCORE', leases, worker)
if not expiry or tonumber(expiry) > now then return -1 end
local removed = redis.call('HLEN', pages)
redis.call('UNLINK', pages)
redis.call('ZREM', leases, worker)
redis.call('HSET', state, 'stale', 1, 'stale_reason', 'lease_expired', 'stale_since_ms', now)
redis.call('EXPIRE', state, 86400)
return removed
