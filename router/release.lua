-- Release a booking: at first token its prefill pages, at completion everything it holds. An
-- empty request id sweeps expired bookings instead (housekeeping; a release does not sweep,
-- so that it stays a few commands whatever expired).
-- At first token a booking that carries the work its decision predicted teaches its worker's
-- fit (learn_rates.lua, prepended) how long that work took: the client's measured time when
-- it gives one, else the time since the booking. The fit is written in this call, beside the
-- load and its version, so a replica's copy of loads and rates at one version is exact.
-- A client's release (ARGV 20 names it) proves it owns the booking (the digest of the owner
-- secret its /v1/route answer gave it) and teaches within router/rates.py ClientSamples: a
-- time longer than the booking has lived teaches nothing, nor do its samples past its
-- per-minute budget for the worker, and each moves the fit at most max_step.
-- KEYS: 1 prefill load hash, 2 decode load hash, 3 bookings zset, 4 load version (the load
--       keys of bookings.lua), 5 the request's booking hash (none when sweeping), 6 the
--       model's rates hash, 7 its prediction errors hash (track_error)
-- The key base (ARGV 1) builds only what bookings.lua says it builds (expired bookings'
-- hashes, the predicted pages a booking names the worker of), and a client's sample count
-- for the booking's worker (kvt:{m}:rs:<worker>:<client>), which only the booking names.
-- ARGV: 1 key base, 2 request id ("" to sweep), 3 stage ("first_token" | "complete"), 4 now,
--       5 sweep limit, 6 the first token's ms as the client measured it ("": since the
--       booking), 7-19 the fit's prior and settings (learn_rate's `a`), 20 the owner digest
--       the booking must hold ("": the router's own release, not checked), 21 the client
--       whose samples are bounded ("": a trusted one, unbounded), 22 its samples per worker
--       per minute, 23 its max step, 24 the late slack (ms), 25 the prediction error's memory
-- Returns {found (1|0, -1: the booking is another owner's), worker, prefill pages released,
-- decode pages released, the load version after the release (0 when nothing was found), the
-- worker's fit after a first token that taught it ("" otherwise), why a first token taught
-- nothing ("budget" | "late" | ""), the fit's predicted first token (ms) and its error as
-- a fraction of the true time (signed: > 0 predicted too long) for a first token that taught
-- ("" otherwise)}.
local base, request_id, stage = ARGV[1], ARGV[2], ARGV[3]
local NOTHING = {0, '', 0, 0, 0, '', '', '', ''}  -- no booking released
if request_id == '' then
  sweep_expired(base, tonumber(ARGV[4]), tonumber(ARGV[5]))
  return NOTHING
end
local owner, client = ARGV[20] or '', ARGV[21] or ''
if owner ~= '' and redis.call('HGET', KEYS[5], 'owner') ~= owner then
  if redis.call('EXISTS', KEYS[5]) == 1 then return {-1, '', 0, 0, 0, '', '', '', ''} end
  return NOTHING
end
if stage == 'first_token' then
  local bk = KEYS[5]
  local held = redis.call('HMGET', bk, 'worker', 'prefill', 'work', 'at')
  if not held[1] then return NOTHING end
  local prefill = tonumber(held[2]) or 0
  add_load(LOAD.prefill, held[1], -prefill)
  redis.call('HSET', bk, 'prefill', 0)
  local fit, refused, predicted_ms, off = '', '', '', ''
  if held[3] then  -- taught once: a second first-token release of the booking learns nothing
    redis.call('HDEL', bk, 'work')
    local work = {}
    for part in string.gmatch(held[3], '%S+') do work[#work + 1] = tonumber(part) end
    local lived = tonumber(ARGV[4]) - tonumber(held[4])
    local ttft
    if ARGV[6] ~= '' then ttft = tonumber(ARGV[6]) / 1000 else ttft = lived / 1000 end
    local max_step = 0
    if client ~= '' then
      if ARGV[6] ~= '' and tonumber(ARGV[6]) > lived + tonumber(ARGV[24]) then
        refused = 'late'
      else
        local counted = base .. ':rs:' .. held[1] .. ':' .. client
        local n = redis.call('INCR', counted)
        if n == 1 then redis.call('PEXPIRE', counted, 60000) end
        if n > tonumber(ARGV[22]) then refused = 'budget' end
      end
      max_step = tonumber(ARGV[23])
    end
    if refused == '' then
      local predicted, floored
      fit, predicted, floored = learn_rate(KEYS[6], held[1], work, ttft, {unpack(ARGV, 7, 19)}, max_step)
      if predicted then
        -- as text: a Lua number in a script's answer becomes an integer
        off = string.format('%.17g', track_error(KEYS[7], held[1], predicted, floored, tonumber(ARGV[25])))
        predicted_ms = string.format('%.17g', predicted * 1000)
      end
    end
  end
  return {1, held[1], prefill, 0, loads_changed(), fit, refused, predicted_ms, off}
end
local held, version = drop_booking(base, KEYS[5], request_id)
if not held[1] then return NOTHING end
return {1, held[1], tonumber(held[2]) or 0, tonumber(held[3]) or 0, version, '', '', '', ''}
