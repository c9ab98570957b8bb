-- botmesh redis script: outbox.heartbeat
-- include: outbox
-- once: yes (mutating: answered from KEYS[2], the request id, when run again)
-- KEYS: [1] a key of the prefix's hash slot, [2] the request id (optional)
-- ARGV: P, key, token, leaseMs
--

local now = now_ms()
local h = out_read(ARGV[2], now, nil, nil, true)
if not out_held(h, ARGV[3]) then return cjson.encode({'stale'}) end
h.leaseExp = n2s(now + tonumber(ARGV[4]))
save(h, {'leaseExp'})
redis.call('ZADD', P .. 'out:lease', h.leaseExp, h.key)
return cjson.encode({'ok'})
