-- botmesh redis script: inbox.finish
-- include: inbox
-- once: yes (mutating: answered from KEYS[2], the request id, when run again)
-- KEYS: [1] a key of the prefix's hash slot, [2] the request id (optional)
-- ARGV: P, id, token, mode (done|dead|retry|schedule), error, retryInMs (schedule: ms until the timer is due)
--

local now = now_ms()
local h = in_read(ARGV[2], now, nil, nil, true)
if not in_held(h, ARGV[3]) then return cjson.encode({'stale'}) end
local mode = ARGV[4]
local was = in_was(h)
h.nextAttemptAt = false
if mode == 'done' then
  h.state = 'done'
elseif mode == 'dead' then
  h.state = 'dead'; h.error = ARGV[5]
elseif mode == 'schedule' then
  h.state = '{{TIMER_STATE}}'; h.error = false; h.nextAttemptAt = n2s(now + math.max(0, tonumber(ARGV[6])))
else
  h.state = 'failed'; h.error = ARGV[5]; h.nextAttemptAt = n2s(now + math.max(0, tonumber(ARGV[6])))
end
nolease(h); h.updatedAt = n2s(now)
in_write(h, was)
return cjson.encode({'ok'})
