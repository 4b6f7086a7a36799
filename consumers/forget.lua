-- Forget a worker gone longer than the retention: every key and member it left behind.
-- Checked again here, atomically: a worker that announced meanwhile (it has a lease) stays.
-- KEYS: 1 state hash, 2 leases zset, 3 workers set, 4 stale set, 5 partial set, 6 page-size hash,
--       7 hash-check hash, 8 meta key, 9 pages set, 10 predicted hash, 11 the model's change
--       feed stream, 12 its change counter (changes.lua)
-- ARGV: 1 worker, 2 forget if gone before this (unix ms), 3 the change feed's length
-- Returns 1 if forgotten, 0 if not (live again, or not gone long enough).
local worker, before = ARGV[1], tonumber(ARGV[2])
if redis.call('ZSCORE', KEYS[2], worker) then return 0 end
local since = redis.call('HMGET', KEYS[1], 'stale_since_ms', 'applied_ms')
-- No time at all (a worker just listed by a rebuild or a first batch, its announce not applied
-- yet) says nothing about when it went: it stays.
local gone = tonumber(since[1]) or tonumber(since[2])
if not gone or gone >= before then return 0 end
redis.call('UNLINK', KEYS[1], KEYS[8], KEYS[9], KEYS[10])
record_change(KEYS[11], KEYS[12], ARGV[3], worker, 'C')
redis.call('SREM', KEYS[3], worker)
redis.call('SREM', KEYS[4], worker)
redis.call('SREM', KEYS[5], worker)
redis.call('HDEL', KEYS[6], worker)
redis.call('HDEL', KEYS[7], worker)
return 1
