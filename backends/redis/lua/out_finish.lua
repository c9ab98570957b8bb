-- botmesh redis script: outbox.finish
-- include: outbox
-- once: yes (mutating: answered from KEYS[2], the request id, when run again)
-- KEYS: [1] a key of the prefix's hash slot, [2] the request id (optional)
-- ARGV: P, key, token, mode (sent|dead|retry|throttled|unknown), messageId or error, retryInMs. `unknown`
-- (an ambiguous markFailed) is claimDue's move of a lost send: lease dropped, no next attempt, fence and
-- attempts kept; out_write takes it out of its chat's open set and sync_head marks the next head.
-- `throttled` is a retry that gives its attempt back (a 429: nothing was sent).
--

local now = now_ms()
local h = out_read(ARGV[2], now, nil, nil, true)
if not out_resolvable(h, ARGV[3]) then return cjson.encode({'stale'}) end
local mode = ARGV[4]
local was = out_was(h)
h.nextAttemptAt = false
if mode == 'sent' then
  h.state = 'sent'; h.messageId = ARGV[5]
elseif mode == 'dead' then
  h.state = 'dead'; h.error = ARGV[5]
elseif mode == 'unknown' then
  h.state = 'unknown'; h.error = ARGV[5]
else
  h.state = 'failed'; h.error = ARGV[5]; h.nextAttemptAt = n2s(now + math.max(0, tonumber(ARGV[6])))
  if mode == 'throttled' then h.attempts = n2s(math.max(0, num(h, 'attempts') - 1)) end
end
nolease(h); h.updatedAt = n2s(now)
out_write(h, was)
sync_head(h.chatId, now)
return cjson.encode({'ok'})
