-- Release a booking: at first token its prefill pages, at completion everything it holds.
-- KEYS: 1 prefill load hash, 2 decode load hash, 3 bookings zset
-- ARGV: 1 key base, 2 request id, 3 stage ("first_token" | "complete"), 4 now, 5 sweep limit
-- Returns {found (1|0), worker, prefill pages released, decode pages released}.
local base, request_id, stage = ARGV[1], ARGV[2], ARGV[3]
sweep_expired(base, tonumber(ARGV[4]), tonumber(ARGV[5]), KEYS[1], KEYS[2])
if request_id == '' then return {0, '', 0, 0} end
local bk = base .. ':bk:' .. request_id
local held = redis.call('HMGET', bk, 'worker', 'prefill', 'decode')
if not held[1] then return {0, '', 0, 0} end
local prefill, decode = tonumber(held[2]) or 0, tonumber(held[3]) or 0
if stage == 'first_token' then
  add_load(KEYS[1], held[1], -prefill)
  redis.call('HSET', bk, 'prefill', 0)
  return {1, held[1], prefill, 0}
end
drop_booking(base, request_id, KEYS[1], KEYS[2])
return {1, held[1], prefill, decode}
