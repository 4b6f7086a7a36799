-- Release a booking: at first token its prefill pages, at completion everything it holds. An
-- empty request id sweeps expired bookings instead (housekeeping; a release does not sweep,
-- so that it stays a few commands whatever expired).
-- At first token a booking that carries the work its decision predicted teaches its worker's
-- fit (learn_rates.lua, prepended) how long that work took: the client's measured time when
-- it gives one, else the time since the booking. The fit is written in this call, beside the
-- load and its version, so a replica's copy of loads and rates at one version is exact.
-- KEYS: 1 prefill load hash, 2 decode load hash, 3 bookings zset, 4 load version (the load
--       keys of bookings.lua), 5 the request's booking hash (none when sweeping), 6 the
--       model's rates hash
-- The key base (ARGV 1) builds only what bookings.lua says it builds: expired bookings' hashes
-- and the predicted pages a booking names the worker of.
-- ARGV: 1 key base, 2 request id ("" to sweep), 3 stage ("first_token" | "complete"), 4 now,
--       5 sweep limit, 6 the first token's ms as the client measured it ("": since the
--       booking), 7-18 the fit's prior and settings (learn_rate's `a`)
-- Returns {found (1|0), worker, prefill pages released, decode pages released, the load
-- version after the release (0 when nothing was found), the worker's fit after a first
-- token that taught it ("" otherwise)}.
local base, request_id, stage = ARGV[1], ARGV[2], ARGV[3]
if request_id == '' then
  sweep_expired(base, tonumber(ARGV[4]), tonumber(ARGV[5]))
  return {0, '', 0, 0, 0, ''}
end
if stage == 'first_token' then
  local bk = KEYS[5]
  local held = redis.call('HMGET', bk, 'worker', 'prefill', 'work', 'at')
  if not held[1] then return {0, '', 0, 0, 0, ''} end
  local prefill = tonumber(held[2]) or 0
  add_load(LOAD.prefill, held[1], -prefill)
  redis.call('HSET', bk, 'prefill', 0)
  local fit = ''
  if held[3] then  -- taught once: a second first-token release of the booking learns nothing
    redis.call('HDEL', bk, 'work')
    local work = {}
    for part in string.gmatch(held[3], '%S+') do work[#work + 1] = tonumber(part) end
    local ttft
    if ARGV[6] ~= '' then ttft = tonumber(ARGV[6]) / 1000 else ttft = (tonumber(ARGV[4]) - tonumber(held[4])) / 1000 end
    fit = learn_rate(KEYS[6], held[1], work, ttft, {unpack(ARGV, 7, 18)})
  end
  return {1, held[1], prefill, 0, loads_changed(), fit}
end
local held, version = drop_booking(base, KEYS[5], request_id)
if not held[1] then return {0, '', 0, 0, 0, ''} end
return {1, held[1], tonumber(held[2]) or 0, tonumber(held[3]) or 0, version, ''}
