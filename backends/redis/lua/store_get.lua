-- botmesh redis script: store.get
-- include: -
-- once: no
-- KEYS: [1] a key of the prefix's hash slot
-- ARGV: P, key
--

local v = redis.call('GET', P .. 's:' .. ARGV[2])
if v then return cjson.encode({v}) end
return cjson.encode({})
