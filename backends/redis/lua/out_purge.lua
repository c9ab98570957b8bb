-- botmesh redis script: outbox.purge
-- include: outbox
-- once: yes (mutating: answered from KEYS[2], the request id, when run again)
-- KEYS: [1] a key of the prefix's hash slot, [2] the request id (optional)
-- ARGV: P, olderThanMs, batch → [deleted, scanned]
--

local now = now_ms()
local cutoff = now - tonumber(ARGV[2])
local ks = redis.call('ZRANGEBYSCORE', P .. 'out:sent', '-inf', n2s(cutoff), 'LIMIT', 0, tonumber(ARGV[3]))
local n = 0
for _, k in ipairs(ks) do
  local h = out_read(k, now)
  redis.call('ZREM', P .. 'out:sent', k)
  if h and OUTM.purgeable[h.state] then
    redis.call('ZREM', P .. 'out:all', k)
    redis.call('ZREM', P .. 'out:chat:' .. h.chatId, k)
    redis.call('ZREM', P .. 'out:st:sent', k)
    redis.call('DEL', h._key)
    n = n + 1
  end
end
return cjson.encode({n2s(n), n2s(#ks)})
