-- botmesh redis script: store.set
-- include: -
-- once: no
-- KEYS: [1] a key of the prefix's hash slot
-- ARGV: P, key, value, ttlMs ('' for none)
--

if ARGV[4] == '' then
  redis.call('SET', P .. 's:' .. ARGV[2], ARGV[3])
else
  redis.call('SET', P .. 's:' .. ARGV[2], ARGV[3], 'PX', ARGV[4])
end
return cjson.encode({'ok'})
