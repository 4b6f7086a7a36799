-- Every live worker's tiered overlap with a request, and its booked load, in one call.
-- KEYS: 1 leases zset, 2 prefill load hash, 3 decode load hash (all in the model's slot;
--       per-worker keys are derived from ARGV[1], which carries the same hash tag)
-- ARGV: 1 key base "kvt:{m}", 2 now (unix ms), 3 first chunk size,
--       4.. pairs: page size, page-key blob (16 hex digits per page, in request order)
-- Returns a flat list, 8 fields per live worker (lease expiry > now):
--   worker, status (0 candidate | 1 stale | 2 no pages given at its page size),
--   page size, device, host, disk, queued prefill pages, active decode pages
-- The walk is DESIGN.md's: the device prefix, then on host while the page is on host, then
-- on disk. Membership is tested in growing chunks and stops at the first miss, so a cold
-- worker costs one small SMISMEMBER per tier.
local base, first_chunk = ARGV[1], tonumber(ARGV[3])

local pages_by_size = {}
for i = 4, #ARGV, 2 do
  local blob, pages = ARGV[i + 1], {}
  for j = 1, #blob / 16 do pages[j] = string.sub(blob, (j - 1) * 16 + 1, j * 16) end
  pages_by_size[ARGV[i]] = pages
end

-- Number of consecutive pages from position `from` that are members of `set`.
local function run_length(set, pages, from)
  local n, pos, chunk = #pages, from, first_chunk
  while pos <= n do
    local last = math.min(pos + chunk - 1, n)
    local found = redis.call('SMISMEMBER', set, unpack(pages, pos, last))
    for j = 1, #found do
      if found[j] == 0 then return pos + j - 1 - from end
    end
    pos = last + 1
    chunk = math.min(chunk * 4, 4096)  -- unpack() has a bounded stack
  end
  return n - from + 1
end

local live = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. ARGV[2], '+inf')
if #live == 0 then return {} end
local prefill = redis.call('HMGET', KEYS[2], unpack(live))
local decode = redis.call('HMGET', KEYS[3], unpack(live))
local out = {}
for w = 1, #live do
  local worker = live[w]
  local wbase = base .. ':w:' .. worker .. ':'
  local st = redis.call('HMGET', wbase .. 'state', 'stale', 'page_size')
  local page_size = st[2] or '0'
  local pages = pages_by_size[page_size]
  local status, device, host, disk = 0, 0, 0, 0
  if st[1] == '1' then
    status = 1
  elseif not pages then
    status = 2
  elseif #pages > 0 then
    device = run_length(wbase .. 'device', pages, 1)
    if device < #pages then host = run_length(wbase .. 'host', pages, device + 1) end
    if device + host < #pages then disk = run_length(wbase .. 'disk', pages, device + host + 1) end
  end
  local n = #out
  out[n + 1], out[n + 2], out[n + 3] = worker, status, tonumber(page_size)
  out[n + 4], out[n + 5], out[n + 6] = device, host, disk
  out[n + 7], out[n + 8] = tonumber(prefill[w]) or 0, tonumber(decode[w]) or 0
end
return out
