-- The change feed (schemas/changes.py): every script that changes a worker's pages set ends
-- by appending what it changed to the model's feed, inside the same atomic call, so the feed
-- and the state never disagree. Routers' in-memory indexes follow it (router/index_feed.py).
-- An entry: n (the model's change counter: a reader that sees n skip knows it missed
-- entries, whether trimmed away or lost with the store), w (worker), o (ops, comma-separated:
-- "C" the worker's pages all gone, or kind S|R, tier digit, page keys as 16 hex digits each).
-- Trimmed by length, approximately (whole listpack nodes), to at least `maxlen` entries.
local function record_change(stream, counter, maxlen, worker, ops)
  local n = redis.call('INCR', counter)
  redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', 'n', n, 'w', worker, 'o', ops)
end
