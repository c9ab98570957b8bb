-- botmesh redis include: list
-- The list scripts' arguments and their walk of a state index.
--

local function list_args()
  local chat = ARGV[2] == '1' and ARGV[3] or nil
  local limit = tonumber(ARGV[4])
  local ns = tonumber(ARGV[5])
  local want = nil
  if ns > 0 then
    want = {}
    for i = 1, ns do want[ARGV[5 + i]] = true end
  end
  return chat, limit, want
end
-- Up to limit records read from the members of the sorted sets zkeys, merged in (score, member) order
-- (the order of the journal's list). read(member) gives a record, or nil to skip the member: a
-- record that is gone, not wanted, or set aside (which drops members as the scan goes, so each round
-- reads the sets from the start: the first fetch members of each, as far as all of them are in order).
local function list_scan(zkeys, limit, read)
  local fetch, memo = math.max(limit, 16), {}
  local function before(a, b)
    if a[2] ~= b[2] then return a[2] < b[2] end
    return a[1] < b[1]
  end
  while true do
    local all, cut = {}, nil
    for _, z in ipairs(zkeys) do
      local r = redis.call('ZRANGE', z, 0, fetch - 1, 'WITHSCORES')
      for i = 1, #r, 2 do all[#all + 1] = {r[i], tonumber(r[i + 1])} end
      if #r >= 2 * fetch then
        local last = all[#all]
        if not cut or before(last, cut) then cut = last end
      end
    end
    table.sort(all, before)
    local out, emitted = {}, {}
    for _, m in ipairs(all) do
      if #out >= limit or (cut and before(cut, m)) then break end
      local f = memo[m[1]]
      if f == nil then
        f = read(m[1]) or false
        memo[m[1]] = f
      end
      if f and not emitted[m[1]] then
        emitted[m[1]] = true
        out[#out + 1] = f
      end
    end
    if #out >= limit or not cut then return out end
    fetch = fetch * 2
  end
end
