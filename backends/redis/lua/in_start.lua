-- botmesh redis script: inbox.start
-- include: inbox
-- once: yes (mutating: answered from KEYS[2], the request id, when run again)
-- KEYS: [1] a key of the prefix's hash slot, [2] the request id (optional)
-- ARGV: P, id, token, attempt: startedInbound (attempts max(attempts, attempt)) under the lease
--

local now = now_ms()
local h = in_read(ARGV[2], now, nil, nil, true)
if not in_held(h, ARGV[3]) then return cjson.encode({'stale'}) end
if num(h, 'attempts') < tonumber(ARGV[4]) then
  h.attempts = ARGV[4] -- updatedAt is kept: the lists' indexes are by it, and a run's start changes no state
  save(h, {'attempts'})
end
return cjson.encode({'ok'})
