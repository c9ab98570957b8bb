-- botmesh redis script: outbox.damaged
-- include: damaged
-- once: no
-- KEYS: [1] a key of the prefix's hash slot
-- ARGV: P, unreported(0|1), limit → [key, problem, at, reported, …]
--
return damaged_list('out')