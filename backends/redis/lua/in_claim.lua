-- botmesh redis script: inbox.claim
-- include: inbox
-- once: yes (mutating: answered from KEYS[2], the request id, when run again)
-- KEYS: [1] a key of the prefix's hash slot, [2] the request id (optional)
-- ARGV: P, id, owner, inc, leaseMs, reclaim
--

local now = now_ms()
local h = in_read(ARGV[2], now)
local o = opts(3)
if not h or not in_claimable(h, now, o) then return cjson.encode({'none'}) end
in_claim(h, now, o)
return cjson.encode({'ok', flat_of(h)})
