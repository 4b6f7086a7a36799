-- Where a model's change feed stands, noted atomically by a bootstrap before it scans the
-- pages sets (router/index_feed.py): the marker's id, the change counter, the last entry's id,
-- and the workers whose sets to scan.
-- KEYS: 1 the incarnation marker, 2 the change counter, 3 the change feed stream, 4 the workers set
-- Returns {marker id ("" when missing), counter ("0" when none), last entry id ("0-0" when
-- none), {workers...}}.
local last = redis.call('XREVRANGE', KEYS[3], '+', '-', 'COUNT', 1)
return {redis.call('HGET', KEYS[1], 'id') or '', redis.call('GET', KEYS[2]) or '0',
        last[1] and last[1][1] or '0-0', redis.call('SMEMBERS', KEYS[4])}
