-- botmesh redis script: outbox.get
-- include: outbox
-- once: no
-- KEYS: [1] a key of the prefix's hash slot
-- ARGV: P, key → ['ok', entry], ['aside', problem] (a damaged entry is set aside first) or []
--

local k = ARGV[2]
if is_aside('out', k) then return cjson.encode({'aside', aside_problem('out', k)}) end
local h = out_read(k, now_ms())
if h then return cjson.encode({'ok', flat_of(h)}) end
if is_aside('out', k) then return cjson.encode({'aside', aside_problem('out', k)}) end
return cjson.encode({})
