-- botmesh redis include: inbox
-- The inbox records: keys, fields, indexes, and the rules of src/rules.ts restated (see docs/architecture.md).
--

-- IN_FIELDS (a record's fields), IN_FIELDS_HELD (a held read's: all but the payload, see in_read), and
-- the functions that make a record's table of each (load)
{{INBOX_FIELDS}}
local function in_key(id) return P .. 'in:r:' .. id end
-- The chat's active (pending/processing/failed) records in arrival order: score receivedAt, member om
-- (the zero-padded admission order, then the id), so equal scores sort by admission order.
local function act_key(chat) return P .. 'in:act:' .. chat end
-- The records one incarnation of an owner leases (score receivedAt, member om), for reclaimOwn: a
-- restart takes back its previous incarnations' records batch by batch, reading each one once.
-- in:incs:<owner> lists the incarnations that have such a set. (in:owner:<owner>, one set per
-- owner, is what older versions wrote: moved into these by the first reclaiming scan.)
local function own_key(owner, inc) return P .. 'in:own:' .. #owner .. ':' .. owner .. ':' .. inc end
local IN_STATES = {{{INBOX_STATES_SET}}}
local INM = {{INBOX_MACHINE}}
local ACTIVE = {{{ACTIVE_INBOX_STATES_SET}}}
local IN_KINDS = {message = true, interaction = true}
-- What is damaged in an inbox record, or nil (every field the reader checks, and the index fields; the
-- payload unless held: a held read did not load it).
local function in_problem(h, id, held)
  if h._bad then return h._bad end
  local p = need_is(h, 'id', id) or need_one(h, 'kind', IN_KINDS) or need_str(h, 'chatId') or need_str(h, 'provider')
    or need_num(h, 'receivedAt') or need_one(h, 'state', IN_STATES) or need_num(h, 'attempts', false, 'count')
    or need_num(h, 'nextAttemptAt', true) or need_num(h, 'fence', false, 'count') or need_num(h, 'updatedAt')
    or need_lease(h, INM.leased) or quarantined(h)
  if p then return p end
  if type(h.om) ~= 'string' or string.sub(h.om, 17) ~= id or not tonumber(string.sub(h.om, 1, 16)) then
    return bad(h, 'om', shown(tostring(h.om or '(none)')))
  end
  if not held then return need_json(h, 'payload') end
end
-- Sets a damaged record aside (once): its hash stays as it is, and it leaves every index it can be
-- found in, so that it holds nothing back. via_om and via_chat: the index member and chat it was met
-- by (its own om and chatId fields may be the damaged ones; an index member that is left stale reads
-- as set aside and is dropped when met).
local function in_aside(id, h, via_om, via_chat, problem, now)
  if not put_aside('in', id, problem, now) then return end
  local oms, chats = {}, {}
  if via_om then oms[#oms + 1] = via_om end
  if type(h.om) == 'string' and string.sub(h.om, 17) == id and h.om ~= via_om then oms[#oms + 1] = h.om end
  if via_chat then chats[#chats + 1] = via_chat end
  if type(h.chatId) == 'string' and h.chatId ~= via_chat then chats[#chats + 1] = h.chatId end
  for _, om in ipairs(oms) do
    for s, _ in pairs(IN_STATES) do redis.call('ZREM', P .. 'in:st:' .. s, om) end
    redis.call('ZREM', P .. 'in:all', om)
    for _, chat in ipairs(chats) do
      redis.call('ZREM', P .. 'in:chat:' .. chat, om)
      redis.call('ZREM', act_key(chat), om)
    end
  end
  redis.call('ZREM', P .. 'in:timed', id)
  redis.call('ZREM', P .. 'in:done', id)
  if type(h.leaseOwner) == 'string' then
    redis.call('SREM', P .. 'in:owner:' .. h.leaseOwner, id)
    if type(h.leaseInc) == 'string' then
      for _, om in ipairs(oms) do redis.call('ZREM', own_key(h.leaseOwner, h.leaseInc), om) end
    end
  end
end
-- The record of id, or nil when there is none or it is set aside (a damaged one is set aside now).
-- held: a read that hands no payload out (the holder's start, heartbeat and finish) reads every field
-- but the payload, and checks those: the reads that hand a record out (claims, get, list) check its
-- payload, so a damaged one is never handed out nor leased, and one whose holder (which read it when it
-- took the record) finished it is set aside by the next of those that meets it.
local function in_read(id, now, via_om, via_chat, held)
  if is_aside('in', id) then return nil end
  local h = load(in_key(id), held and IN_FIELDS_HELD or IN_FIELDS, held and IN_FIELDS_HELD_MAKE or IN_FIELDS_MAKE)
  if not h then return nil end
  local problem = in_problem(h, id, held)
  if problem then
    in_aside(id, h, via_om, via_chat, problem, now)
    return nil
  end
  return h
end
-- What in_write needs to know of a (validated) record before a change: the state and lease it is
-- indexed by. Its arrival (receivedAt, om) and chat never change.
local function in_was(h) return {state = h.state, owner = h.leaseOwner, inc = h.leaseInc} end
-- The incarnation this script run last added to its owner's in:incs (a batch of admissions, or a
-- reclaim, adds it once). Only claimDue drops an incarnation from the set, and never the caller's own,
-- the only one a run leases to, so what a run added stays there.
local incs_owner, incs_inc = nil, nil
-- Saves h and moves it from the indexes of was (in_was before the change; nil: a new record) to those of
-- its state now, writing only the entries that change: a lease taken over (a reclaim) stays in its
-- state's and its chat's indexes and moves in in:timed and between incarnations' sets.
local function in_write(h, was)
  save(h, h._fields or IN_FIELDS)
  local s, ws = h.state, was and was.state
  if s ~= ws then
    restate(P .. 'in:st:', h.om, h.receivedAt, s, ws)
    zkeep(act_key(h.chatId), h.om, h.receivedAt, ACTIVE, s, ws)
    zkeep(P .. 'in:done', h.id, h.updatedAt, INM.purgeable, s, ws)
  end
  local due, wdue = INM.due[s], ws and INM.due[ws]
  if due == 'nextAttemptAt' then
    redis.call('ZADD', P .. 'in:timed', h.nextAttemptAt or '0', h.id)
  elseif due == 'leaseExpiry' then
    redis.call('ZADD', P .. 'in:timed', h.leaseExp, h.id)
  elseif wdue == 'nextAttemptAt' or wdue == 'leaseExpiry' then
    redis.call('ZREM', P .. 'in:timed', h.id)
  end
  local owned = s == INM.leased and h.leaseOwner
  local was_owned = was and ws == INM.leased and was.owner
  if was_owned and not (owned and was.owner == h.leaseOwner and was.inc == h.leaseInc) then
    redis.call('ZREM', own_key(was.owner, was.inc), h.om)
  end
  if owned and not (was_owned and was.owner == h.leaseOwner and was.inc == h.leaseInc) then
    redis.call('ZADD', own_key(h.leaseOwner, h.leaseInc), h.receivedAt, h.om)
    if h.leaseOwner ~= incs_owner or h.leaseInc ~= incs_inc then
      redis.call('SADD', P .. 'in:incs:' .. h.leaseOwner, h.leaseInc)
      incs_owner, incs_inc = h.leaseOwner, h.leaseInc
    end
  end
end
-- isInboxClaimable
local function in_claimable(h, now, o)
  local due = INM.due[h.state]
  if due == 'always' then return true end
  if due == 'nextAttemptAt' then return num(h, 'nextAttemptAt', 0) <= now end
  if due == 'leaseExpiry' then return abandoned(h, now, o) end
  return false
end
-- claimedInbound (attempts unchanged: a claim is not a run)
local function in_claim(h, now, o)
  local token = math.max(num(h, 'fence'), {{WRITER_TOKEN}}) + 1 -- claimToken
  local was = in_was(h)
  h.state = 'processing'; h.nextAttemptAt = false
  lease(h, o, token, now); h.fence = n2s(token); h.updatedAt = n2s(now)
  in_write(h, was)
end
local function in_held(h, token) return h ~= nil and h.state == INM.leased and h.leaseToken == token end
-- admitsLeased: whether a record of the chat that comes first lets an admission of the caller (o) lease
-- the new one: a retry not due yet, or the caller's own live lease (same owner and incarnation)
local function in_admits(h, now, o)
  local due = INM.due[h.state]
  if due == 'nextAttemptAt' then return num(h, 'nextAttemptAt', 0) > now end
  if due == 'leaseExpiry' then
    return h.leaseOwner ~= nil and h.leaseOwner ~= false and num(h, 'leaseExp') > now
      and h.leaseOwner == o.owner and h.leaseInc == o.inc
  end
  return due ~= 'always'
end
-- Whether the record of om (a member of chat's in:act) is a live lease of the caller's own incarnation,
-- read from the few fields that say so (no whole record): a walk steps over those, which neither hold
-- the chat nor can be taken, so that a queue of the caller's own leases costs one small read each.
local function own_live(om, chat, now, o)
  local f = fields(in_key(string.sub(om, 17)), 'state', 'leaseOwner', 'leaseInc', 'leaseExp', 'om', 'chatId')
  local exp = tonumber(f[4])
  return f[1] == INM.leased and f[2] == o.owner and f[3] == o.inc and exp ~= nil and exp > now and f[5] == om
    and f[6] == chat
end
-- holdsChat: processing under a live lease that is neither the caller's own nor reclaimable by it
local function in_holds(h, now, o)
  if h.state ~= INM.leased or not h.leaseOwner then return false end
  if h.leaseOwner == o.owner and h.leaseInc == o.inc then return false end
  return not abandoned(h, now, o)
end
