-- Pick a worker and book the request's load on it in one atomic step, so concurrent router
-- replicas always see each other's bookings. The load-free part of each score (the cache
-- credit) comes from router/scoring.py; the load-dependent step below is the same formula
-- (tests/router/test_router_scoring.py checks both choose alike).
-- KEYS: 1 prefill load hash, 2 decode load hash, 3 bookings zset, 4 load version (the load
--       keys of bookings.lua), 5 the request's booking hash, 6 the model's round-robin turn
-- The key base (ARGV 1) builds only what bookings.lua says it builds: expired bookings' hashes
-- and the chosen worker's predicted pages.
-- ARGV: 1 key base, 2 now (unix ms), 3 booking ttl (ms), 4 request id, 5 request pages,
--       6 decode pages, 7 prefill_load_scale, 8 temperature, 9 u in [0,1), 10 book (1|0),
--       11 workers (comma-separated), 12 their cache credits (comma-separated decimals),
--       13 the pages each need not compute (device + predicted overlap: the prefill booked is
--       request pages minus these) (comma-separated); one argument each, not 3 per worker,
--       because packing hundreds of arguments costs the client more than splitting costs here;
--       14 selection: "score" (the formula), "round-robin" (the model's next turn, one counter
--       for every replica: KEYS[6]) or "random" (uniform by u); each books alike;
--       15 the request's page keys (16 hex digits each) to predict on the chosen worker, or ""
--       for no prediction; 16 each worker's device overlap (comma-separated): the chosen
--       worker's pages past it are predicted there (one more booking holding each) until the
--       booking completes or expires; 17 each worker's predicted first token at its learned
--       rates ("service-seconds queue-seconds-per-prefill-page compute-seconds-per-token
--       fit-relative-error queue-seconds-per-page-at-compute", comma-separated), or "" for
--       the formula's choice: with them, a clearly faster worker replaces it (router/rates.py `faster_than_formula`);
--       18 each worker's predicted work ("recompute host-load L3-load queued page-size",
--       comma-separated): the chosen one's, with its booked prefill ahead added to the queued
--       tokens (schemas/rates.py WORK_KINDS), is kept in the booking for release.lua to learn from ("": none), 19 the digest of the
--       booking's owner secret, which a client's release must give (release.lua; "": none),
--       20 the override's margin, 21 how much faster its worker must compute (FasterPick)
-- Returns {chosen index (1-based) | -1 when the request id is already booked,
--          worker prefill loads..., worker decode loads...} (loads as read before booking).
local base, now, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local request_id, request_pages, decode_pages = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
local scale, temperature, u, book = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9]), ARGV[10] == '1'

local bk = KEYS[5]
sweep_expired(base, now, 32)
if book and redis.call('EXISTS', bk) == 1 then
  return {-1, redis.call('HGET', bk, 'worker')}
end

local workers, credits, devices = {}, {}, {}
for w in string.gmatch(ARGV[11], '[^,]+') do workers[#workers + 1] = w end
for c in string.gmatch(ARGV[12], '[^,]+') do credits[#credits + 1] = tonumber(c) end
for d in string.gmatch(ARGV[13], '[^,]+') do devices[#devices + 1] = tonumber(d) end
local prefill = redis.call('HMGET', LOAD.prefill, unpack(workers))
local decode = redis.call('HMGET', LOAD.decode, unpack(workers))

local logits, low, high = {}, math.huge, -math.huge
for k = 1, #workers do
  prefill[k], decode[k] = tonumber(prefill[k]) or 0, tonumber(decode[k]) or 0
  local adjusted = math.max((request_pages + prefill[k]) - credits[k], 0)
  logits[k] = scale * adjusted + decode[k]
  if logits[k] < low then low = logits[k] end
  if logits[k] > high then high = logits[k] end
end

if u >= 1 then u = 1 - 2 ^ -53 elseif u < 0 then u = 0 end
local chosen
local selection = ARGV[14] or 'score'
if selection == 'round-robin' then
  chosen = (redis.call('INCR', KEYS[6]) - 1) % #workers + 1
elseif selection == 'random' then
  chosen = math.floor(u * #workers) + 1
elseif temperature <= 0 then
  local ties = {}
  for k = 1, #workers do if logits[k] == low then ties[#ties + 1] = k end end
  chosen = ties[math.floor(u * #ties) + 1]
elseif high - low == 0 then
  chosen = math.floor(u * #workers) + 1
else
  local weights, total = {}, 0
  for k = 1, #workers do
    weights[k] = math.exp(-((logits[k] - low) / (high - low)) / temperature)
    total = total + weights[k]
  end
  local target, running = u * total, 0
  chosen = #workers
  for k = 1, #workers do
    running = running + weights[k]
    if target < running then chosen = k; break end
  end
end

if selection == 'score' and (ARGV[17] or '') ~= '' then
  -- rates.faster_than_formula: a worker faster at compute than the formula's beyond both
  -- fits' errors, whose own work is no slower and decode load no more, and whose first token
  -- (its work plus the prefill queued ahead) is sooner by more than the margin
  local service, queue, compute, spread, at_compute = {}, {}, {}, {}, {}
  for column in string.gmatch(ARGV[17], '[^,]+') do
    local s, q, c, e, a = string.match(column, '(%S+) (%S+) (%S+) (%S+) (%S+)')
    service[#service + 1], queue[#queue + 1] = tonumber(s), tonumber(q)
    compute[#compute + 1], spread[#spread + 1], at_compute[#at_compute + 1] = tonumber(c), tonumber(e), tonumber(a)
  end
  local margin, faster_by = tonumber(ARGV[20]), tonumber(ARGV[21])
  local cap = decode[chosen]
  local own = service[chosen]
  -- clearly faster: at the slow end of its fit's error, under the formula's at the fast end
  local faster = (1.0 - faster_by) * compute[chosen] * (1.0 - spread[chosen])
  local best, best_s = chosen, service[chosen] + prefill[chosen] * queue[chosen]
  local limit = (1.0 - margin) * best_s
  for k = 1, #workers do
    if compute[k] * (1.0 + spread[k]) < faster and service[k] <= own and decode[k] <= cap then
      local ttft = service[k] + prefill[k] * queue[k]
      if ttft < best_s then best, best_s = k, ttft end
    end
  end
  -- and sooner by the margin with every queue at its compute rate too: else its cost is unsure
  if best_s < limit and service[best] + prefill[best] * at_compute[best]
      < (1.0 - margin) * (service[chosen] + prefill[chosen] * at_compute[chosen]) then
    chosen = best
  end
end

if book then
  local worker = workers[chosen]
  local prefill_pages = math.max(request_pages - devices[chosen], 0)
  add_load(LOAD.prefill, worker, prefill_pages)
  add_load(LOAD.decode, worker, decode_pages)
  loads_changed()
  redis.call('HSET', bk, 'worker', worker, 'prefill', prefill_pages, 'decode', decode_pages)
  if (ARGV[19] or '') ~= '' then redis.call('HSET', bk, 'owner', ARGV[19]) end
  local k = 0
  for work in string.gmatch(ARGV[18] or '', '[^,]+') do
    k = k + 1
    if k == chosen then
      local w = {}
      for part in string.gmatch(work, '%S+') do w[#w + 1] = tonumber(part) end
      redis.call('HSET', bk, 'work', string.format('%.17g %.17g %.17g %.17g', w[1], w[2], w[3],
                                                  w[4] + prefill[chosen] * w[5]),
                 'at', now)
      break
    end
  end
  local blob = ARGV[15] or ''
  if blob ~= '' then
    local k = 0
    for d in string.gmatch(ARGV[16], '[^,]+') do
      k = k + 1
      if k == chosen then
        local from = tonumber(d)
        if from * 16 < #blob then
          local pages = string.sub(blob, from * 16 + 1)
          hold_predicted(base, worker, pages, 1)
          redis.call('HSET', bk, 'predicted', pages)
        end
        break
      end
    end
  end
  -- The hash outlives its zset entry a little, so a sweep can still read what to give back.
  redis.call('PEXPIRE', bk, ttl + math.min(ttl, 60000))
  redis.call('ZADD', LOAD.bookings, now + ttl, request_id)
end

local out = {chosen}
for k = 1, #workers do out[#out + 1] = prefill[k] end
for k = 1, #workers do out[#out + 1] = decode[k] end
return out
