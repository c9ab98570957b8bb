-- botmesh redis wrapper: once
-- A mutating script run once per request: KEYS[2], the request id, keeps its reply for
-- {{REQUEST_TTL_MS}} ms (the request key of a named due scan, <P>rq:scan:…, for {{SCAN_ANSWER_KEEP_MS}} ms),
-- and a second run with the same id answers that reply without running again (so does a named scan
-- whose request a repeat closed first: it answers the repeat's empty answer, see scan_answer.lua).
-- {{HEAD}} is the prelude and the includes, {{BODY}} the script's body (a function's body: it returns the reply).
--
{{HEAD}}local RQ = KEYS[2]
if RQ then
  local prev = redis.call('GET', RQ)
  if prev then return prev end
end
local function main()
{{BODY}}
end
local reply = main()
if RQ then
  local ttl = {{REQUEST_TTL_MS}}
  if string.sub(RQ, #P + 1, #P + 8) == 'rq:scan:' then ttl = {{SCAN_ANSWER_KEEP_MS}} end
  redis.call('SET', RQ, reply, 'PX', ttl)
end
return reply
