-- Shared by the booking scripts (prepended to each): give back what expired bookings hold.
-- A booking expires when its router died before releasing it.
local function add_load(key, worker, delta)
  if delta == 0 then return end
  local left = redis.call('HINCRBY', key, worker, delta)
  if left <= 0 then redis.call('HDEL', key, worker) end
end

local function drop_booking(base, request_id, prefill_key, decode_key)
  local bk = base .. ':bk:' .. request_id
  local held = redis.call('HMGET', bk, 'worker', 'prefill', 'decode')
  redis.call('DEL', bk)
  redis.call('ZREM', base .. ':bookings', request_id)
  if held[1] then
    add_load(prefill_key, held[1], -(tonumber(held[2]) or 0))
    add_load(decode_key, held[1], -(tonumber(held[3]) or 0))
  end
  return held
end

local function sweep_expired(base, now, limit, prefill_key, decode_key)
  local expired = redis.call('ZRANGEBYSCORE', base .. ':bookings', '-inf', now, 'LIMIT', 0, limit)
  for _, request_id in ipairs(expired) do drop_booking(base, request_id, prefill_key, decode_key) end
  return #expired
end
