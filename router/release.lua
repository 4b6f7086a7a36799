-- Release a booking: at first token its prefill pages, at completion everything it holds. An
-- empty request id sweeps expired bookings instead (housekeeping; a release does not sweep,
-- so that it stays a few commands whatever expired).
-- KEYS: 1 prefill load hash, 2 decode load hash, 3 bookings zset, 4 load version (the load
--       keys of bookings.lua), 5 the request's booking hash (none when sweeping)
-- The key base (ARGV 1) builds only what bookings.lua says it builds: expired bookings' hashes
-- and the predicted pages a booking names the worker of.
-- ARGV: 1 key base, 2 request id ("" to sweep), 3 stage ("first_token" | "complete"), 4 now,
--       5 sweep limit
-- Returns {found (1|0), worker, prefill pages released, decode pages released, the load
-- version after the release (0 when nothing was found)}.
local base, request_id, stage = ARGV[1], ARGV[2], ARGV[3]
if request_id == '' then
  sweep_expired(base, tonumber(ARGV[4]), tonumber(ARGV[5]))
  return {0, '', 0, 0, 0}
end
if stage == 'first_token' then
  local bk = KEYS[5]
  local held = redis.call('HMGET', bk, 'worker', 'prefill')
  if not held[1] then return {0, '', 0, 0, 0} end
  local prefill = tonumber(held[2]) or 0
  add_load(LOAD.prefill, held[1], -prefill)
  redis.call('HSET', bk, 'prefill', 0)
  return {1, held[1], prefill, 0, loads_changed()}
end
local held, version = drop_booking(base, KEYS[5], request_id)
if not held[1] then return {0, '', 0, 0, 0} end
return {1, held[1], tonumber(held[2]) or 0, tonumber(held[3]) or 0, version}
