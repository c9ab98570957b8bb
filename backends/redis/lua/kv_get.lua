-- botmesh redis script: kv.get
-- include: -
-- once: no
-- KEYS: [1] a key of the prefix's hash slot
-- ARGV: P, key → [value, version] or []
--

local r = redis.call('HMGET', P .. 'kv:r:' .. ARGV[2], 'v', 'ver')
if not r[1] or not r[2] then return cjson.encode({}) end
return cjson.encode({r[1], r[2]})
