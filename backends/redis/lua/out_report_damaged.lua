-- botmesh redis script: outbox.reportDamaged
-- include: damaged
-- once: yes (mutating: answered from KEYS[2], the request id, when run again)
-- KEYS: [1] a key of the prefix's hash slot, [2] the request id (optional)
-- ARGV: P, key → ['ok'] when this call marked it reported, else ['no']
--
return damaged_report('out')