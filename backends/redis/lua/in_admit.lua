-- botmesh redis script: inbox.admit
-- include: inbox
-- once: yes (mutating: answered from KEYS[2], the request id, when run again)
-- KEYS: [1] a key of the prefix's hash slot, [2] the request id (optional)
-- ARGV: P, id, kind, chatId, provider, payload, receivedAt, leased(0|1), owner, inc, leaseMs
-- → ['ok', state, updatedAt, leaseExp or ''] or ['exists'].
-- Leased, the record is leased only when every active record of its chat that comes first
-- (in:act:<chat> up to its receivedAt: the new one is admitted last, so equal scores come first) admits
-- it (in_admits); the walk stops at the first that does not, and the record is admitted pending.
--

local id = ARGV[2]
local key = in_key(id)
if redis.call('EXISTS', key) == 1 then return cjson.encode({'exists'}) end
local now = now_ms()
local chat = ARGV[4]
local leased = ARGV[8] == '1'
if leased then
  local o, akey, pos = opts(9), act_key(chat), 0
  while leased do
    local oms = redis.call('ZRANGEBYSCORE', akey, '-inf', ARGV[7], 'LIMIT', pos, 16)
    for _, om in ipairs(oms) do
      local h = nil
      if own_live(om, chat, now, o) then
        h = {om = om, chatId = chat, state = INM.leased, own = true}
      else
        h = in_read(string.sub(om, 17), now, om, chat)
      end
      if not h or h.om ~= om or h.chatId ~= chat or not ACTIVE[h.state] then
        redis.call('ZREM', akey, om) -- set aside, or a stale entry: the later ones move up a rank
      elseif h.own or in_admits(h, now, o) then
        pos = pos + 1
      else
        leased = false
        break
      end
    end
    if #oms < 16 then break end
  end
end
local ord = redis.call('INCR', P .. 'in:ord')
local h = {_key = key, id = id, kind = ARGV[3], chatId = chat, provider = ARGV[5], payload = ARGV[6],
  receivedAt = ARGV[7], state = 'pending', attempts = '0', fence = '0', updatedAt = n2s(now),
  om = string.format('%016d', ord) .. id}
if leased then
  h.state = 'processing'; h.attempts = '1'; h.fence = '1'; lease(h, opts(9), 1, now)
end
in_write(h)
redis.call('ZADD', P .. 'in:chat:' .. h.chatId, h.receivedAt, h.om)
-- the caller has every other field: no copy of the record in the reply (nor under the request key)
return cjson.encode({'ok', h.state, h.updatedAt, h.leaseExp or ''})
