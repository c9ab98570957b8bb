-- botmesh redis include: damaged
-- The records set aside as damaged: their list and their report.
--

-- ARGV: P, unreported(0|1), limit
local function damaged_list(j)
  local z = P .. j .. (ARGV[2] == '1' and ':dmgu' or ':dmg')
  local out = {}
  local limit = tonumber(ARGV[3])
  if limit <= 0 then return cjson.encode(out) end
  for _, id in ipairs(redis.call('ZRANGE', z, 0, limit - 1)) do
    local f = redis.call('HMGET', P .. j .. ':dmg:' .. id, 'problem', 'at', 'reported')
    out[#out + 1] = id; out[#out + 1] = f[1] or ''; out[#out + 1] = f[2] or '0'; out[#out + 1] = f[3] or '0'
  end
  return cjson.encode(out)
end
-- ARGV: P, id
local function damaged_report(j)
  if redis.call('ZREM', P .. j .. ':dmgu', ARGV[2]) == 0 then return cjson.encode({'no'}) end
  redis.call('HSET', P .. j .. ':dmg:' .. ARGV[2], 'reported', '1')
  return cjson.encode({'ok'})
end
