-- botmesh redis script: kv.set
-- include: -
-- once: yes (mutating: answered from KEYS[2], the request id, when run again)
-- KEYS: [1] a key of the prefix's hash slot, [2] the request id (optional)
-- ARGV: P, key, value, mode (any|absent|match), expected version → [version] or []
--

local k = P .. 'kv:r:' .. ARGV[2]
local cur = redis.call('HGET', k, 'ver')
local mode = ARGV[4]
if mode == 'absent' and cur then return cjson.encode({}) end
if mode == 'match' and cur ~= ARGV[5] then return cjson.encode({}) end
local ver = n2s(redis.call('INCR', P .. 'kv:ver'))
redis.call('HSET', k, 'v', ARGV[3], 'ver', ver)
redis.call('ZADD', P .. 'kv:keys', 0, ARGV[2])
return cjson.encode({ver})
