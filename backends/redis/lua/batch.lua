-- botmesh redis wrapper: batch
-- Several operations in one script call (the hot path's writes of one turn of the event loop).
-- ARGV: P, then per operation its name, once (0|1), the number of its arguments, and its arguments
-- (after P). {{INCLUDES}} is the prelude and the inbox and outbox includes; {{OPS}} makes the function
-- of a batched script's body (f) from its name, the first time the call runs one: a script builds
-- each of its closures on every call, so the operations a call does not run are never built. With
-- KEYS[2], the replies of the `once` operations are kept there (joined by newlines) and a second run
-- answers them from it.
--
-- botmesh redis backend: batch
local BATCH = ARGV
local ARGV = {BATCH[1]}
{{INCLUDES}}
local OPS = {}
local RQ = KEYS[2]
local stored = nil
if RQ then
  local prev = redis.call('GET', RQ)
  if prev then
    stored = {}
    for part in string.gmatch(prev, '[^\n]+') do stored[#stored + 1] = part end
  end
end
local out, keep, k, i = {}, {}, 0, 2
while i <= #BATCH do
  local name, once, na = BATCH[i], BATCH[i + 1] == '1', tonumber(BATCH[i + 2])
  local a = {BATCH[1]}
  for j = 1, na do a[j + 1] = BATCH[i + 2 + j] end
  i = i + 3 + na
  local r
  if once and stored then
    k = k + 1
    r = stored[k]
  end
  if not r then
    ARGV = a
    local f = OPS[name]
    if not f then
{{OPS}}
      OPS[name] = f
    end
    local ok, res = pcall(f)
    if ok then
      r = res
    else
      r = cjson.encode({err = type(res) == 'table' and tostring(res.err) or tostring(res)})
    end
  end
  out[#out + 1] = r
  if once then keep[#keep + 1] = r end
end
if RQ and not stored then redis.call('SET', RQ, table.concat(keep, '\n'), 'PX', {{REQUEST_TTL_MS}}) end
return '[' .. table.concat(out, ',') .. ']'
