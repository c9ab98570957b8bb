-- botmesh redis script: inbox.damaged
-- include: damaged
-- once: no
-- KEYS: [1] a key of the prefix's hash slot
-- ARGV: P, unreported(0|1), limit → [id, problem, at, reported, …]
--
return damaged_list('in')