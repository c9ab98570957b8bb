-- botmesh redis script: inbox.replay
-- include: inbox
-- once: yes (mutating: answered from KEYS[2], the request id, when run again)
-- KEYS: [1] a key of the prefix's hash slot, [2] the request id (optional)
-- ARGV: P, id
--

local now = now_ms()
local h = in_read(ARGV[2], now)
if not h or not INM.retryable[h.state] then return cjson.encode({'no'}) end
local was = in_was(h)
h.state = 'pending'; h.attempts = '0'; h.nextAttemptAt = false; nolease(h); h.error = false; h.updatedAt = n2s(now)
in_write(h, was)
return cjson.encode({'ok'})
