-- Drop a worker's pages (a rebuild that cannot restore them) and say so in the change feed.
-- KEYS: 1 the worker's pages set, 2 its state hash, 3 the model's change feed stream, 4 its
--       change counter
-- ARGV: 1 worker, 2 the change feed's length
redis.call('UNLINK', KEYS[1])
redis.call('HDEL', KEYS[2], 'n1', 'n2', 'n4', 'n8')
record_change(KEYS[3], KEYS[4], ARGV[2], ARGV[1], 'C')
return 1
