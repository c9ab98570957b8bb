-- botmesh redis include: outbox
-- The outbox entries: keys, fields, indexes, and the rules of src/rules.ts restated (see docs/architecture.md).
--

-- OUT_FIELDS (an entry's fields), OUT_FIELDS_HELD (a held read's: all but the content, see out_read), and
-- the functions that make an entry's table of each (load)
{{OUTBOX_FIELDS}}
local BLOCKING = {{{BLOCKING_OUTBOX_STATES_SET}}}
local OUTM = {{OUTBOX_MACHINE}}
local function out_key(k) return P .. 'out:r:' .. k end
local function open_key(chat) return P .. 'out:open:' .. chat end
-- What out_write needs to know of a (validated) entry before a change: the state and lease it is
-- indexed by. Its seq and chat never change. (A due mark in out:due is set by sync_head, on its chat's
-- head only, and dropped when the entry leaves its state; one left on an entry that is no longer queued
-- or failed is stale: due scans drop those.)
local function out_was(h) return {state = h.state, owner = h.leaseOwner} end
-- Takes a (validated) entry out of the indexes of its state, before it is deleted (discard).
local function out_unindex(h)
  local s = h.state
  redis.call('ZREM', P .. 'out:st:' .. s, h.key)
  if OUTM.due[s] == 'nextAttemptAt' then redis.call('ZREM', P .. 'out:due', h.key) end
  if s == OUTM.leased then redis.call('ZREM', P .. 'out:lease', h.key) end
  if OUTM.purgeable[s] then redis.call('ZREM', P .. 'out:sent', h.key) end
  if h.leaseOwner then redis.call('SREM', P .. 'out:owner:' .. h.leaseOwner, h.key) end
end
-- Saves h and moves it from the indexes of was (out_was before the change; nil: a new entry) to those of
-- its state now, writing only the entries that change.
local function out_write(h, was)
  save(h, h._fields or OUT_FIELDS)
  local s, ws = h.state, was and was.state
  if s ~= ws then
    restate(P .. 'out:st:', h.key, h.seq, s, ws)
    if ws and OUTM.due[ws] == 'nextAttemptAt' then redis.call('ZREM', P .. 'out:due', h.key) end
    zkeep(open_key(h.chatId), h.key, h.seq, BLOCKING, s, ws)
    zkeep(P .. 'out:sent', h.key, h.updatedAt, OUTM.purgeable, s, ws)
  end
  if s == OUTM.leased then
    redis.call('ZADD', P .. 'out:lease', h.leaseExp, h.key)
  elseif ws == OUTM.leased then
    redis.call('ZREM', P .. 'out:lease', h.key)
  end
  local owner = s == OUTM.leased and h.leaseOwner
  local was_owner = was and ws == OUTM.leased and was.owner
  if was_owner and was_owner ~= owner then redis.call('SREM', P .. 'out:owner:' .. was_owner, h.key) end
  if owner and owner ~= was_owner then redis.call('SADD', P .. 'out:owner:' .. owner, h.key) end
end
local OUT_STATES = {{{OUTBOX_STATES_SET}}}
local FLAGS = {['0'] = true, ['1'] = true}
-- The called flag (see OutboxEntry.called): '1' a provider call may have started under the current
-- fence, '0' none did. An entry written before the flag existed has none: read as called.
local function out_called(h) return h.called ~= '0' end
-- What is damaged in an outbox entry, or nil (every field the reader checks, and the index fields; the
-- content unless held: a held read did not load it).
local function out_problem(h, k, held)
  if h._bad then return h._bad end
  return need_is(h, 'key', k) or need_str(h, 'chatId') or need_str(h, 'contentHash') or need_one(h, 'state', OUT_STATES)
    or need_num(h, 'seq', false, 'pos') or need_num(h, 'attempts', false, 'count') or need_num(h, 'fence', false, 'count')
    or need_num(h, 'nextAttemptAt', true) or (h.called and need_one(h, 'called', FLAGS)) or need_num(h, 'createdAt')
    or need_num(h, 'updatedAt') or need_lease(h, OUTM.leased) or quarantined(h) or (not held and need_json(h, 'content')) or nil
end
-- Sets a damaged entry aside (once): its hash stays as it is, and it leaves every index it can be found
-- in (via_chat: the chat it was met by, its chatId field may be the damaged one). The caller moves its
-- chat on (sync_head).
local function out_aside(k, h, via_chat, problem, now)
  if not put_aside('out', k, problem, now) then return end
  for s, _ in pairs(OUT_STATES) do redis.call('ZREM', P .. 'out:st:' .. s, k) end
  for _, z in ipairs({'out:due', 'out:lease', 'out:sent', 'out:all'}) do redis.call('ZREM', P .. z, k) end
  if type(h.leaseOwner) == 'string' then redis.call('SREM', P .. 'out:owner:' .. h.leaseOwner, k) end
  for _, chat in ipairs({via_chat or false, type(h.chatId) == 'string' and h.chatId or false}) do
    if chat then
      redis.call('ZREM', open_key(chat), k)
      redis.call('ZREM', P .. 'out:chat:' .. chat, k)
    end
  end
end
local sync_head
-- The entry of k, or nil when there is none or it is set aside (a damaged one is set aside now, and its
-- chat moves on unless the caller is sync_head, which does it itself). held: a read that hands no content
-- out (the holder's heartbeat, markCalling and outcome) reads every field but the content, and checks
-- those: the reads that hand an entry out (due scans, get, list, a reserve that finds its key) check its
-- content, so a damaged one is never handed out nor leased; sync_head reads a chat's head whole, so that
-- a damaged head is set aside as soon as it is met, and holds no later send of its chat back.
local function out_read(k, now, via_chat, syncing, held)
  if is_aside('out', k) then return nil end
  local h = load(out_key(k), held and OUT_FIELDS_HELD or OUT_FIELDS, held and OUT_FIELDS_HELD_MAKE or OUT_FIELDS_MAKE)
  if not h then return nil end
  local problem = out_problem(h, k, held)
  if problem then
    out_aside(k, h, via_chat, problem, now)
    if not syncing then
      if via_chat then sync_head(via_chat, now) end
      if type(h.chatId) == 'string' and h.chatId ~= via_chat then sync_head(h.chatId, now) end
    end
    return nil
  end
  return h
end
-- The chat's first unsettled entry, when queued or failed, is the one a due scan finds; a head that is
-- gone or set aside leaves the chat's open set (a damaged one is set aside here), and the next one is
-- its head.
-- Returns the head's key, or nil when the chat has no unsettled entry.
sync_head = function(chat, now)
  for _ = 1, 100 do
    local head = redis.call('ZRANGE', open_key(chat), 0, 0)[1]
    if not head then return nil end
    now = now or now_ms()
    local h = out_read(head, now, chat, true)
    if h then
      if OUTM.due[h.state] == 'nextAttemptAt' then
        redis.call('ZADD', P .. 'out:due', h.nextAttemptAt or '0', head)
      end
      return head
    end
    redis.call('ZREM', open_key(chat), head)
  end
  return redis.call('ZRANGE', open_key(chat), 0, 0)[1]
end
-- claimedOutbox: a lost lease that never announced its call (sending, not called) started no
-- attempt, so the new lease takes its number; a claim starts uncalled, except a lost sending entry
-- that was called (re-leased by resendAmbiguous): its call may still reach the channel.
local function out_claim(h, now, o)
  local token = math.max(num(h, 'fence'), {{WRITER_TOKEN}}) + 1 -- claimToken
  local attempts = num(h, 'attempts')
  local still_called = h.state == 'sending' and out_called(h)
  if h.state ~= 'sending' or out_called(h) then attempts = attempts + 1 end
  local was = out_was(h)
  h.state = 'sending'; h.attempts = n2s(attempts); h.nextAttemptAt = false
  lease(h, o, token, now); h.fence = n2s(token); h.called = still_called and '1' or '0'; h.updatedAt = n2s(now)
  out_write(h, was)
end
local function out_held(h, token) return h ~= nil and h.state == OUTM.leased and h.leaseToken == token end
-- acceptsOutcome of rules.ts: leased with the token, or unknown with the token still its fence
-- (the late outcome of the call whose lease was taken for lost resolves it)
local function out_resolvable(h, token)
  return out_held(h, token) or (h ~= nil and OUTM.late[h.state] and h.fence == token)
end
