-- A model seen for the first time: create its incarnation marker ready, unless it has state or
-- a marker already (then it is not new, and a lost state is rebuilt instead).
-- KEYS: 1 the model's marker hash, 2 the model's workers set
-- ARGV: 1 now (unix ms), 2 a new marker id
-- Returns 1 if the marker was created, 0 otherwise.
if redis.call('EXISTS', KEYS[1]) == 1 or redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'id', ARGV[2], 'created_ms', ARGV[1], 'ready', '1', 'rebuilding', '0',
           'reason', 'new', 'ready_ms', ARGV[1])
return 1
