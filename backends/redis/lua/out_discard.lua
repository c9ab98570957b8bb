-- botmesh redis script: outbox.discard
-- include: outbox
-- once: yes (mutating: answered from KEYS[2], the request id, when run again)
-- KEYS: [1] a key of the prefix's hash slot, [2] the request id (optional)
-- ARGV: P, key
--

local now = now_ms()
local h = out_read(ARGV[2], now)
if not h or not OUTM.discardable[h.state] then return cjson.encode({'no'}) end
out_unindex(h)
redis.call('ZREM', open_key(h.chatId), h.key)
redis.call('ZREM', P .. 'out:all', h.key)
redis.call('ZREM', P .. 'out:chat:' .. h.chatId, h.key)
redis.call('DEL', h._key)
sync_head(h.chatId, now)
return cjson.encode({'ok'})
