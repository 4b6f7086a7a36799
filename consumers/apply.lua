-- Apply one kvtier EventBatch to a worker's tier state, atomically, in seq order.
-- KEYS: 1 state hash, 2 workers set, 3 the worker's pages set, 4 the model's stale-workers set,
--       5 the model's incarnation marker (refused, status 4, unless its 'ready' is '1')
-- ARGV: 1 source seq (the engine seq of the batch's last engine batch; -1 unknown), 2 worker, 3 epoch, 4 seq, 5 mode ("next"|"rebase"),
--       6 epoch reason ("" when none), 7 now (unix ms), 8 source ts (unix s),
--       9.. ops as triples: kind ("S" store | "R" remove | "C" clear), tier bit, page-key blob
--       (16 hex digits per page, concatenated).
-- Returns {status, epoch, seq, transitions, stale}; status 0 applied, 1 duplicate (seq
-- already applied), 2 ahead (a gap: earlier seq missing), 3 old epoch (superseded),
-- 4 not ready (the marker is missing: the state store lost this model's state, or a
-- processor is still preparing its rebuild; nothing is read or written).
-- A store is one SADD and a remove one SREM per op (members: tier bit digit .. page key):
-- nothing is read first. The state hash keeps a page count per tier ('n' .. tier bit).
local state, workers, pages_key, stale_set = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local worker = ARGV[2]
local epoch, seq, mode = tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local reason, now = ARGV[6], ARGV[7]
local CHUNK = 1000

if redis.call('HGET', KEYS[5], 'ready') ~= '1' then return {4, 0, 0, 0, 0} end

local function clear_worker()
  redis.call('UNLINK', pages_key)
  redis.call('HDEL', state, 'n1', 'n2', 'n4', 'n8')
end

-- 'epoch_floor': set by a rebuild after the state store lost the worker: batches of older
-- epochs (still in the stream) are skipped, and the floor epoch's batch 1 begins it afresh.
local cur = redis.call('HMGET', state, 'epoch', 'seq', 'stale', 'epoch_floor')
local cur_epoch, cur_seq = tonumber(cur[1]) or 0, tonumber(cur[2]) or 0
local stale = tonumber(cur[3]) or 0

if mode == 'rebase' then
  -- The processor gave up waiting for missing batches: start over from a clean state and
  -- say so (stale) until the bridge begins a new epoch.
  clear_worker()
  stale = 1
  redis.call('HSET', state, 'stale', 1, 'stale_reason', reason, 'stale_since_ms', now)
  redis.call('SADD', stale_set, worker)
  redis.call('HINCRBY', state, 'gaps', 1)
else
  if epoch < cur_epoch or epoch < (tonumber(cur[4]) or 0) then return {3, cur_epoch, cur_seq, 0, stale} end
  if epoch == cur_epoch then
    if seq <= cur_seq then return {1, cur_epoch, cur_seq, 0, stale} end
    if seq > cur_seq + 1 then return {2, cur_epoch, cur_seq, 0, stale} end
  else
    if seq ~= 1 then return {2, cur_epoch, cur_seq, 0, stale} end
    clear_worker()
    stale = 0
    redis.call('HSET', state, 'stale', 0, 'stale_reason', '', 'last_epoch_reason', reason)
    if cur[4] then redis.call('HDEL', state, 'epoch_floor') end
    redis.call('SREM', stale_set, worker)
    redis.call('HINCRBY', state, 'epochs', 1)
  end
end

local transitions = 0
local stored_bits = 0  -- OR of the tiers stored in this batch, for 'tiers_seen'
local count_delta = {}  -- tier bit -> change in its page count, written once per batch
local i = 9
while i <= #ARGV do
  local kind, tbit, blob = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  i = i + 3
  if kind == 'C' then
    clear_worker()
    count_delta = {}  -- what came before the clear is gone with it
  else
    local command = kind == 'S' and 'SADD' or 'SREM'
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
redis.call('HSET', state, 'epoch', epoch, 'seq', seq, 'applied_ms', now, 'source_ts', ARGV[8], 'source_seq', ARGV[1])
redis.call('PERSIST', state)
redis.call('SADD', workers, worker)
return {0, epoch, seq, transitions, stale}
