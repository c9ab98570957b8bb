-- botmesh redis script: time
-- include: -
-- once: no
-- KEYS: [1] a key of the prefix's hash slot
-- ARGV: P → [now]
--
return cjson.encode({n2s(now_ms())})