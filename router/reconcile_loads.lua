-- Recompute every worker's booked load from the live bookings themselves, and write it back
-- if the counters drifted: the load is always recoverable, whatever happened to sweeps (a
-- booking whose hash expired before any router swept it could not give its load back).
-- KEYS: 1 prefill load hash, 2 decode load hash, 3 bookings zset, 4 load version (the load
--       keys of bookings.lua)
-- The live bookings' hashes are built from the key base (ARGV 1): only the bookings zset
-- names them, here; they carry the model's hash tag {m}, so they are in the given keys' slot.
-- ARGV: 1 key base, 2 now (unix ms), 3 sweep limit
-- Returns {live bookings, 1 if the counters were corrected else 0}.
local base, now = ARGV[1], tonumber(ARGV[2])
sweep_expired(base, now, tonumber(ARGV[3]))
local prefill, decode = {}, {}
local live = redis.call('ZRANGEBYSCORE', LOAD.bookings, '(' .. now, '+inf')
for _, request_id in ipairs(live) do
  local held = redis.call('HMGET', base .. ':bk:' .. request_id, 'worker', 'prefill', 'decode')
  if held[1] then
    prefill[held[1]] = (prefill[held[1]] or 0) + (tonumber(held[2]) or 0)
    decode[held[1]] = (decode[held[1]] or 0) + (tonumber(held[3]) or 0)
  else
    redis.call('ZREM', LOAD.bookings, request_id)  -- its hash is gone: nothing it held is known
  end
end
local corrected = 0
for _, hash in ipairs({{LOAD.prefill, prefill}, {LOAD.decode, decode}}) do
  local key, sums = hash[1], hash[2]
  local current = redis.call('HGETALL', key)
  local seen = {}
  for i = 1, #current, 2 do
    local worker, value = current[i], tonumber(current[i + 1])
    seen[worker] = true
    local want = sums[worker] or 0
    if value ~= want then
      corrected = 1
      if want > 0 then redis.call('HSET', key, worker, want) else redis.call('HDEL', key, worker) end
    end
  end
  for worker, want in pairs(sums) do
    if not seen[worker] and want > 0 then
      corrected = 1
      redis.call('HSET', key, worker, want)
    end
  end
end
if corrected == 1 then loads_changed() end
return {#live, corrected}
