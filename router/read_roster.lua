-- A replica's copy of a model's roster and loads (router/roster.py), read in one atomic step,
-- so the loads are exactly those of the load version read with them. Read when a copy is due
-- (about once a second, or when a booking found it stale), never on every decision.
-- KEYS: 1 leases zset, 2 stale workers set, 3 page sizes hash, 4 incarnation marker hash,
--       5 change counter, 6 load version, 7 prefill load hash, 8 decode load hash, 9 rates hash
-- Returns {leases (member, expiry ms, ...), stale members, page sizes (worker, size, ...),
--          {ready, rebuilding, id}, change counter, load version, prefill (worker, pages, ...),
--          decode (worker, pages, ...), rates (worker, fit, ...): written with the loads}; a
--          missing value is "".
local marker = redis.call('HMGET', KEYS[4], 'ready', 'rebuilding', 'id')
for i = 1, 3 do marker[i] = marker[i] or '' end
return {redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES'), redis.call('SMEMBERS', KEYS[2]),
        redis.call('HGETALL', KEYS[3]), marker, redis.call('GET', KEYS[5]) or '',
        redis.call('GET', KEYS[6]) or '', redis.call('HGETALL', KEYS[7]), redis.call('HGETALL', KEYS[8]),
        redis.call('HGETALL', KEYS[9])}
