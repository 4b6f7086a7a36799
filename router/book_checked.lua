-- Book a worker a replica chose on its own copy of the model's state, only if that copy is
-- still the state Redis holds: the compare-and-set that makes selection and booking one
-- atomic step without handing the script every candidate (select_and_book.lua, which this
-- replaces on the hot path, pays for every value crossing into the script). O(1) whatever
-- the number of workers. The choice itself is router/scoring.py's, on the replica's copy of
-- the loads at a load version: equal versions mean equal loads (bookings.lua bumps the version
-- with every load write), so the choice is the one select_and_book.lua would have made.
-- KEYS: 1 prefill load hash, 2 decode load hash, 3 bookings zset, 4 load version (the load
--       keys of bookings.lua), 5 leases zset, 6 stale workers set, 7 incarnation marker hash,
--       8 change counter, 9 the session's key (the model's key base when the request has no
--       session), 10 the request's booking hash, 11 the model's rates hash; every key this
--       script touches
-- Nothing expired is swept here (housekeeping sweeps): a booking costs a dozen commands.
-- ARGV: 1 now (unix ms), 2 booking ttl (ms), 3 request id, 4 worker, 5 prefill pages to
--       book, 6 decode pages to book, 7 the load version the choice was made at, 8 the change
--       number the replica's index had applied when it gave the overlaps ("": do not check;
--       the decision already waited for the index to apply what a try found), 9 the leases
--       zset's size and 10 the stale set's size when the replica read them, 11 the marker id
--       it read, 12 book (1|0), 13 session ttl (ms; 0: no session), 14 1 when the choice
--       leaves the session's worker on purpose (it is not a candidate), else 0, 15 the work
--       the decision predicts its first token waits for ("compute host-load L3-load queued" tokens,
--       kept in the booking for release.lua to learn from; "": none), 16 1 when the loads'
--       answer carries the rates too (a replica that prices by them), else 0, 17 the digest
--       of the booking's owner secret, which a client's release must give (release.lua; "":
--       none)
-- Returns one of
--   {1, load version after booking, the session's worker as found ("" when none, or left)}
--                                         booked (or, with book 0, the copy is current)
--   {-1, worker}                          the request id already holds a booking (on worker)
--   {-2, change counter}                  the roster is not what Redis holds: read it again
--   {-5, change counter}                  the feed is past the index: decide once it has applied it
--   {-3, load version, {prefill hash}, {decode hash}, {rates hash}}  the loads moved: here they
--                                         are (the rates, written with the loads, with ARGV 16), choose again
--   {-4, worker}                          the session keeps another worker: choose it
local now, ttl, request_id, worker = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], ARGV[4]
local book = ARGV[12] == '1'
local bk = KEYS[10]
if book and redis.call('EXISTS', bk) == 1 then
  return {-1, redis.call('HGET', bk, 'worker')}
end

local change = tonumber(redis.call('GET', KEYS[8]) or '0')
if ARGV[8] ~= '' and change > tonumber(ARGV[8]) then return {-5, change} end
if redis.call('ZCARD', KEYS[5]) ~= tonumber(ARGV[9]) or redis.call('SCARD', KEYS[6]) ~= tonumber(ARGV[10]) then
  return {-2, change}
end
local marker = redis.call('HMGET', KEYS[7], 'ready', 'rebuilding', 'id')
local expiry = tonumber(redis.call('ZSCORE', KEYS[5], worker) or '0')
if marker[1] ~= '1' or marker[2] == '1' or (marker[3] or '') ~= ARGV[11] or expiry <= now then
  return {-2, change}
end

local session_ttl = tonumber(ARGV[13])
local kept = ''
if session_ttl > 0 and ARGV[14] ~= '1' then
  kept = redis.call('GET', KEYS[9]) or ''
  if kept ~= '' and kept ~= worker then return {-4, kept} end
end

local version = redis.call('GET', LOAD.version) or '0'
if version ~= ARGV[7] then
  local rates = {}
  if ARGV[16] == '1' then rates = redis.call('HGETALL', KEYS[11]) end
  return {-3, version, redis.call('HGETALL', LOAD.prefill), redis.call('HGETALL', LOAD.decode), rates}
end
if not book then return {1, tonumber(version), kept} end

local prefill_pages, decode_pages = tonumber(ARGV[5]), tonumber(ARGV[6])
add_load(LOAD.prefill, worker, prefill_pages)
add_load(LOAD.decode, worker, decode_pages)
version = loads_changed()
redis.call('HSET', bk, 'worker', worker, 'prefill', prefill_pages, 'decode', decode_pages)
if ARGV[15] ~= '' then redis.call('HSET', bk, 'work', ARGV[15], 'at', now) end
if (ARGV[17] or '') ~= '' then redis.call('HSET', bk, 'owner', ARGV[17]) end
-- The hash outlives its zset entry a little, so a sweep can still read what to give back.
redis.call('PEXPIRE', bk, ttl + math.min(ttl, 60000))
redis.call('ZADD', LOAD.bookings, now + ttl, request_id)
if session_ttl > 0 then redis.call('SET', KEYS[9], worker, 'PX', session_ttl) end
return {1, version, kept}
