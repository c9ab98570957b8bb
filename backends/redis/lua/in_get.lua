-- botmesh redis script: inbox.get
-- include: inbox
-- once: no
-- KEYS: [1] a key of the prefix's hash slot
-- ARGV: P, id → ['ok', record], ['aside', problem] (a damaged record is set aside first) or []
--

local id = ARGV[2]
if is_aside('in', id) then return cjson.encode({'aside', aside_problem('in', id)}) end
local h = in_read(id, now_ms())
if h then return cjson.encode({'ok', flat_of(h)}) end
if is_aside('in', id) then return cjson.encode({'aside', aside_problem('in', id)}) end
return cjson.encode({})
