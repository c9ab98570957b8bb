-- botmesh redis wrapper: once
-- A mutating script run once per request: KEYS[2], the request id, keeps its reply for
-- {{REQUEST_TTL_MS}} ms, and a second run with the same id answers that reply without running again.
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
if RQ then redis.call('SET', RQ, reply, 'PX', {{REQUEST_TTL_MS}}) end
return reply
