-- Remove a dead worker's pages once its lease has run out (checked again here, atomically,
-- so a heartbeat that arrived meanwhile wins). Keeps the bookkeeping, marked stale, for a day.
-- KEYS: 1 state hash, 2 pages hash, 3 leases zset
-- ARGV: 1 block key prefix, 2 worker, 3 now (unix ms)
local state, pages, leases = KEYS[1], KEYS[2], KEYS[3]
local bprefix, worker, now = ARGV[1], ARGV[2], tonumber(ARGV[3])
local expiry = redis.call('ZSCORE', leases, worker)
if not expiry or tonumber(expiry) > now then return 0 end
local all = redis.call('HKEYS', pages)
for i = 1, #all do redis.call('HDEL', bprefix .. all[i], worker) end
redis.call('DEL', pages)
redis.call('ZREM', leases, worker)
redis.call('HSET', state, 'stale', 1, 'stale_reason', 'lease_expired', 'stale_since_ms', now)
redis.call('EXPIRE', state, 86400)
return #all
