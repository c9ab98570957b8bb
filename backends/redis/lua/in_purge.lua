-- botmesh redis script: inbox.purge
-- include: inbox
-- once: yes (mutating: answered from KEYS[2], the request id, when run again)
-- KEYS: [1] a key of the prefix's hash slot, [2] the request id (optional)
-- ARGV: P, olderThanMs, batch → [deleted, scanned]
--

local now = now_ms()
local cutoff = now - tonumber(ARGV[2])
local ids = redis.call('ZRANGEBYSCORE', P .. 'in:done', '-inf', n2s(cutoff), 'LIMIT', 0, tonumber(ARGV[3]))
local n = 0
for _, id in ipairs(ids) do
  local h = in_read(id, now)
  redis.call('ZREM', P .. 'in:done', id)
  if h and INM.purgeable[h.state] then
    redis.call('ZREM', P .. 'in:all', h.om)
    redis.call('ZREM', P .. 'in:chat:' .. h.chatId, h.om)
    redis.call('ZREM', P .. 'in:st:done', h.om)
    redis.call('DEL', h._key)
    n = n + 1
  end
end
return cjson.encode({n2s(n), n2s(#ids)})
