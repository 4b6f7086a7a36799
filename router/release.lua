-- Release a booking: at first token its prefill pages, at completion everything it holds. An
-- empty request id sweeps expired bookings instead (housekeeping; a release does not sweep,
-- so that it stays a few commands whatever expired).
-- KEYS: 1 prefill load hash, 2 decode load hash, 3 bookings zset
-- ARGV: 1 key base, 2 request id ("" to sweep), 3 stage ("first_token" | "complete"), 4 now,
--       5 sweep limit
-- Returns {found (1|0), worker, prefill pages released, decode pages released, the load
-- version after the release (0 when nothing was found)}.
local base, request_id, stage = ARGV[1], ARGV[2], ARGV[3]
if request_id == '' then
  sweep_expired(base, tonumber(ARGV[4]), tonumber(ARGV[5]), KEYS[1], KEYS[2])
  return {0, '', 0, 0, 0}
end
if stage == 'first_token' then
  local bk = base .. ':bk:' .. request_id
  local held = redis.call('HMGET', bk, 'worker', 'prefill')
  if not held[1] then return {0, '', 0, 0, 0} end
  local prefill = tonumber(held[2]) or 0
  add_load(KEYS[1], held[1], -prefill)
  redis.call('HSET', bk, 'prefill', 0)
  return {1, held[1], prefill, 0, loads_changed(base)}
end
local held, version = drop_booking(base, request_id, KEYS[1], KEYS[2])
if not held[1] then return {0, '', 0, 0, 0} end
return {1, held[1], tonumber(held[2]) or 0, tonumber(held[3]) or 0, version}
