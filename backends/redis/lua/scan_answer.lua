-- botmesh redis script: claimDue (repeat)
-- include: -
-- once: no
-- KEYS: [1] a key of the prefix's hash slot, [2] the request key of a due scan named by its requestId
-- ARGV: P → the reply that scan stored under KEYS[2] (see the once wrapper), or [] when there is none
-- (the scan never ran, its reply is older than the request key's time to live): a read, nothing changes
--

local kept = redis.call('GET', KEYS[2])
if kept then return kept end
return cjson.encode({})
