-- Apply one kvtier EventBatch to a worker's tier state, atomically, in seq order.
-- KEYS: 1 state hash, 2 workers set, 3 the worker's pages set, 4 the model's stale-workers set,
--       5 the model's incarnation marker (refused, status 4, unless its 'ready' is '1'),
--       6 the model's partial-workers set, 7 the model's leases zset, 8 the model's change
--       feed stream, 9 its change counter (changes.lua)
-- ARGV: 1 source seq (the engine seq of the batch's last engine batch; -1 unknown), 2 worker,
--       3 epoch, 4 seq, 5 mode ("next"|"rebase"), 6 epoch reason ("" when none), 7 now (unix ms),
--       8 source ts (unix s), 9 "1" when the epoch begins at the engine's first batch (its whole
--       history is in the stream), 10 the change feed's length (entries kept), 11.. ops as triples: kind ("S" store | "R" remove | "C"
--       clear), tier bit, page-key blob (16 hex digits per page, concatenated).
-- Returns {status, epoch, seq, transitions, stale, rebased}; status 0 applied, 1 duplicate (seq
-- already applied), 2 ahead (a gap: earlier seq missing), 3 old epoch (superseded),
-- 4 not ready (the marker is missing: the state store lost this model's state, or a
-- processor is still preparing its rebuild; nothing is read or written), 5 gone (a batch of
-- the epoch of a worker whose lease expired and that has not announced since).
-- Every mode checks order here, atomically with the write: "rebase" (the processor gave up on
-- missing batches) clears the worker only if the batch is still ahead of it; a batch that has
-- become the next one meanwhile is applied as such, a superseded or duplicate one is refused.
-- A store is one SADD and a remove one SREM per op (members: tier bit digit .. page key):
-- nothing is read first. The state hash keeps a page count per tier ('n' .. tier bit).
-- Partial: an epoch that does not begin at the engine's first batch (a bridge restart it could
-- not prove, an unrecoverable gap, a resync) holds only what the engine's replay buffer still
-- had. The worker stays routed to, marked partial, until the engine has reported a flush or
-- removed as many device pages as it holds (a full turnover of its device cache).
-- The feed: every clear and op this call applied, in order, as one entry (changes.lua).
local state, workers, pages_key, stale_set, partial_set = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[6]
local worker = ARGV[2]
local epoch, seq, mode = tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local reason, now = ARGV[6], ARGV[7]
local CHUNK = 1000

if redis.call('HGET', KEYS[5], 'ready') ~= '1' then return {4, 0, 0, 0, 0, 0} end

local feed = {}  -- what this call changes, for the change feed

local function clear_worker()
  feed[#feed + 1] = 'C'
  redis.call('UNLINK', pages_key)
  redis.call('HDEL', state, 'n1', 'n2', 'n4', 'n8')
end

-- 'epoch_floor': set by a rebuild after the state store lost the worker: batches of older
-- epochs (still in the stream) are skipped, and the floor epoch's batch 1 begins it afresh.
local cur = redis.call('HMGET', state, 'epoch', 'seq', 'stale', 'epoch_floor', 'stale_reason', 'partial')
local cur_epoch, cur_seq = tonumber(cur[1]) or 0, tonumber(cur[2]) or 0
local stale = tonumber(cur[3]) or 0
local partial = cur[6] == '1'

-- A late batch of the epoch a dead worker had (it expired, and has not announced since) is not
-- applied: it would re-create state nothing frees. A new epoch is a worker that came back.
if cur[5] == 'lease_expired' and epoch <= cur_epoch and not redis.call('ZSCORE', KEYS[7], worker) then
  return {5, cur_epoch, cur_seq, 0, stale, 0}
end
if epoch < cur_epoch or epoch < (tonumber(cur[4]) or 0) then return {3, cur_epoch, cur_seq, 0, stale, 0} end
if epoch == cur_epoch and seq <= cur_seq then return {1, cur_epoch, cur_seq, 0, stale, 0} end
local in_order = (epoch == cur_epoch and seq == cur_seq + 1) or (epoch > cur_epoch and seq == 1)
local rebased = 0
if not in_order then
  if mode ~= 'rebase' then return {2, cur_epoch, cur_seq, 0, stale, 0} end
  -- Still ahead: start over from a clean state and say so (stale) until the bridge begins a
  -- new epoch.
  clear_worker()
  stale, rebased, partial = 1, 1, false
  redis.call('HSET', state, 'stale', 1, 'stale_reason', 'gap', 'stale_since_ms', now, 'partial', 0)
  redis.call('SADD', stale_set, worker)
  redis.call('SREM', partial_set, worker)
  redis.call('HINCRBY', state, 'gaps', 1)
elseif epoch ~= cur_epoch then
  clear_worker()
  stale = 0
  partial = ARGV[9] ~= '1'
  redis.call('HSET', state, 'stale', 0, 'stale_reason', '', 'last_epoch_reason', reason,
             'partial', partial and 1 or 0, 'partial_removed', 0, 'partial_need', 0)
  if cur[4] then redis.call('HDEL', state, 'epoch_floor') end
  redis.call('SREM', stale_set, worker)
  if partial then redis.call('SADD', partial_set, worker) else redis.call('SREM', partial_set, worker) end
  redis.call('HINCRBY', state, 'epochs', 1)
end

local transitions = 0
local stored_bits = 0  -- OR of the tiers stored in this batch, for 'tiers_seen'
local count_delta = {}  -- tier bit -> change in its page count, written once per batch
local flushed = false  -- the engine cleared its whole cache: nothing unreported is left
local device_removed = 0
local i = 11
while i <= #ARGV do
  local kind, tbit, blob = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  i = i + 3
  if kind == 'C' then
    clear_worker()
    count_delta = {}  -- what came before the clear is gone with it
    flushed = true
  else
    local command = kind == 'S' and 'SADD' or 'SREM'
    feed[#feed + 1] = kind .. tbit .. blob
    if kind == 'S' then stored_bits = bit.bor(stored_bits, tonumber(tbit)) end
    local n = #blob / 16
    transitions = transitions + n
    local changed = 0
    for s = 1, n, CHUNK do
      local e = math.min(s + CHUNK - 1, n)
      local members, count = {}, 0
      for j = s, e do count = count + 1; members[count] = tbit .. string.sub(blob, (j - 1) * 16 + 1, j * 16) end
      changed = changed + redis.call(command, pages_key, unpack(members))
    end
    if changed > 0 then
      count_delta[tbit] = (count_delta[tbit] or 0) + (kind == 'S' and changed or -changed)
    end
    if kind == 'R' and tbit == '1' then device_removed = device_removed + n end
  end
end

for tbit, delta in pairs(count_delta) do
  if delta ~= 0 then redis.call('HINCRBY', state, 'n' .. tbit, delta) end
end
if stored_bits ~= 0 then
  -- Every tier the worker ever stored on (kept across epochs): `kvtier doctor` tells from it
  -- whether an engine with HiCache on ever reported a host tier.
  local seen = tonumber(redis.call('HGET', state, 'tiers_seen') or 0)
  local both = bit.bor(seen, stored_bits)
  if both ~= seen then redis.call('HSET', state, 'tiers_seen', both) end
end
if partial then
  -- The turnover target is the most device pages the worker has held since the epoch began.
  local p = redis.call('HMGET', state, 'n1', 'partial_removed', 'partial_need')
  local removed = (tonumber(p[2]) or 0) + device_removed
  local need = math.max(tonumber(p[3]) or 0, tonumber(p[1]) or 0)
  if flushed or (need > 0 and removed >= need) then
    redis.call('HSET', state, 'partial', 0)
    redis.call('SREM', partial_set, worker)
  else
    redis.call('HSET', state, 'partial_removed', removed, 'partial_need', need)
  end
end
if #feed > 0 then record_change(KEYS[8], KEYS[9], ARGV[10], worker, table.concat(feed, ',')) end
redis.call('HSET', state, 'epoch', epoch, 'seq', seq, 'applied_ms', now, 'source_ts', ARGV[8], 'source_seq', ARGV[1])
redis.call('PERSIST', state)
redis.call('SADD', workers, worker)
return {0, epoch, seq, transitions, stale, rebased}
