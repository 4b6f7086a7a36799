-- Every live worker's tiered overlap with a request, and its booked load, in one call.
-- KEYS: 1 leases zset, 2 prefill load hash, 3 decode load hash, 4 stale-workers set,
--       5 page-size hash, 6 incarnation marker, 7 the change counter
-- Each live worker's pages set and predicted-pages hash are built from the key base (ARGV 1)
-- instead: which workers are live is learnt here, from the leases, in the same atomic step.
-- They carry the model's hash tag {m} like the keys given, so they are in the same slot, on
-- the same Redis Cluster node.
-- ARGV: 1 key base "kvt:{m}", 2 now (unix ms), 3 first chunk size,
--       4.. pairs: page size, page-key blob (16 hex digits per page, in request order)
-- Returns a flat list: first 1 if the model's state is being rebuilt (marker missing, not
-- ready, or rebuilding: nothing is walked, every overlap is 0), else 0; then the marker's id
-- ("" when missing: an in-memory index built under another id is not this state's); then the
-- change counter (an index that has applied the feed up to it holds this state's pages); then
-- 9 fields per live worker (lease expiry > now):
--   worker, status (0 candidate | 1 stale | 2 no pages given at its page size),
--   page size, device, host, disk, queued prefill pages, active decode pages, predicted
-- The walk is docs/DESIGN.md's: the device prefix, then on host while the page is on host, then
-- on disk. Members of a worker's pages set are tier digit .. page key, so one SMISMEMBER
-- can ask several tiers: a cold worker costs one call of three members.
-- Predicted pages (a worker's ':predicted' hash: page key -> bookings not yet complete that
-- will hold the page on its device) extend the device prefix: where a worker has any, its
-- first stage walks pages that are on device or predicted, counting each where it is found.
-- An empty page-key blob walks nothing: a router with an in-memory index (router/index_feed.py)
-- reads only who is live, stale, at which page size and how loaded, and walks in memory.
local base, first_chunk = ARGV[1], tonumber(ARGV[3])
local TAG = {'1', '2', '4'}  -- device, host, disk: the tier bits as pages-set tags

local pages_by_size = {}
for i = 4, #ARGV, 2 do
  local blob, pages = ARGV[i + 1], {}
  for j = 1, #blob / 16 do pages[j] = string.sub(blob, (j - 1) * 16 + 1, j * 16) end
  pages_by_size[ARGV[i]] = {pages = pages, tagged = {{}, {}, {}}}
end

-- A tier's column of tagged members, built once per request and tier, on first use.
local function column(req, tier)
  local col = req.tagged[tier]
  if #col == 0 then
    local tag, pages = TAG[tier], req.pages
    for j = 1, #pages do col[j] = tag .. pages[j] end
  end
  return col
end

-- From page `pos` on tier `phase`, only the tier being walked is asked, in chunks growing
-- 4x from where the previous call stopped.
local function walk_from(set, req, counts, pos, phase)
  local n = #req.pages
  local chunk = first_chunk
  while pos <= n do
    local last = math.min(pos + chunk - 1, n)
    local found = redis.call('SMISMEMBER', set, unpack(column(req, phase), pos, last))
    local hit = 0
    while hit < #found and found[hit + 1] == 1 do hit = hit + 1 end
    counts[phase] = counts[phase] + hit
    pos = pos + hit
    if hit < #found then
      phase = phase + 1  -- the walk goes on from this page on the next tier
      if phase > 3 then return counts end
      chunk = first_chunk
    else
      chunk = math.min(chunk * 4, 2048)  -- unpack() has a bounded stack
    end
  end
  return counts
end

-- First call: page 1 on every tier (a cold worker ends here), then walk_from.
local function walk(set, req)
  local counts = {0, 0, 0, 0}
  local first = redis.call('SMISMEMBER', set, column(req, 1)[1], column(req, 2)[1], column(req, 3)[1])
  local phase = 1
  while phase <= 3 and first[phase] == 0 do phase = phase + 1 end
  if phase > 3 then return counts end
  counts[phase] = 1
  return walk_from(set, req, counts, 2, phase)
end

-- With predictions: the prefix on device or predicted first (chunks of device membership
-- and predictions side by side), then host and disk from where it stops.
local function walk_predicted(set, predicted, req)
  local n = #req.pages
  local counts = {0, 0, 0, 0}
  local pos, chunk, device = 1, first_chunk, column(req, 1)
  while pos <= n do
    local last = math.min(pos + chunk - 1, n)
    local on_device = redis.call('SMISMEMBER', set, unpack(device, pos, last))
    local held = redis.call('HMGET', predicted, unpack(req.pages, pos, last))
    for j = 1, #on_device do
      if on_device[j] == 1 then
        counts[1] = counts[1] + 1
      elseif held[j] then
        counts[4] = counts[4] + 1
      else
        return walk_from(set, req, counts, pos, 2)
      end
      pos = pos + 1
    end
    chunk = math.min(chunk * 4, 2048)
  end
  return counts
end

local marker = redis.call('HMGET', KEYS[6], 'ready', 'rebuilding', 'id')
local rebuilding = marker[1] ~= '1' or marker[2] == '1'
local out = {rebuilding and 1 or 0, marker[3] or '', tonumber(redis.call('GET', KEYS[7]) or 0)}
local live = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. ARGV[2], '+inf')
if #live == 0 then return out end
local prefill = redis.call('HMGET', KEYS[2], unpack(live))
local decode = redis.call('HMGET', KEYS[3], unpack(live))
local stale = redis.call('SMISMEMBER', KEYS[4], unpack(live))
local sizes = redis.call('HMGET', KEYS[5], unpack(live))
for w = 1, #live do
  local worker = live[w]
  local page_size = sizes[w] or '0'
  local req = pages_by_size[page_size]
  local status, counts = 0, {0, 0, 0, 0}
  if stale[w] == 1 then
    status = 1
  elseif not req then
    status = 2
  elseif #req.pages > 0 and not rebuilding then
    local set, predicted = base .. ':w:' .. worker .. ':pages', base .. ':w:' .. worker .. ':predicted'
    if redis.call('EXISTS', predicted) == 1 then
      counts = walk_predicted(set, predicted, req)
    else
      counts = walk(set, req)
    end
  end
  local n = #out
  out[n + 1], out[n + 2], out[n + 3] = worker, status, tonumber(page_size)
  out[n + 4], out[n + 5], out[n + 6] = counts[1], counts[2], counts[3]
  out[n + 7], out[n + 8], out[n + 9] = tonumber(prefill[w]) or 0, tonumber(decode[w]) or 0, counts[4]
end
return out
