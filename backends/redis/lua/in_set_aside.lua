-- botmesh redis script: inbox.setAside
-- include: inbox
-- once: yes (mutating: answered from KEYS[2], the request id, when run again)
-- KEYS: [1] a key of the prefix's hash slot, [2] the request id (optional)
-- ARGV: P, id, problem, fence, updatedAt: sets aside a record the caller read but cannot parse, unless
-- it changed since (its fence or updatedAt field differs from the ones read) → ['ok'|'no'|'changed']
--

local h = load(in_key(ARGV[2]), IN_FIELDS, IN_FIELDS_MAKE)
if not h or is_aside('in', ARGV[2]) then return cjson.encode({'no'}) end
if (h.fence or '') ~= ARGV[4] or (h.updatedAt or '') ~= ARGV[5] then return cjson.encode({'changed'}) end
in_aside(ARGV[2], h, nil, nil, ARGV[3], now_ms())
return cjson.encode({'ok'})
