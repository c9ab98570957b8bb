-- botmesh redis script: store.delete
-- include: -
-- once: no
-- KEYS: [1] a key of the prefix's hash slot
-- ARGV: P, key
--

redis.call('DEL', P .. 's:' .. ARGV[2])
return cjson.encode({'ok'})
