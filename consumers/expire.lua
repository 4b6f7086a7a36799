-- Remove a dead worker's pages once its lease has run out (checked again here, atomically,
-- so a heartbeat that arrived meanwhile wins). Keeps the bookkeeping, marked stale, for a day.
-- KEYS: 1 state hash, 2 leases zset, 3 the worker's pages set, 4 the model's stale-workers set,
--       5 the worker's predicted pages (its bookings' releases find nothing left to give back),
--       6 the model's change feed stream, 7 its change counter (changes.lua)
-- ARGV: 1 worker, 2 now (unix ms), 3 the lease expiry the decision was taken on (unix ms; ""
--       for any): a lease renewed since is left alone, 4 the change feed's length
-- Returns the number of (page, tier) entries removed, or -1 if the lease is still live.
local state, leases = KEYS[1], KEYS[2]
local worker, now = ARGV[1], tonumber(ARGV[2])
local expiry = redis.call('ZSCORE', leases, worker)
if not expiry or tonumber(expiry) > now then return -1 end
if ARGV[3] and ARGV[3] ~= '' and tonumber(expiry) ~= tonumber(ARGV[3]) then return -1 end
local removed = redis.call('SCARD', KEYS[3])
redis.call('UNLINK', KEYS[3], KEYS[5])
record_change(KEYS[6], KEYS[7], ARGV[4], worker, 'C')
redis.call('ZREM', leases, worker)
redis.call('HDEL', state, 'n1', 'n2', 'n4', 'n8')
redis.call('HSET', state, 'stale', 1, 'stale_reason', 'lease_expired', 'stale_since_ms', now)
redis.call('SADD', KEYS[4], worker)
redis.call('EXPIRE', state, 86400)
return removed
