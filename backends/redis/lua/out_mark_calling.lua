-- botmesh redis script: outbox.markCalling
-- include: outbox
-- once: no
-- KEYS: [1] a key of the prefix's hash slot
-- ARGV: P, key, token, leaseMs: heartbeat's check and lease extension, and the called flag set, in
-- one script. Not run once per request id: it is idempotent, and a re-sent call answers for the
-- entry as it is then (a lease lost meanwhile answers false, so no call starts under it).
--

local now = now_ms()
local h = out_read(ARGV[2], now, nil, nil, true)
if not out_held(h, ARGV[3]) then return cjson.encode({'stale'}) end
h.leaseExp = n2s(now + tonumber(ARGV[4]))
redis.call('HSET', h._key, 'leaseExp', h.leaseExp, 'called', '1')
redis.call('ZADD', P .. 'out:lease', h.leaseExp, h.key)
return cjson.encode({'ok'})
