-- botmesh redis script: outbox.retry
-- include: outbox
-- once: yes (mutating: answered from KEYS[2], the request id, when run again)
-- KEYS: [1] a key of the prefix's hash slot, [2] the request id (optional)
-- ARGV: P, key
--

local now = now_ms()
local h = out_read(ARGV[2], now)
if not h or not OUTM.retryable[h.state] then return cjson.encode({'no'}) end
local was = out_was(h)
h.state = 'queued'; h.nextAttemptAt = n2s(now); h.attempts = '0'; nolease(h); h.updatedAt = n2s(now)
out_write(h, was)
sync_head(h.chatId, now)
return cjson.encode({'ok'})
