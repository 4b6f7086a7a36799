-- Record a worker's announce: its metadata and its lease, unless a later announce has been
-- recorded already. Delivery is at least once: an announce whose ack was lost (a broker
-- restart, a pull that broke) comes back long after its successors, and must neither move
-- the lease back (a live worker would be expired at once) nor put older metadata back.
-- KEYS: 1 meta, 2 leases zset, 3 the model's workers set, 4 page sizes hash, 5 state hash
-- ARGV: 1 worker, 2 lease expiry (unix ms: stream time + lease), 3 metadata JSON, 4 page size
-- Returns {recorded (1, or 0 for an older announce), stale flag}.
local worker, expiry = ARGV[1], tonumber(ARGV[2])
local current = redis.call('ZSCORE', KEYS[2], worker)
local recorded = 0
-- Expiries grow with stream time for a given lease length; equal means this very announce again.
if not current or tonumber(current) < expiry then
  redis.call('SET', KEYS[1], ARGV[3])
  redis.call('ZADD', KEYS[2], expiry, worker)
  redis.call('HSET', KEYS[4], worker, ARGV[4])
  recorded = 1
end
redis.call('SADD', KEYS[3], worker)
return {recorded, redis.call('HGET', KEYS[5], 'stale') or '0'}
