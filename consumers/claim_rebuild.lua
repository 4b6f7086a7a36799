-- Claim the rebuild of a model whose incarnation marker is missing (or whose rebuild scan went
-- silent: its claimer died).
-- KEYS: 1 the model's marker hash
-- ARGV: 1 owner, 2 now (unix ms), 3 scan timeout (ms), 4 a new marker id
-- Returns {outcome, marker id}: 'created' | 'takeover' (this caller rebuilds) | 'held'.
local m = redis.call('HMGET', KEYS[1], 'id', 'ready', 'scan_ms')
if not m[1] then
  redis.call('HSET', KEYS[1], 'id', ARGV[4], 'created_ms', ARGV[2], 'ready', '0', 'rebuilding', '1',
             'scan_by', ARGV[1], 'scan_ms', ARGV[2])
  return {'created', ARGV[4]}
end
if m[2] ~= '1' and (tonumber(m[3]) or 0) + tonumber(ARGV[3]) < tonumber(ARGV[2]) then
  redis.call('HSET', KEYS[1], 'scan_by', ARGV[1], 'scan_ms', ARGV[2])
  return {'takeover', m[1]}
end
return {'held', m[1]}
