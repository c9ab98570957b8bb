-- botmesh redis script: inbox.claimDue
-- include: inbox
-- once: yes (mutating: answered from KEYS[2], the request id, when run again)
-- KEYS: [1] a key of the prefix's hash slot, [2] the request id (optional)
-- ARGV: P, owner, inc, leaseMs, reclaim, limit. Candidates come from the due windows (lapsed leases
-- and retries, the owner's set under reclaimOwn, the pending backlog); the chat of each is then walked
-- in arrival order (in:act:<chat>, active records only), and a candidate is taken only when the walk
-- reached it before a record held elsewhere (in_holds). The first scan of a key prefix indexes the
-- active records written before the chat index existed (in:actv marks it done).
--

local o = opts(2)
local limit = tonumber(ARGV[6])
local now = now_ms()
if redis.call('EXISTS', P .. 'in:actv') == 0 then
  for _, s in ipairs({{{ACTIVE_INBOX_STATES_LIST}}}) do
    local start = 0
    repeat
      local oms = redis.call('ZRANGE', P .. 'in:st:' .. s, start, start + 999)
      for _, om in ipairs(oms) do
        local f = fields(in_key(string.sub(om, 17)), 'chatId', 'receivedAt', 'state', 'om')
        local r = tonumber(f[2])
        -- a damaged record is left out: a scan that reaches it sets it aside
        if type(f[1]) == 'string' and f[3] == s and f[4] == om and r and r == r and r ~= math.huge and r ~= -math.huge
          and not is_aside('in', string.sub(om, 17)) then
          redis.call('ZADD', act_key(f[1]), n2s(r), om)
        end
      end
      start = start + 1000
    until #oms < 1000
  end
  redis.call('SET', P .. 'in:actv', '1')
end
local looked, seen, cands, is_cand, win, walked, allowed = {}, {}, {}, {}, {}, {}, {}
local walks, chats, n_allowed = {}, {}, 0
-- A record, validated: a damaged one is set aside (never an error that blocks the others, nor a
-- record that holds back its chat) and reads, like a gone one, as nil.
local function look(id, via_om, via_chat)
  local c = looked[id]
  if c ~= nil then return c or nil end
  local h = in_read(id, now, via_om, via_chat)
  looked[id] = h or false
  return h
end
local function add_cand(h)
  if not is_cand[h.id] then is_cand[h.id] = true; cands[#cands + 1] = h end
end
-- A record read from a due window. from: 'pending' (via_om is its in:st:pending member), 'timed' or
-- 'owner' (via_om is its member of the incarnation's set own); a mark of a record that is gone, or not
-- due, leaves the window it was read from.
local function consider(id, from, via_om, own)
  if seen[id] then return end
  seen[id] = true
  local h = look(id, via_om)
  if not h then
    if from == 'pending' then redis.call('ZREM', P .. 'in:st:pending', via_om)
    elseif from == 'timed' then redis.call('ZREM', P .. 'in:timed', id)
    else redis.call('ZREM', own, via_om) end
  elseif from == 'owner' and not in_claimable(h, now, o) then
    redis.call('ZREM', own, via_om) -- no longer leased by that incarnation: a stale member
  elseif in_claimable(h, now, o) then
    add_cand(h)
    if not win[id] and not walked[id] then
      win[id] = true
      -- (indexed here when an older version wrote it after the chat index was built)
      redis.call('ZADD', act_key(h.chatId), 'NX', n2s(num(h, 'receivedAt')), h.om)
      local w = walks[h.chatId]
      if not w then
        w = {chat = h.chatId, pos = 0, left = 0, n = 0, done = false}
        walks[h.chatId] = w
        chats[#chats + 1] = w
      end
      w.left = w.left + 1
    end
  elseif from == 'timed' then
    if INM.due[h.state] == 'nextAttemptAt' then redis.call('ZADD', P .. 'in:timed', h.nextAttemptAt or '0', id)
    elseif INM.due[h.state] == 'leaseExpiry' then redis.call('ZADD', P .. 'in:timed', h.leaseExp, id)
    else redis.call('ZREM', P .. 'in:timed', id) end
  end
end
-- Walks a chat's active records in arrival order from its first: the claimable ones met before a
-- record held elsewhere may be taken (up to limit of them); the caller's own live leases and retries
-- not yet due are stepped over. It pauses once past every window candidate of the chat (a later page
-- of the backlog can add one), and stops for good at a holder, at limit, or at the end.
local function walk(w)
  local key = act_key(w.chat)
  while not w.done and w.left > 0 do
    local oms = redis.call('ZRANGE', key, w.pos, w.pos + 15)
    if #oms == 0 then w.done = true; return end
    for _, om in ipairs(oms) do
      local id = string.sub(om, 17)
      local h, stepped = nil, false
      if not walked[id] and looked[id] == nil and own_live(om, w.chat, now, o) then
        stepped = true -- it neither holds the chat nor can be taken
        walked[id] = true
        w.pos = w.pos + 1
        if win[id] then w.left = w.left - 1 end
        if w.left <= 0 then return end
      else
        h = look(id, om, w.chat)
      end
      if stepped then
        -- (stepped over)
      elseif not h or h.om ~= om or h.chatId ~= w.chat or not ACTIVE[h.state] then
        redis.call('ZREM', key, om) -- a stale entry: the later ones move up a rank
      else
        w.pos = w.pos + 1
        if not walked[id] then
          walked[id] = true
          if win[id] then w.left = w.left - 1 end
          if in_holds(h, now, o) then w.done = true; return end
          if in_claimable(h, now, o) then
            add_cand(h)
            allowed[id] = true
            n_allowed = n_allowed + 1
            w.n = w.n + 1
            if w.n >= limit then w.done = true; return end
          end
          if w.left <= 0 then return end
        end
      end
    end
  end
end
local function walk_all() for _, w in ipairs(chats) do walk(w) end end
-- retries and lapsed leases due by now (every one claimable: lapsed leases are, whoever holds them)
for _, id in ipairs(redis.call('ZRANGEBYSCORE', P .. 'in:timed', '-inf', now, 'LIMIT', 0, limit + 1000)) do consider(id, 'timed') end
if o.reclaim then
  -- The owner's other incarnations' sets (one per incarnation: this one's own batches are never read),
  -- the oldest limit records of each, merged in arrival order: each batch reads O(limit) records.
  local incs = P .. 'in:incs:' .. o.owner
  local legacy = P .. 'in:owner:' .. o.owner
  if redis.call('EXISTS', legacy) == 1 then
    -- an older version's set of the owner's leases: moved into the sets by incarnation, once
    for _, id in ipairs(redis.call('SMEMBERS', legacy)) do
      local f = fields(in_key(id), 'state', 'leaseOwner', 'leaseInc', 'receivedAt', 'om')
      local r = tonumber(f[4])
      if f[1] == INM.leased and f[2] == o.owner and type(f[3]) == 'string' and type(f[5]) == 'string'
        and string.sub(f[5], 17) == id and r and r == r and r ~= math.huge and r ~= -math.huge then
        redis.call('ZADD', own_key(o.owner, f[3]), n2s(r), f[5])
        redis.call('SADD', incs, f[3])
      else
        look(id) -- a damaged one is set aside; one no longer leased by the owner is left out
      end
    end
    redis.call('DEL', legacy)
  end
  local light, sets = {}, 0
  for _, inc in ipairs(redis.call('SMEMBERS', incs)) do
    if inc ~= o.inc then
      local own = own_key(o.owner, inc)
      local r = redis.call('ZRANGE', own, 0, limit - 1, 'WITHSCORES')
      if #r == 0 then redis.call('SREM', incs, inc) else sets = sets + 1 end
      for i = 1, #r, 2 do light[#light + 1] = {om = r[i], r = tonumber(r[i + 1]), own = own} end
    end
  end
  -- (one set gives at most limit records, every one of them considered below, and the candidates are sorted
  -- again before they are taken: their order here matters only when several sets give more than limit)
  if sets > 1 then
    table.sort(light, function(a, b)
      if a.r ~= b.r then return a.r < b.r end
      return a.om < b.om
    end)
  end
  local taken = 0
  for _, l in ipairs(light) do
    if taken >= limit then break end
    local id = string.sub(l.om, 17)
    consider(id, 'owner', l.om, l.own)
    if is_cand[id] then taken = taken + 1 end
  end
end
walk_all()
-- Pending records are always due: the backlog in receipt order, the oldest limit of it, then further
-- pages while records of chats held elsewhere leave the batch short (limit + 1000 read at most).
local pkey, start, read, page = P .. 'in:st:pending', 0, 0, limit
while n_allowed < limit and read < limit + 1000 do
  local before = redis.call('ZCARD', pkey)
  local oms = redis.call('ZRANGE', pkey, start, start + page - 1)
  for _, om in ipairs(oms) do consider(string.sub(om, 17), 'pending', om) end
  walk_all()
  read = read + #oms
  if #oms < page then break end
  -- members dropped as stale or set aside moved the later ones up
  start = math.max(0, start + #oms - (before - redis.call('ZCARD', pkey)))
  page = math.max(limit, 100)
end
-- (the sort keys read once per candidate, not once per comparison)
local sort_r, sort_o = {}, {}
for _, h in ipairs(cands) do sort_r[h] = num(h, 'receivedAt'); sort_o[h] = ord_of(h.om) end
local function before(a, b)
  local ra, rb = sort_r[a], sort_r[b]
  if ra ~= rb then return ra < rb end
  return sort_o[a] < sort_o[b]
end
-- (a restart's reclaim finds them in order already: one pass says so)
for i = 2, #cands do
  if not before(cands[i - 1], cands[i]) then
    table.sort(cands, before)
    break
  end
end
local out = {}
for _, h in ipairs(cands) do
  if #out >= limit then break end
  if allowed[h.id] then
    in_claim(h, now, o)
    out[#out + 1] = flat_of(h)
  end
end
return cjson.encode(out)
