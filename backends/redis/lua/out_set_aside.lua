-- botmesh redis script: outbox.setAside
-- include: outbox
-- once: yes (mutating: answered from KEYS[2], the request id, when run again)
-- KEYS: [1] a key of the prefix's hash slot, [2] the request id (optional)
-- ARGV: P, key, problem, fence, updatedAt: sets aside an entry the caller read but cannot parse, unless
-- it changed since (its fence or updatedAt field differs from the ones read) → ['ok'|'no'|'changed']
--

local k = ARGV[2]
local h = load(out_key(k), OUT_FIELDS, OUT_FIELDS_MAKE)
if not h or is_aside('out', k) then return cjson.encode({'no'}) end
if (h.fence or '') ~= ARGV[4] or (h.updatedAt or '') ~= ARGV[5] then return cjson.encode({'changed'}) end
local now = now_ms()
out_aside(k, h, nil, ARGV[3], now)
if type(h.chatId) == 'string' then sync_head(h.chatId, now) end
return cjson.encode({'ok'})
