-- botmesh redis script: outbox.claimDue
-- include: outbox
-- once: yes (mutating: answered from KEYS[2], the request id, when run again)
-- KEYS: [1] a key of the prefix's hash slot, [2] the request id (optional)
-- ARGV: P, owner, inc, leaseMs, reclaim, resend, limit → [due, ambiguous]
--

local o = opts(2)
local resend = ARGV[6] == '1'
local limit = tonumber(ARGV[7])
local now = now_ms()
local due, amb = {}, {}
-- (1) sending entries whose owner lost them: lapsed leases, and the previous incarnation's under reclaimOwn
-- Every entry the scan reads is validated before anything is written: a damaged one is set aside
-- (never an error that blocks the others); a mark of an entry that is gone or not lapsed leaves the window.
local lost, seen = {}, {}
local function consider(k, windowed)
  if seen[k] then return end
  seen[k] = true
  local h = out_read(k, now)
  if not h then
    if windowed then redis.call('ZREM', P .. 'out:lease', k) else redis.call('SREM', P .. 'out:owner:' .. o.owner, k) end
    return
  end
  if OUTM.due[h.state] == 'leaseExpiry' and abandoned(h, now, o) then
    lost[#lost + 1] = h
  elseif windowed then
    if OUTM.due[h.state] == 'leaseExpiry' then redis.call('ZADD', P .. 'out:lease', h.leaseExp, k) else redis.call('ZREM', P .. 'out:lease', k) end
  end
end
-- lapsed leases (every one abandoned, this incarnation's own too)
for _, k in ipairs(redis.call('ZRANGEBYSCORE', P .. 'out:lease', '-inf', now, 'LIMIT', 0, 1000)) do consider(k, true) end
if o.reclaim then
  for _, k in ipairs(redis.call('SMEMBERS', P .. 'out:owner:' .. o.owner)) do consider(k, false) end
end
table.sort(lost, function(a, b) return num(a, 'seq') < num(b, 'seq') end)
for _, h in ipairs(lost) do
  if not out_called(h) then
    -- its holder never announced a provider call: nothing was sent, it is due work again (attempts
    -- unchanged, still its chat's head); over the limit it stays sending for a later scan
    if #due < limit then
      out_claim(h, now, o)
      due[#due + 1] = flat_of(h)
    end
  elseif resend then
    if #due < limit then
      out_claim(h, now, o)
      local f = flat_of(h)
      amb[#amb + 1] = f
      due[#due + 1] = f
    end
  else
    local was = out_was(h)
    h.state = 'unknown'; nolease(h); h.nextAttemptAt = false
    if not h.error then h.error = 'the sender was lost during the provider call' end
    h.updatedAt = n2s(now)
    out_write(h, was)
    sync_head(h.chatId, now)
    amb[#amb + 1] = flat_of(h)
  end
end
-- (2) due chat heads (including those just freed by step 1); every entry read leaves the range
local page = math.max(limit, 16)
while #due < limit do
  local ks = redis.call('ZRANGEBYSCORE', P .. 'out:due', '-inf', now, 'LIMIT', 0, page)
  local moved = false -- a chat's next entry may have become its head: read the range again
  for _, k in ipairs(ks) do
    if #due >= limit then break end
    local h = out_read(k, now)
    local head = h and redis.call('ZRANGE', open_key(h.chatId), 0, 0)[1]
    if not h then
      -- gone, or set aside (its chat moved on: read the range again)
      redis.call('ZREM', P .. 'out:due', k)
      moved = true
    elseif OUTM.due[h.state] == 'nextAttemptAt' and head == k then
      if num(h, 'nextAttemptAt', 0) <= now then
        out_claim(h, now, o)
        due[#due + 1] = flat_of(h)
      else
        redis.call('ZADD', P .. 'out:due', h.nextAttemptAt, k)
      end
    else
      -- settled, sending, or no longer first in its chat: drop the stale mark
      redis.call('ZREM', P .. 'out:due', k)
      sync_head(h.chatId, now)
      moved = true
    end
  end
  if #ks < page and not moved then break end
end
return cjson.encode({due, amb})
