-- botmesh redis script: claimDue (repeat)
-- include: -
-- once: no
-- KEYS: [1] a key of the prefix's hash slot, [2] the request key of a due scan named by its requestId
-- ARGV: P, journal ('in' or 'out') → the reply that scan stored under KEYS[2] (see the once wrapper), or
-- the journal's empty answer when there is none (the scan never ran, its reply is older than the request
-- key's time to live). The request is closed first: the empty answer is set under KEYS[2] unless a reply is
-- there (NX, for {{SCAN_ANSWER_KEEP_MS}} ms), so that a late run of the scan answers it without running.
-- Scripts are atomic: either the scan ran before and this reads its reply, or it never will.
--

local empty = ARGV[2] == 'out' and cjson.encode({{}, {}}) or cjson.encode({})
redis.call('SET', KEYS[2], empty, 'NX', 'PX', {{SCAN_ANSWER_KEEP_MS}})
return redis.call('GET', KEYS[2])
