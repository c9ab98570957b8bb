-- botmesh redis script: kv.list
-- include: -
-- once: no
-- KEYS: [1] a key of the prefix's hash slot
-- ARGV: P, start bound, prefix, limit (-1: all) → [key, value, version, …]
--

local stop = '+'
if ARGV[3] ~= '' then stop = '[' .. ARGV[3] .. '\255' end
local keys = redis.call('ZRANGE', P .. 'kv:keys', ARGV[2], stop, 'BYLEX', 'LIMIT', 0, tonumber(ARGV[4]))
local out = {}
for _, key in ipairs(keys) do
  local r = redis.call('HMGET', P .. 'kv:r:' .. key, 'v', 'ver')
  if r[1] and r[2] then
    out[#out + 1] = key; out[#out + 1] = r[1]; out[#out + 1] = r[2]
  end
end
return cjson.encode(out)
