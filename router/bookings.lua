-- Shared by the booking scripts (prepended to each): the load writes, and giving back what
-- expired bookings hold. A booking expires when its router died before releasing it.
-- Every booking script is given the model's load keys first: KEYS[1] prefill load hash,
-- KEYS[2] decode load hash, KEYS[3] bookings zset, KEYS[4] load version.
-- Two kinds of key are built here from the key base (ARGV) instead, because only the script
-- learns which: the hash of a booking found expired (from the bookings zset) and the
-- predicted-pages hash of a worker the script picks or a booking names. They carry the same
-- hash tag {m} as every key of the model, so they are in the slot of the keys given, on the
-- same Redis Cluster node.
local LOAD = {prefill = KEYS[1], decode = KEYS[2], bookings = KEYS[3], version = KEYS[4]}

local function add_load(key, worker, delta)
  if delta == 0 then return end
  local left = redis.call('HINCRBY', key, worker, delta)
  if left <= 0 then redis.call('HDEL', key, worker) end
end

-- Every write to the load hashes bumps the model's load version: a replica that chose on
-- loads it copied at version v books only while the version is still v (book_checked.lua).
local function loads_changed()
  return redis.call('INCR', LOAD.version)
end

-- Predicted pages: one count per booking holding the page (page keys concatenated, 16 hex
-- digits each); a page whose count reaches 0 is no longer predicted. The worker's hash is
-- built from the base (above: the worker is known only here).
local function hold_predicted(base, worker, pages, delta)
  local key = base .. ':w:' .. worker .. ':predicted'
  for j = 1, #pages / 16 do
    local page = string.sub(pages, (j - 1) * 16 + 1, j * 16)
    if redis.call('HINCRBY', key, page, delta) <= 0 then redis.call('HDEL', key, page) end
  end
end

-- Returns what the booking (its hash `bk`) held ({worker, prefill, decode, predicted}, all
-- nil when nothing) and the load version after dropping it (nil when nothing was held).
local function drop_booking(base, bk, request_id)
  local held = redis.call('HMGET', bk, 'worker', 'prefill', 'decode', 'predicted')
  redis.call('DEL', bk)
  redis.call('ZREM', LOAD.bookings, request_id)
  local version
  if held[1] then
    add_load(LOAD.prefill, held[1], -(tonumber(held[2]) or 0))
    add_load(LOAD.decode, held[1], -(tonumber(held[3]) or 0))
    version = loads_changed()
    if held[4] then hold_predicted(base, held[1], held[4], -1) end
  end
  return held, version
end

-- Expired bookings' hashes are built from the base (above: the zset names them only here).
local function sweep_expired(base, now, limit)
  local expired = redis.call('ZRANGEBYSCORE', LOAD.bookings, '-inf', now, 'LIMIT', 0, limit)
  for _, request_id in ipairs(expired) do drop_booking(base, base .. ':bk:' .. request_id, request_id) end
  return #expired
end
