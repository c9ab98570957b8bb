/**
 * The Lua scripts of the Redis backend (`backends/redis.ts`): every
 * transition that touches more than one key is one script, run atomically by
 * the server. They restate the rules of `src/journal_rules.ts` in Lua; the
 * conformance suite keeps both equal.
 *
 * Conventions shared by every script:
 * - `ARGV[1]` is the hash-tagged key prefix (`{botmesh:}`); every key a script
 *   touches starts with it, so all of them live in one slot of a Redis Cluster.
 *   `KEYS[1]` is one such key, so that a cluster client routes the call.
 * - Time is `redis.call('TIME')` (the server's clock), in ms.
 * - A record is a hash whose fields are strings; a `null` field is absent.
 *   Payloads and contents are opaque JSON text that Lua never decodes.
 * - Every script returns ONE string, `cjson.encode` of a table of strings (a
 *   record is its `HGETALL` array). Lua numbers are formatted by `n2s` first,
 *   so nothing numeric goes through cjson. An empty table encodes as `{}`:
 *   the caller reads it as an empty array.
 *
 * @module
 */

const PRELUDE = `
local P = ARGV[1]
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function n2s(x)
  if x == math.floor(x) and x > -1e15 and x < 1e15 then return string.format('%d', x) end
  return string.format('%.17g', x)
end
local function load(key)
  local flat = redis.call('HGETALL', key)
  if #flat == 0 then return nil end
  local h = {}
  for i = 1, #flat, 2 do h[flat[i]] = flat[i + 1] end
  h._key = key
  return h
end
local function num(h, field, default)
  local v = h[field]
  if v == nil or v == false then
    if default ~= nil then return default end
    error({err = 'ERR botmesh: the record at key "' .. h._key .. '" has no field "' .. field .. '"'})
  end
  local n = tonumber(v)
  if n == nil then
    error({err = 'ERR botmesh: the record at key "' .. h._key .. '" has a bad field "' .. field .. '": not a number: ' .. v})
  end
  return n
end
local function save(h, fields)
  local set, del = {}, {}
  for _, f in ipairs(fields) do
    local v = h[f]
    if v == nil or v == false then del[#del + 1] = f else set[#set + 1] = f; set[#set + 1] = v end
  end
  if #set > 0 then redis.call('HSET', h._key, unpack(set)) end
  if #del > 0 then redis.call('HDEL', h._key, unpack(del)) end
end
local function flat(key) return redis.call('HGETALL', key) end
local function opts(i)
  return { owner = ARGV[i], inc = ARGV[i + 1], leaseMs = tonumber(ARGV[i + 2]), reclaim = ARGV[i + 3] == '1' }
end
local function lease(h, o, token, now)
  h.leaseOwner = o.owner; h.leaseInc = o.inc; h.leaseToken = n2s(token); h.leaseExp = n2s(now + o.leaseMs)
end
local function nolease(h) h.leaseOwner = false; h.leaseInc = false; h.leaseToken = false; h.leaseExp = false end
-- isLeaseAbandoned of journal_rules.ts: a lapsed lease is abandoned whoever asks (the holder's own
-- incarnation too: a claim whose reply was lost must not strand the record); a live one only to the
-- owner's other incarnations under reclaimOwn, never to the very incarnation that holds it.
local function abandoned(h, now, o)
  if not h.leaseOwner then return true end
  if num(h, 'leaseExp') <= now then return true end
  if h.leaseOwner == o.owner and h.leaseInc == o.inc then return false end
  return o.reclaim and h.leaseOwner == o.owner
end
-- Validation before the first write (Lua does not roll back): the first problem of a field a
-- transition needs, as text naming the key and the field, or nil.
local function shown(v) if #v > 80 then return string.sub(v, 1, 80) .. '...' end return v end
local function need_str(h, f)
  if type(h[f]) ~= 'string' then return 'the record at key "' .. h._key .. '" has no field "' .. f .. '"' end
end
local function need_num(h, f, optional, int)
  local v = h[f]
  if v == nil or v == false then
    if optional then return nil end
    return 'the record at key "' .. h._key .. '" has no field "' .. f .. '"'
  end
  local n = tonumber(v)
  if n == nil or n ~= n or n == math.huge or n == -math.huge or (int and (n < 0 or n ~= math.floor(n))) then
    return 'the record at key "' .. h._key .. '" has a bad field "' .. f .. '": not a number: ' .. shown(v)
  end
end
local function need_is(h, f, want)
  local p = need_str(h, f)
  if p then return p end
  if h[f] ~= want then
    return 'the record at key "' .. h._key .. '" has a bad field "' .. f .. '": ' .. shown(h[f]) .. ', expected ' .. shown(want)
  end
end
local function need_one(h, f, set)
  local p = need_str(h, f)
  if p then return p end
  if not set[h[f]] then return 'the record at key "' .. h._key .. '" has a bad field "' .. f .. '": ' .. shown(h[f]) end
end
local function assert_ok(problem) if problem then error({err = 'ERR botmesh: ' .. problem}) end end
local QUARANTINED = 'botmesh: quarantined as damaged: '
local LEASE_FIELDS = {'leaseOwner', 'leaseInc', 'leaseToken', 'leaseExp', 'nextAttemptAt'}
local function ord_of(om) return tonumber(string.sub(om, 1, 16)) end
`;

const INBOX = `
local IN_FIELDS = {'id', 'kind', 'chatId', 'provider', 'payload', 'receivedAt', 'state', 'attempts', 'nextAttemptAt',
  'leaseOwner', 'leaseInc', 'leaseToken', 'leaseExp', 'fence', 'error', 'updatedAt', 'om'}
local function in_key(id) return P .. 'in:r:' .. id end
-- The chat's active (pending/processing/failed) records in arrival order: score receivedAt, member om
-- (the zero-padded admission order, then the id), so equal scores sort by admission order.
local function act_key(chat) return P .. 'in:act:' .. chat end
local IN_STATES = {pending = true, processing = true, failed = true, done = true, dead = true}
local ACTIVE = {pending = true, processing = true, failed = true}
-- Every field an inbox transition reads or indexes by (the opaque ones are checked by the caller).
local function in_problem(h, id)
  local p = need_is(h, 'id', id) or need_str(h, 'chatId') or need_one(h, 'state', IN_STATES)
    or need_num(h, 'receivedAt') or need_num(h, 'attempts', false, true) or need_num(h, 'fence', false, true)
    or need_num(h, 'nextAttemptAt', true)
  if p then return p end
  if type(h.om) ~= 'string' or string.sub(h.om, 17) ~= id or not tonumber(string.sub(h.om, 1, 16)) then
    return 'the record at key "' .. h._key .. '" has a bad field "om": ' .. shown(tostring(h.om or '(none)'))
  end
  if h.state == 'processing' then
    return need_str(h, 'leaseOwner') or need_str(h, 'leaseInc') or need_num(h, 'leaseToken', false, true)
      or need_num(h, 'leaseExp')
  end
end
-- A damaged record a due scan reached: out of every index it can be found in, state dead, the
-- problem in its error field. It never blocks the other records; get still names the damage.
local function in_quarantine(id, h, via_om, why, now)
  local om = via_om
  if not om and type(h.om) == 'string' and string.sub(h.om, 17) == id then om = h.om end
  if om then for s, _ in pairs(IN_STATES) do redis.call('ZREM', P .. 'in:st:' .. s, om) end end
  if om and type(h.chatId) == 'string' then redis.call('ZREM', act_key(h.chatId), om) end
  redis.call('ZREM', P .. 'in:timed', id)
  redis.call('ZREM', P .. 'in:done', id)
  if type(h.leaseOwner) == 'string' then redis.call('SREM', P .. 'in:owner:' .. h.leaseOwner, id) end
  redis.call('HSET', h._key, 'state', 'dead', 'error', QUARANTINED .. why, 'updatedAt', n2s(now))
  redis.call('HDEL', h._key, unpack(LEASE_FIELDS))
  if om then
    local score = tonumber(h.receivedAt)
    if score == nil or score ~= score or score == math.huge or score == -math.huge then score = 0 end
    redis.call('ZADD', P .. 'in:st:dead', score, om)
  end
end
local function in_unindex(h)
  redis.call('ZREM', P .. 'in:st:' .. h.state, h.om)
  redis.call('ZREM', P .. 'in:timed', h.id)
  redis.call('ZREM', P .. 'in:done', h.id)
  if h.leaseOwner then redis.call('SREM', P .. 'in:owner:' .. h.leaseOwner, h.id) end
end
local function in_write(h)
  save(h, IN_FIELDS)
  redis.call('ZADD', P .. 'in:st:' .. h.state, h.receivedAt, h.om)
  if ACTIVE[h.state] then
    redis.call('ZADD', act_key(h.chatId), h.receivedAt, h.om)
  else
    redis.call('ZREM', act_key(h.chatId), h.om)
  end
  if h.state == 'failed' then
    redis.call('ZADD', P .. 'in:timed', h.nextAttemptAt or '0', h.id)
  elseif h.state == 'processing' then
    redis.call('ZADD', P .. 'in:timed', h.leaseExp, h.id)
    redis.call('SADD', P .. 'in:owner:' .. h.leaseOwner, h.id)
  elseif h.state == 'done' then
    redis.call('ZADD', P .. 'in:done', h.updatedAt, h.id)
  end
end
-- isInboxClaimable
local function in_claimable(h, now, o)
  local s = h.state
  if s == 'pending' then return true end
  if s == 'failed' then return num(h, 'nextAttemptAt', 0) <= now end
  if s == 'processing' then return abandoned(h, now, o) end
  return false
end
-- claimedInbound
local function in_claim(h, now, o)
  local token = num(h, 'fence') + 1
  local attempts = num(h, 'attempts') + 1
  in_unindex(h)
  h.state = 'processing'; h.attempts = n2s(attempts); h.nextAttemptAt = false
  lease(h, o, token, now); h.fence = n2s(token); h.updatedAt = n2s(now)
  in_write(h)
end
local function in_held(h, token) return h ~= nil and h.state == 'processing' and h.leaseToken == token end
-- holdsChat: processing under a live lease that is neither the caller's own nor reclaimable by it
local function in_holds(h, now, o)
  if h.state ~= 'processing' or not h.leaseOwner then return false end
  if h.leaseOwner == o.owner and h.leaseInc == o.inc then return false end
  return not abandoned(h, now, o)
end
`;

const OUTBOX = `
local OUT_FIELDS = {'key', 'chatId', 'content', 'contentHash', 'inboundId', 'state', 'attempts', 'nextAttemptAt',
  'leaseOwner', 'leaseInc', 'leaseToken', 'leaseExp', 'fence', 'called', 'messageId', 'error', 'seq', 'createdAt',
  'updatedAt'}
local BLOCKING = {queued = true, sending = true, failed = true}
local function out_key(k) return P .. 'out:r:' .. k end
local function open_key(chat) return P .. 'out:open:' .. chat end
local function out_unindex(h)
  redis.call('ZREM', P .. 'out:st:' .. h.state, h.key)
  redis.call('ZREM', P .. 'out:due', h.key)
  redis.call('ZREM', P .. 'out:lease', h.key)
  redis.call('ZREM', P .. 'out:sent', h.key)
  if h.leaseOwner then redis.call('SREM', P .. 'out:owner:' .. h.leaseOwner, h.key) end
end
local function out_write(h)
  save(h, OUT_FIELDS)
  redis.call('ZADD', P .. 'out:st:' .. h.state, h.seq, h.key)
  if BLOCKING[h.state] then
    redis.call('ZADD', open_key(h.chatId), h.seq, h.key)
  else
    redis.call('ZREM', open_key(h.chatId), h.key)
  end
  if h.state == 'sending' then
    redis.call('ZADD', P .. 'out:lease', h.leaseExp, h.key)
    redis.call('SADD', P .. 'out:owner:' .. h.leaseOwner, h.key)
  elseif h.state == 'sent' then
    redis.call('ZADD', P .. 'out:sent', h.updatedAt, h.key)
  end
end
local OUT_STATES = {queued = true, sending = true, sent = true, failed = true, dead = true, unknown = true}
local FLAGS = {['0'] = true, ['1'] = true}
-- The called flag (see OutboxEntry.called): '1' a provider call may have started under the current
-- fence, '0' none did. An entry written before the flag existed has none: read as called.
local function out_called(h) return h.called ~= '0' end
-- Every field an outbox transition reads or indexes by (the opaque ones are checked by the caller).
local function out_problem(h, k)
  local p = need_is(h, 'key', k) or need_str(h, 'chatId') or need_one(h, 'state', OUT_STATES)
    or need_num(h, 'seq', false, true) or need_num(h, 'attempts', false, true) or need_num(h, 'fence', false, true)
    or need_num(h, 'nextAttemptAt', true) or (h.called ~= nil and need_one(h, 'called', FLAGS)) or nil
  if p then return p end
  if h.state == 'sending' then
    return need_str(h, 'leaseOwner') or need_str(h, 'leaseInc') or need_num(h, 'leaseToken', false, true)
      or need_num(h, 'leaseExp')
  end
end
-- The chat's first unsettled entry, when queued or failed, is the one a due scan finds (a damaged
-- one is marked due at once, so that the scan quarantines it and the chat moves on; a missing one
-- is dropped from the chat's open set).
local function sync_head(chat)
  for _ = 1, 100 do
    local head = redis.call('ZRANGE', open_key(chat), 0, 0)[1]
    if not head then return end
    local h = load(out_key(head))
    if h then
      if out_problem(h, head) then
        redis.call('ZADD', P .. 'out:due', 0, head)
      elseif h.state == 'queued' or h.state == 'failed' then
        redis.call('ZADD', P .. 'out:due', h.nextAttemptAt or '0', head)
      end
      return
    end
    redis.call('ZREM', open_key(chat), head)
  end
end
-- A damaged entry a due scan reached: out of every index, state dead (its chat moves on), the
-- problem in its error field; get still names the damage.
local function out_quarantine(k, h, why, now)
  for s, _ in pairs(OUT_STATES) do redis.call('ZREM', P .. 'out:st:' .. s, k) end
  redis.call('ZREM', P .. 'out:due', k)
  redis.call('ZREM', P .. 'out:lease', k)
  redis.call('ZREM', P .. 'out:sent', k)
  if type(h.leaseOwner) == 'string' then redis.call('SREM', P .. 'out:owner:' .. h.leaseOwner, k) end
  local chat = type(h.chatId) == 'string' and h.chatId or nil
  if chat then redis.call('ZREM', open_key(chat), k) end
  redis.call('HSET', h._key, 'state', 'dead', 'error', QUARANTINED .. why, 'updatedAt', n2s(now))
  redis.call('HDEL', h._key, unpack(LEASE_FIELDS))
  local score = tonumber(h.seq)
  if score == nil or score ~= score or score == math.huge or score == -math.huge then score = 0 end
  redis.call('ZADD', P .. 'out:st:dead', score, k)
  if chat then sync_head(chat) end
end
-- claimedOutbox: a lost lease that never announced its call (sending, not called) started no
-- attempt, so the new lease takes its number; a claim starts uncalled, except a lost sending entry
-- that was called (re-leased by resendAmbiguous): its call may still reach the channel.
local function out_claim(h, now, o)
  local token = num(h, 'fence') + 1
  local attempts = num(h, 'attempts')
  local still_called = h.state == 'sending' and out_called(h)
  if h.state ~= 'sending' or out_called(h) then attempts = attempts + 1 end
  out_unindex(h)
  h.state = 'sending'; h.attempts = n2s(attempts); h.nextAttemptAt = false
  lease(h, o, token, now); h.fence = n2s(token); h.called = still_called and '1' or '0'; h.updatedAt = n2s(now)
  out_write(h)
end
local function out_held(h, token) return h ~= nil and h.state == 'sending' and h.leaseToken == token end
-- acceptsOutcome of journal_rules.ts: leased with the token, or unknown with the token still its fence
-- (the late outcome of the call whose lease was taken for lost resolves it)
local function out_resolvable(h, token)
  return out_held(h, token) or (h ~= nil and h.state == 'unknown' and h.fence == token)
end
`;

/** One script: its name (for errors) and full text. */
export interface LuaScript {
  readonly name: string;
  readonly text: string;
  /**
   * Whether the script is run once per request id: the caller passes `KEYS[2]`
   * (`<prefix>rq:<random id>`), and a second run with the same key returns the
   * first run's reply instead of running again. See {@link REQUEST_TTL_MS}.
   */
  readonly once: boolean;
}

/**
 * How long (ms) a mutating script's reply is kept under its request key.
 *
 * A reply can be lost after the server ran the script (a dropped connection),
 * and clients send the same call again: ioredis re-sends unfulfilled commands
 * after a reconnect by default, `@upstash/redis` retries a failed fetch. Run
 * twice, a script would answer differently (an admit `null`, a `markSent`
 * stale although it is sent, a `claimDue` whose records are leased but never
 * returned). So every mutating script is idempotent per call: the caller
 * passes a random request id in `KEYS[2]`; the script returns the reply stored
 * there when there is one, else runs and stores its reply with `SET … PX`.
 *
 * Memory: one key per mutating call, kept this long. Most replies are a few
 * bytes; a `claimDue` reply holds the claimed records (up to `limit`, with
 * their payloads), so a busy bot keeps about two minutes of claimed records a
 * second time. Read-only scripts (get, list, time) and the naturally
 * idempotent session-store writes store nothing.
 */
export const REQUEST_TTL_MS = 120_000;

function script(name: string, parts: string[], body: string, once = false): LuaScript {
  const head = `-- botmesh redis backend: ${name}\n${PRELUDE}${parts.join("")}\n`;
  if (!once) return { name, text: `${head}${body}`, once };
  return {
    name,
    once,
    text: `${head}local RQ = KEYS[2]
if RQ then
  local prev = redis.call('GET', RQ)
  if prev then return prev end
end
local function main()
${body}
end
local reply = main()
if RQ then redis.call('SET', RQ, reply, 'PX', ${REQUEST_TTL_MS}) end
return reply
`,
  };
}

/** The name of a script of {@link SCRIPTS}. */
export type ScriptName =
  | "inAdmit"
  | "inClaim"
  | "inClaimDue"
  | "inHeartbeat"
  | "inFinish"
  | "inReplay"
  | "inPurge"
  | "inGet"
  | "inQuarantine"
  | "inList"
  | "outReserve"
  | "outClaimDue"
  | "outHeartbeat"
  | "outMarkCalling"
  | "outFinish"
  | "outRetry"
  | "outDiscard"
  | "outPurge"
  | "outGet"
  | "outQuarantine"
  | "outList"
  | "storeGet"
  | "storeSet"
  | "storeDelete"
  | "kvGet"
  | "kvSet"
  | "kvDelete"
  | "kvList"
  | "time";

/** The scripts, by operation. */
export const SCRIPTS: { readonly [K in ScriptName]: LuaScript } = {
  // ---- inbox ----------------------------------------------------------------
  /** ARGV: P, id, kind, chatId, provider, payload, receivedAt, leased(0|1), owner, inc, leaseMs */
  inAdmit: script("inbox.admit", [INBOX], `
local id = ARGV[2]
local key = in_key(id)
if redis.call('EXISTS', key) == 1 then return cjson.encode({'exists'}) end
local now = now_ms()
local ord = redis.call('INCR', P .. 'in:ord')
local h = {_key = key, id = id, kind = ARGV[3], chatId = ARGV[4], provider = ARGV[5], payload = ARGV[6],
  receivedAt = ARGV[7], state = 'pending', attempts = '0', fence = '0', updatedAt = n2s(now),
  om = string.format('%016d', ord) .. id}
if ARGV[8] == '1' then
  h.state = 'processing'; h.attempts = '1'; h.fence = '1'; lease(h, opts(9), 1, now)
end
in_write(h)
redis.call('ZADD', P .. 'in:all', h.receivedAt, h.om)
redis.call('ZADD', P .. 'in:chat:' .. h.chatId, h.receivedAt, h.om)
return cjson.encode({'ok', flat(key)})
`, true),
  /** ARGV: P, id, owner, inc, leaseMs, reclaim */
  inClaim: script("inbox.claim", [INBOX], `
local h = load(in_key(ARGV[2]))
if h then assert_ok(in_problem(h, ARGV[2])) end
local now = now_ms()
local o = opts(3)
if not h or not in_claimable(h, now, o) then return cjson.encode({'none'}) end
in_claim(h, now, o)
return cjson.encode({'ok', flat(h._key)})
`, true),
  /**
   * ARGV: P, owner, inc, leaseMs, reclaim, limit. Candidates come from the due windows (lapsed leases
   * and retries, the owner's set under reclaimOwn, the pending backlog); the chat of each is then walked
   * in arrival order (in:act:<chat>, active records only), and a candidate is taken only when the walk
   * reached it before a record held elsewhere (in_holds). The first scan of a key prefix indexes the
   * active records written before the chat index existed (in:actv marks it done).
   */
  inClaimDue: script("inbox.claimDue", [INBOX], `
local o = opts(2)
local limit = tonumber(ARGV[6])
local now = now_ms()
if redis.call('EXISTS', P .. 'in:actv') == 0 then
  for _, s in ipairs({'pending', 'processing', 'failed'}) do
    local start = 0
    repeat
      local oms = redis.call('ZRANGE', P .. 'in:st:' .. s, start, start + 999)
      for _, om in ipairs(oms) do
        local f = redis.call('HMGET', in_key(string.sub(om, 17)), 'chatId', 'receivedAt', 'state', 'om')
        local r = tonumber(f[2])
        -- a damaged record is left out: a scan that reaches it quarantines it
        if type(f[1]) == 'string' and f[3] == s and f[4] == om and r and r == r and r ~= math.huge and r ~= -math.huge then
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
-- A record, validated: a damaged one is quarantined (never an error that blocks the others) and
-- reads, like a gone one, as nil.
local function look(id, via_om)
  local c = looked[id]
  if c ~= nil then return c or nil end
  local h = load(in_key(id))
  if h then
    local problem = in_problem(h, id)
    if problem then in_quarantine(id, h, via_om, problem, now); h = nil end
  end
  looked[id] = h or false
  return h
end
local function add_cand(h)
  if not is_cand[h.id] then is_cand[h.id] = true; cands[#cands + 1] = h end
end
-- A record read from a due window. from: 'pending' (via_om is its in:st:pending member), 'timed' or
-- 'owner'; a mark of a record that is gone, or not due, leaves the window it was read from.
local function consider(id, from, via_om)
  if seen[id] then return end
  seen[id] = true
  local h = look(id, via_om)
  if not h then
    if from == 'pending' then redis.call('ZREM', P .. 'in:st:pending', via_om)
    elseif from == 'timed' then redis.call('ZREM', P .. 'in:timed', id)
    else redis.call('SREM', P .. 'in:owner:' .. o.owner, id) end
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
    if h.state == 'failed' then redis.call('ZADD', P .. 'in:timed', h.nextAttemptAt or '0', id)
    elseif h.state == 'processing' then redis.call('ZADD', P .. 'in:timed', h.leaseExp, id)
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
      local h = look(id, nil)
      if not h or h.om ~= om or h.chatId ~= w.chat or not ACTIVE[h.state] then
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
  -- The owner's set holds every record the owner leases, this very incarnation's too (the batches taken
  -- before this one: never claimable here; a lapsed one is due in in:timed). Read three fields of each,
  -- then the whole record of the oldest only, until limit of them are candidates: a restart's backlog is
  -- taken back in batches, and each batch must not read every record of it again.
  local light = {}
  for _, id in ipairs(redis.call('SMEMBERS', P .. 'in:owner:' .. o.owner)) do
    local f = redis.call('HMGET', in_key(id), 'leaseInc', 'receivedAt', 'om')
    if f[1] ~= o.inc then
      local r, ord = tonumber(f[2]), type(f[3]) == 'string' and ord_of(f[3]) or nil
      if r ~= nil and (r ~= r or r == math.huge or r == -math.huge) then r = nil end
      if ord ~= nil and (ord ~= ord or ord == math.huge or ord == -math.huge) then ord = nil end
      -- unreadable fields sort first: consider() quarantines such a record (or drops a gone one)
      light[#light + 1] = {id = id, bad = (r == nil or ord == nil) and 0 or 1, r = r or 0, ord = ord or 0}
    end
  end
  table.sort(light, function(a, b)
    if a.bad ~= b.bad then return a.bad < b.bad end
    if a.r ~= b.r then return a.r < b.r end
    return a.ord < b.ord
  end)
  local taken = 0
  for _, l in ipairs(light) do
    if taken >= limit then break end
    consider(l.id, 'owner')
    if is_cand[l.id] then taken = taken + 1 end
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
  -- members dropped as stale or quarantined moved the later ones up
  start = math.max(0, start + #oms - (before - redis.call('ZCARD', pkey)))
  page = math.max(limit, 100)
end
table.sort(cands, function(a, b)
  local ra, rb = num(a, 'receivedAt'), num(b, 'receivedAt')
  if ra ~= rb then return ra < rb end
  return ord_of(a.om) < ord_of(b.om)
end)
local out = {}
for _, h in ipairs(cands) do
  if #out >= limit then break end
  if allowed[h.id] then
    in_claim(h, now, o)
    out[#out + 1] = flat(h._key)
  end
end
return cjson.encode(out)
`, true),
  /** ARGV: P, id, token, leaseMs */
  inHeartbeat: script("inbox.heartbeat", [INBOX], `
local h = load(in_key(ARGV[2]))
if not in_held(h, ARGV[3]) then return cjson.encode({'stale'}) end
assert_ok(in_problem(h, ARGV[2]))
h.leaseExp = n2s(now_ms() + tonumber(ARGV[4]))
save(h, {'leaseExp'})
redis.call('ZADD', P .. 'in:timed', h.leaseExp, h.id)
return cjson.encode({'ok'})
`, true),
  /** ARGV: P, id, token, mode (done|dead|retry), error, retryInMs */
  inFinish: script("inbox.finish", [INBOX], `
local h = load(in_key(ARGV[2]))
if not in_held(h, ARGV[3]) then return cjson.encode({'stale'}) end
assert_ok(in_problem(h, ARGV[2]))
local now = now_ms()
local mode = ARGV[4]
in_unindex(h)
h.nextAttemptAt = false
if mode == 'done' then
  h.state = 'done'
elseif mode == 'dead' then
  h.state = 'dead'; h.error = ARGV[5]
else
  h.state = 'failed'; h.error = ARGV[5]; h.nextAttemptAt = n2s(now + math.max(0, tonumber(ARGV[6])))
end
nolease(h); h.updatedAt = n2s(now)
in_write(h)
return cjson.encode({'ok'})
`, true),
  /** ARGV: P, id */
  inReplay: script("inbox.replay", [INBOX], `
local h = load(in_key(ARGV[2]))
if not h or (h.state ~= 'done' and h.state ~= 'failed' and h.state ~= 'dead') then return cjson.encode({'no'}) end
assert_ok(in_problem(h, ARGV[2]))
in_unindex(h)
h.state = 'pending'; h.attempts = '0'; h.nextAttemptAt = false; nolease(h); h.error = false; h.updatedAt = n2s(now_ms())
in_write(h)
return cjson.encode({'ok'})
`, true),
  /** ARGV: P, olderThanMs, batch → [deleted, scanned] */
  inPurge: script("inbox.purge", [INBOX], `
local cutoff = now_ms() - tonumber(ARGV[2])
local ids = redis.call('ZRANGEBYSCORE', P .. 'in:done', '-inf', n2s(cutoff), 'LIMIT', 0, tonumber(ARGV[3]))
local n = 0
for _, id in ipairs(ids) do
  local h = load(in_key(id))
  redis.call('ZREM', P .. 'in:done', id)
  if h and h.state == 'done' and type(h.om) == 'string' and type(h.chatId) == 'string' then
    redis.call('ZREM', P .. 'in:all', h.om)
    redis.call('ZREM', P .. 'in:chat:' .. h.chatId, h.om)
    redis.call('ZREM', P .. 'in:st:done', h.om)
    redis.call('DEL', h._key)
    n = n + 1
  end
end
return cjson.encode({n2s(n), n2s(#ids)})
`, true),
  /** ARGV: P, id */
  inGet: script("inbox.get", [INBOX], `return cjson.encode({flat(in_key(ARGV[2]))})`),
  /** ARGV: P, id, token, why: a record the caller claimed but cannot read → dead (see in_quarantine) */
  inQuarantine: script("inbox.quarantine", [INBOX], `
local h = load(in_key(ARGV[2]))
if not h or h.state ~= 'processing' or h.leaseToken ~= ARGV[3] then return cjson.encode({'no'}) end
in_quarantine(ARGV[2], h, nil, ARGV[4], now_ms())
return cjson.encode({'ok'})
`, true),
  /** ARGV: P, hasChat, chatId, limit, nStates, states… */
  inList: script("inbox.list", [INBOX], `
local limit = tonumber(ARGV[4])
local ns = tonumber(ARGV[5])
local want = nil
if ns > 0 then
  want = {}
  for i = 1, ns do want[ARGV[5 + i]] = true end
end
local out = {}
local function emit(om)
  local f = flat(in_key(string.sub(om, 17)))
  if #f > 0 then out[#out + 1] = f end
end
if ARGV[2] == '1' then
  local zkey = P .. 'in:chat:' .. ARGV[3]
  local start, page = 0, 256
  while #out < limit do
    local oms = redis.call('ZRANGE', zkey, start, start + page - 1)
    for _, om in ipairs(oms) do
      if #out >= limit then break end
      if want == nil then
        emit(om)
      else
        local st = redis.call('HGET', in_key(string.sub(om, 17)), 'state')
        if st and want[st] then emit(om) end
      end
    end
    if #oms < page then break end
    start = start + page
  end
elseif want then
  local all = {}
  for s, _ in pairs(want) do
    local r = redis.call('ZRANGE', P .. 'in:st:' .. s, 0, limit - 1, 'WITHSCORES')
    for i = 1, #r, 2 do all[#all + 1] = {r[i], tonumber(r[i + 1])} end
  end
  table.sort(all, function(a, b)
    if a[2] ~= b[2] then return a[2] < b[2] end
    return ord_of(a[1]) < ord_of(b[1])
  end)
  for i = 1, math.min(limit, #all) do emit(all[i][1]) end
else
  for _, om in ipairs(redis.call('ZRANGE', P .. 'in:all', 0, limit - 1)) do emit(om) end
end
return cjson.encode(out)
`),

  // ---- outbox ---------------------------------------------------------------
  /** ARGV: P, key, chatId, content, contentHash, hasInbound, inboundId, leased(0|1), owner, inc, leaseMs */
  outReserve: script("outbox.reserve", [OUTBOX], `
local key = out_key(ARGV[2])
if redis.call('EXISTS', key) == 1 then return cjson.encode({'exists', flat(key)}) end
local now = now_ms()
local seq = redis.call('INCR', P .. 'out:seq')
local chat = ARGV[3]
local clear = redis.call('ZCARD', open_key(chat)) == 0
local h = {_key = key, key = ARGV[2], chatId = chat, content = ARGV[4], contentHash = ARGV[5],
  inboundId = (ARGV[6] == '1') and ARGV[7] or false, state = 'queued', attempts = '0', nextAttemptAt = n2s(now),
  fence = '0', called = '0', seq = n2s(seq), createdAt = n2s(now), updatedAt = n2s(now)}
local status = 'queued'
if ARGV[8] == '1' and clear then
  h.state = 'sending'; h.attempts = '1'; h.nextAttemptAt = false; h.fence = '1'; lease(h, opts(9), 1, now)
  status = 'leased'
end
out_write(h)
redis.call('ZADD', P .. 'out:all', h.seq, h.key)
redis.call('ZADD', P .. 'out:chat:' .. chat, h.seq, h.key)
sync_head(chat)
return cjson.encode({status, flat(key)})
`, true),
  /** ARGV: P, owner, inc, leaseMs, reclaim, resend, limit → [due, ambiguous] */
  outClaimDue: script("outbox.claimDue", [OUTBOX], `
local o = opts(2)
local resend = ARGV[6] == '1'
local limit = tonumber(ARGV[7])
local now = now_ms()
local due, amb = {}, {}
-- (1) sending entries whose owner lost them: lapsed leases, and the previous incarnation's under reclaimOwn
-- Every entry the scan reads is validated before anything is written: a damaged one is quarantined
-- (never an error that blocks the others); a mark of an entry that is gone or not lapsed leaves the window.
local lost, seen = {}, {}
local function consider(k, windowed)
  if seen[k] then return end
  seen[k] = true
  local h = load(out_key(k))
  if not h then
    if windowed then redis.call('ZREM', P .. 'out:lease', k) else redis.call('SREM', P .. 'out:owner:' .. o.owner, k) end
    return
  end
  local problem = out_problem(h, k)
  if problem then
    out_quarantine(k, h, problem, now)
  elseif h.state == 'sending' and abandoned(h, now, o) then
    lost[#lost + 1] = h
  elseif windowed then
    if h.state == 'sending' then redis.call('ZADD', P .. 'out:lease', h.leaseExp, k) else redis.call('ZREM', P .. 'out:lease', k) end
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
      due[#due + 1] = flat(h._key)
    end
  elseif resend then
    if #due < limit then
      out_claim(h, now, o)
      local f = flat(h._key)
      amb[#amb + 1] = f
      due[#due + 1] = f
    end
  else
    out_unindex(h)
    h.state = 'unknown'; nolease(h); h.nextAttemptAt = false
    if not h.error then h.error = 'the sender was lost during the provider call' end
    h.updatedAt = n2s(now)
    out_write(h)
    sync_head(h.chatId)
    amb[#amb + 1] = flat(h._key)
  end
end
-- (2) due chat heads (including those just freed by step 1); every entry read leaves the range
local page = math.max(limit, 16)
while #due < limit do
  local ks = redis.call('ZRANGEBYSCORE', P .. 'out:due', '-inf', now, 'LIMIT', 0, page)
  local moved = false -- a chat's next entry may have become its head: read the range again
  for _, k in ipairs(ks) do
    if #due >= limit then break end
    local h = load(out_key(k))
    local problem = h and out_problem(h, k)
    local head = h and not problem and redis.call('ZRANGE', open_key(h.chatId), 0, 0)[1]
    if problem then
      out_quarantine(k, h, problem, now)
      moved = true
    elseif h and (h.state == 'queued' or h.state == 'failed') and head == k then
      if num(h, 'nextAttemptAt', 0) <= now then
        out_claim(h, now, o)
        due[#due + 1] = flat(h._key)
      else
        redis.call('ZADD', P .. 'out:due', h.nextAttemptAt, k)
      end
    else
      -- settled, sending, or no longer first in its chat: drop the stale mark
      redis.call('ZREM', P .. 'out:due', k)
      if h then sync_head(h.chatId); moved = true end
    end
  end
  if #ks < page and not moved then break end
end
return cjson.encode({due, amb})
`, true),
  /** ARGV: P, key, token, leaseMs */
  outHeartbeat: script("outbox.heartbeat", [OUTBOX], `
local h = load(out_key(ARGV[2]))
if not out_held(h, ARGV[3]) then return cjson.encode({'stale'}) end
assert_ok(out_problem(h, ARGV[2]))
h.leaseExp = n2s(now_ms() + tonumber(ARGV[4]))
save(h, {'leaseExp'})
redis.call('ZADD', P .. 'out:lease', h.leaseExp, h.key)
return cjson.encode({'ok'})
`, true),
  /**
   * ARGV: P, key, token, leaseMs: heartbeat's check and lease extension, and the called flag set, in
   * one script. Not run once per request id: it is idempotent, and a re-sent call answers for the
   * entry as it is then (a lease lost meanwhile answers false, so no call starts under it).
   */
  outMarkCalling: script("outbox.markCalling", [OUTBOX], `
local h = load(out_key(ARGV[2]))
if not out_held(h, ARGV[3]) then return cjson.encode({'stale'}) end
assert_ok(out_problem(h, ARGV[2]))
h.leaseExp = n2s(now_ms() + tonumber(ARGV[4]))
redis.call('HSET', h._key, 'leaseExp', h.leaseExp, 'called', '1')
redis.call('ZADD', P .. 'out:lease', h.leaseExp, h.key)
return cjson.encode({'ok'})
`),
  /**
   * ARGV: P, key, token, mode (sent|dead|retry|unknown), messageId or error, retryInMs. `unknown` (an
   * ambiguous markFailed) is claimDue's move of a lost send: lease dropped, no next attempt, fence and
   * attempts kept; out_write takes it out of its chat's open set and sync_head marks the next head.
   */
  outFinish: script("outbox.finish", [OUTBOX], `
local h = load(out_key(ARGV[2]))
if not out_resolvable(h, ARGV[3]) then return cjson.encode({'stale'}) end
assert_ok(out_problem(h, ARGV[2]))
local now = now_ms()
local mode = ARGV[4]
out_unindex(h)
h.nextAttemptAt = false
if mode == 'sent' then
  h.state = 'sent'; h.messageId = ARGV[5]
elseif mode == 'dead' then
  h.state = 'dead'; h.error = ARGV[5]
elseif mode == 'unknown' then
  h.state = 'unknown'; h.error = ARGV[5]
else
  h.state = 'failed'; h.error = ARGV[5]; h.nextAttemptAt = n2s(now + math.max(0, tonumber(ARGV[6])))
end
nolease(h); h.updatedAt = n2s(now)
out_write(h)
sync_head(h.chatId)
return cjson.encode({'ok'})
`, true),
  /** ARGV: P, key */
  outRetry: script("outbox.retry", [OUTBOX], `
local h = load(out_key(ARGV[2]))
if not h or (h.state ~= 'dead' and h.state ~= 'failed' and h.state ~= 'unknown') then return cjson.encode({'no'}) end
assert_ok(out_problem(h, ARGV[2]))
local now = now_ms()
out_unindex(h)
h.state = 'queued'; h.nextAttemptAt = n2s(now); h.attempts = '0'; nolease(h); h.updatedAt = n2s(now)
out_write(h)
sync_head(h.chatId)
return cjson.encode({'ok'})
`, true),
  /** ARGV: P, key */
  outDiscard: script("outbox.discard", [OUTBOX], `
local h = load(out_key(ARGV[2]))
if not h or h.state == 'sending' then return cjson.encode({'no'}) end
local problem = out_problem(h, ARGV[2])
if problem then
  -- a damaged entry can still be discarded: out of every index, then deleted
  out_quarantine(ARGV[2], h, problem, now_ms())
  redis.call('ZREM', P .. 'out:st:dead', ARGV[2])
  redis.call('ZREM', P .. 'out:all', ARGV[2])
  if type(h.chatId) == 'string' then redis.call('ZREM', P .. 'out:chat:' .. h.chatId, ARGV[2]) end
  redis.call('DEL', h._key)
  return cjson.encode({'ok'})
end
out_unindex(h)
redis.call('ZREM', open_key(h.chatId), h.key)
redis.call('ZREM', P .. 'out:all', h.key)
redis.call('ZREM', P .. 'out:chat:' .. h.chatId, h.key)
redis.call('DEL', h._key)
sync_head(h.chatId)
return cjson.encode({'ok'})
`, true),
  /** ARGV: P, olderThanMs, batch → [deleted, scanned] */
  outPurge: script("outbox.purge", [OUTBOX], `
local cutoff = now_ms() - tonumber(ARGV[2])
local ks = redis.call('ZRANGEBYSCORE', P .. 'out:sent', '-inf', n2s(cutoff), 'LIMIT', 0, tonumber(ARGV[3]))
local n = 0
for _, k in ipairs(ks) do
  local h = load(out_key(k))
  redis.call('ZREM', P .. 'out:sent', k)
  if h and h.state == 'sent' and type(h.chatId) == 'string' then
    redis.call('ZREM', P .. 'out:all', k)
    redis.call('ZREM', P .. 'out:chat:' .. h.chatId, k)
    redis.call('ZREM', P .. 'out:st:sent', k)
    redis.call('DEL', h._key)
    n = n + 1
  end
end
return cjson.encode({n2s(n), n2s(#ks)})
`, true),
  /** ARGV: P, key */
  outGet: script("outbox.get", [OUTBOX], `return cjson.encode({flat(out_key(ARGV[2]))})`),
  /** ARGV: P, key, fence, why: an entry the caller claimed or resolved but cannot read → dead (see out_quarantine) */
  outQuarantine: script("outbox.quarantine", [OUTBOX], `
local h = load(out_key(ARGV[2]))
if not h or h.fence ~= ARGV[3] or (h.state ~= 'sending' and h.state ~= 'unknown') then return cjson.encode({'no'}) end
out_quarantine(ARGV[2], h, ARGV[4], now_ms())
return cjson.encode({'ok'})
`, true),
  /** ARGV: P, hasChat, chatId, limit, nStates, states… */
  outList: script("outbox.list", [OUTBOX], `
local limit = tonumber(ARGV[4])
local ns = tonumber(ARGV[5])
local want = nil
if ns > 0 then
  want = {}
  for i = 1, ns do want[ARGV[5 + i]] = true end
end
local out = {}
local function emit(k)
  local f = flat(out_key(k))
  if #f > 0 then out[#out + 1] = f end
end
if ARGV[2] == '1' then
  local zkey = P .. 'out:chat:' .. ARGV[3]
  local start, page = 0, 256
  while #out < limit do
    local ks = redis.call('ZRANGE', zkey, start, start + page - 1)
    for _, k in ipairs(ks) do
      if #out >= limit then break end
      if want == nil then
        emit(k)
      else
        local st = redis.call('HGET', out_key(k), 'state')
        if st and want[st] then emit(k) end
      end
    end
    if #ks < page then break end
    start = start + page
  end
elseif want then
  local all = {}
  for s, _ in pairs(want) do
    local r = redis.call('ZRANGE', P .. 'out:st:' .. s, 0, limit - 1, 'WITHSCORES')
    for i = 1, #r, 2 do all[#all + 1] = {r[i], tonumber(r[i + 1])} end
  end
  table.sort(all, function(a, b) return a[2] < b[2] end)
  for i = 1, math.min(limit, #all) do emit(all[i][1]) end
else
  for _, k in ipairs(redis.call('ZRANGE', P .. 'out:all', 0, limit - 1)) do emit(k) end
end
return cjson.encode(out)
`),

  // ---- session store ----------------------------------------------------------
  /** ARGV: P, key */
  storeGet: script("store.get", [], `
local v = redis.call('GET', P .. 's:' .. ARGV[2])
if v then return cjson.encode({v}) end
return cjson.encode({})
`),
  /** ARGV: P, key, value, ttlMs ('' for none) */
  storeSet: script("store.set", [], `
if ARGV[4] == '' then
  redis.call('SET', P .. 's:' .. ARGV[2], ARGV[3])
else
  redis.call('SET', P .. 's:' .. ARGV[2], ARGV[3], 'PX', ARGV[4])
end
return cjson.encode({'ok'})
`),
  /** ARGV: P, key */
  storeDelete: script("store.delete", [], `
redis.call('DEL', P .. 's:' .. ARGV[2])
return cjson.encode({'ok'})
`),

  // ---- kv ---------------------------------------------------------------------
  /** ARGV: P, key → [value, version] or [] */
  kvGet: script("kv.get", [], `
local r = redis.call('HMGET', P .. 'kv:r:' .. ARGV[2], 'v', 'ver')
if not r[1] or not r[2] then return cjson.encode({}) end
return cjson.encode({r[1], r[2]})
`),
  /** ARGV: P, key, value, mode (any|absent|match), expected version → [version] or [] */
  kvSet: script("kv.set", [], `
local k = P .. 'kv:r:' .. ARGV[2]
local cur = redis.call('HGET', k, 'ver')
local mode = ARGV[4]
if mode == 'absent' and cur then return cjson.encode({}) end
if mode == 'match' and cur ~= ARGV[5] then return cjson.encode({}) end
local ver = n2s(redis.call('INCR', P .. 'kv:ver'))
redis.call('HSET', k, 'v', ARGV[3], 'ver', ver)
redis.call('ZADD', P .. 'kv:keys', 0, ARGV[2])
return cjson.encode({ver})
`, true),
  /** ARGV: P, key, hasExpected, expected version → ['1'] or ['0'] */
  kvDelete: script("kv.delete", [], `
local k = P .. 'kv:r:' .. ARGV[2]
local cur = redis.call('HGET', k, 'ver')
if not cur or (ARGV[3] == '1' and cur ~= ARGV[4]) then return cjson.encode({'0'}) end
redis.call('DEL', k)
redis.call('ZREM', P .. 'kv:keys', ARGV[2])
return cjson.encode({'1'})
`, true),
  /** ARGV: P, start bound, prefix, limit (-1: all) → [key, value, version, …] */
  kvList: script("kv.list", [], `
local stop = '+'
if ARGV[3] ~= '' then stop = '[' .. ARGV[3] .. '\\255' end
local keys = redis.call('ZRANGE', P .. 'kv:keys', ARGV[2], stop, 'BYLEX', 'LIMIT', 0, tonumber(ARGV[4]))
local out = {}
for _, key in ipairs(keys) do
  local r = redis.call('HMGET', P .. 'kv:r:' .. key, 'v', 'ver')
  if r[1] and r[2] then
    out[#out + 1] = key; out[#out + 1] = r[1]; out[#out + 1] = r[2]
  end
end
return cjson.encode(out)
`),
  /** ARGV: P → [now] */
  time: script("time", [], `return cjson.encode({n2s(now_ms())})`),
};
