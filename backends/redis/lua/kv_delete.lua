-- botmesh redis script: kv.delete
-- include: -
-- once: yes (mutating: answered from KEYS[2], the request id, when run again)
-- KEYS: [1] a key of the prefix's hash slot, [2] the request id (optional)
-- ARGV: P, key, hasExpected, expected version → ['1'] or ['0']
--

local k = P .. 'kv:r:' .. ARGV[2]
local cur = redis.call('HGET', k, 'ver')
if not cur or (ARGV[3] == '1' and cur ~= ARGV[4]) then return cjson.encode({'0'}) end
redis.call('DEL', k)
redis.call('ZREM', P .. 'kv:keys', ARGV[2])
return cjson.encode({'1'})
