-- Shared by the booking scripts (prepended to each): give back what expired bookings hold.
-- A booking expires when its router died before releasing it.
local function add_load(key, worker, delta)
  if delta == 0 then return end
  local left = redis.call('HINCRBY', key, worker, delta)
  if left <= 0 then redis.call('HDEL', key, worker) end
end

-- Every write to the load hashes bumps the model's load version: a replica that chose on
-- loads it mirrors at version v books only while the version is still v (book_checked.lua).
local function loads_changed(base)
  return redis.call('INCR', base .. ':load:version')
end

-- Predicted pages: one count per booking holding the page (page keys concatenated, 16 hex
-- digits each); a page whose count reaches 0 is no longer predicted.
local function hold_predicted(base, worker, pages, delta)
  local key = base .. ':w:' .. worker .. ':predicted'
  for j = 1, #pages / 16 do
    local page = string.sub(pages, (j - 1) * 16 + 1, j * 16)
    if redis.call('HINCRBY', key, page, delta) <= 0 then redis.call('HDEL', key, page) end
  end
end

-- Returns what the booking held ({worker, prefill, decode, predicted}, all nil when nothing)
-- and the load version after dropping it (nil when nothing was held).
local function drop_booking(base, request_id, prefill_key, decode_key)
  local bk = base .. ':bk:' .. request_id
  local held = redis.call('HMGET', bk, 'worker', 'prefill', 'decode', 'predicted')
  redis.call('DEL', bk)
  redis.call('ZREM', base .. ':bookings', request_id)
  local version
  if held[1] then
    add_load(prefill_key, held[1], -(tonumber(held[2]) or 0))
    add_load(decode_key, held[1], -(tonumber(held[3]) or 0))
    version = loads_changed(base)
    if held[4] then hold_predicted(base, held[1], held[4], -1) end
  end
  return held, version
end

local function sweep_expired(base, now, limit, prefill_key, decode_key)
  local expired = redis.call('ZRANGEBYSCORE', base .. ':bookings', '-inf', now, 'LIMIT', 0, limit)
  for _, request_id in ipairs(expired) do drop_booking(base, request_id, prefill_key, decode_key) end
  return #expired
end
