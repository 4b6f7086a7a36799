-- One step of an index bootstrap's scan of a worker's pages set (router/mirror.py): SSCAN
-- from a cursor, the members found returned as one blob of page keys per tier.
-- KEYS: 1 the worker's pages set
-- ARGV: 1 cursor, 2 count (SSCAN's hint)
-- Returns {next cursor ("0": done), device keys, host keys, disk keys} (16 hex digits each;
-- external-tier members are left out: the walk never reads them).
local reply = redis.call('SSCAN', KEYS[1], ARGV[1], 'COUNT', ARGV[2])
local by_tag = {['1'] = {}, ['2'] = {}, ['4'] = {}}
for _, member in ipairs(reply[2]) do
  local keys = by_tag[string.sub(member, 1, 1)]
  if keys then keys[#keys + 1] = string.sub(member, 2) end
end
return {reply[1], table.concat(by_tag['1']), table.concat(by_tag['2']), table.concat(by_tag['4'])}
