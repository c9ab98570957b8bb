/**
 * The Lua scripts of the Redis backend (`backends/redis/`): every
 * transition that touches more than one key is one script, run atomically by
 * the server. They restate the rules of `src/rules.ts` in Lua; the
 * conformance suite keeps both equal.
 *
 * Conventions shared by every script:
 * - `ARGV[1]` is the hash-tagged key prefix (`{botmesh:}`); every key a script
 *   touches starts with it, so all of them live in one slot of a Redis Cluster.
 *   `KEYS[1]` is one such key, so that a cluster client routes the call.
 * - Time is `redis.call('TIME')` (the server's clock), in ms.
 * - A record is a hash whose fields are strings; a `null` field is absent.
 *   Payloads and contents are JSON text that Lua never decodes; it checks
 *   their syntax only (`json_ok`), with every other field the reader checks,
 *   so that a record the reader cannot read is set aside, never claimed.
 * - Every script returns ONE string, `cjson.encode` of a table of strings (a
 *   record is its `HGETALL` array). Lua numbers are formatted by `n2s` first,
 *   so nothing numeric goes through cjson. An empty table encodes as `{}`:
 *   the caller reads it as an empty array.
 *
 * @module
 */
import {
  INBOX as INBOX_TABLE,
  INBOX_STATES,
  luaSet,
  OUTBOX as OUTBOX_TABLE,
  OUTBOX_STATES,
  type StateFlag,
  type StateTable,
  statesWhere,
  theState,
} from "../../src/machine.ts";
import { ACTIVE_INBOX_STATES, BLOCKING_OUTBOX_STATES, TIMER_STATE } from "../../src/rules.ts";

/**
 * A journal's state table as a Lua table, so that the scripts follow it: `leased` the leased state,
 * `due[state]` when a state is due ('always', 'nextAttemptAt', 'leaseExpiry'; nil: never), and the sets
 * `retryable`, `purgeable`, `discardable`, `late` (accepts a late outcome).
 */
function luaMachine<S extends string>(table: StateTable<S>): string {
  const set = (flag: StateFlag) => `{${luaSet(statesWhere(table, flag))}}`;
  const due = statesWhere(table, (t) => t.due !== "never").map((s) => `${s} = '${table[s].due}'`).join(", ");
  return `{leased = '${theState(table, "leased")}', due = {${due}}, retryable = ${set("retryable")}, purgeable = ${
    set("purgeable")
  }, discardable = ${set("discardable")}, late = ${set("acceptsLateOutcome")}}`;
}

/**
 * The first statement of every script (after `P`): in a Redis Cluster, while this node migrates or
 * imports the key prefix's slot (a resharding), some of the prefix's keys are on the other node. A
 * script run there would read a key that is not here as missing (on the importing node, which an
 * `ASK` sends the call to: a record, a lease, an index silently absent), or fail at such a key after
 * its first writes (on the migrating node: "Script attempted to access a non local key", and Lua does
 * not roll back); a key it writes on the importing node makes the operator's MIGRATE of that key fail
 * (BUSYKEY). A two-key EXISTS of keys that never exist fails exactly then (inside a script, Redis
 * refuses it on both nodes) and answers 0 everywhere else (a single server too). So the script answers
 * TRYAGAIN before it reads or writes anything: the client retries (ioredis' Cluster does, after
 * `retryDelayOnTryAgain`; the runner too, see {@link TRYAGAIN_RETRY_MS}), and once the slot is settled
 * on one node the call runs there, on every key.
 */
export function slotGuard(tag: string): string {
  return `do
  local guard = redis.pcall('EXISTS', ${tag} .. 'slot-guard:1', ${tag} .. 'slot-guard:2')
  if type(guard) == 'table' and guard.err then
    return redis.error_reply('TRYAGAIN botmesh: the hash slot of the key prefix ' .. ${tag} ..
      ' is being migrated to or from this node (' .. tostring(guard.err) .. '): the script did nothing; retry')
  end
end
`;
}

const PRELUDE = `
local P = ARGV[1]
${slotGuard("P")}-- One TIME per script run (a batch of operations shares it: the run is atomic).
local NOW
local function now_ms()
  if not NOW then
    local t = redis.call('TIME')
    NOW = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return NOW
end
local function n2s(x)
  if x == math.floor(x) and x > -1e15 and x < 1e15 then return string.format('%d', x) end
  return string.format('%.17g', x)
end
-- A record's hash as a table (nil when absent). A key of another type reads as a record whose _bad
-- names the problem: a damaged one, set aside like any other.
local function load(key)
  local flat = redis.pcall('HGETALL', key)
  if flat.err then return {_key = key, _bad = 'the key "' .. key .. '" holds no hash (' .. flat.err .. ')'} end
  if #flat == 0 then return nil end
  -- _o: the fields as stored, so that save writes only what changed
  local h, o = {}, {}
  for i = 1, #flat, 2 do h[flat[i]] = flat[i + 1]; o[flat[i]] = flat[i + 1] end
  h._key = key
  h._o = o
  return h
end
-- HMGET that reads a key of another type as a hash without the fields.
local function fields(key, ...)
  local r = redis.pcall('HMGET', key, ...)
  if r.err then return {} end
  return r
end
-- A record as its HGETALL array, from the table load made.
local function flat_of(h)
  local f = {}
  for k, v in pairs(h) do
    if type(v) == 'string' and k ~= '_key' and k ~= '_bad' then f[#f + 1] = k; f[#f + 1] = v end
  end
  return f
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
-- Writes the fields that differ from the stored ones (all of them for a new record: no _o).
local function save(h, fields)
  local set, del, o = {}, {}, h._o
  for _, f in ipairs(fields) do
    local v = h[f]
    if v == nil or v == false then
      if o and o[f] ~= nil then del[#del + 1] = f; o[f] = nil end
    elseif not o or o[f] ~= v then
      set[#set + 1] = f; set[#set + 1] = v
      if o then o[f] = v end
    end
  end
  if #set > 0 then redis.call('HSET', h._key, unpack(set)) end
  if #del > 0 then redis.call('HDEL', h._key, unpack(del)) end
  if not o then h._o = {} for _, f in ipairs(fields) do if type(h[f]) == 'string' then h._o[f] = h[f] end end end
end
local function opts(i)
  return { owner = ARGV[i], inc = ARGV[i + 1], leaseMs = tonumber(ARGV[i + 2]), reclaim = ARGV[i + 3] == '1' }
end
local function lease(h, o, token, now)
  h.leaseOwner = o.owner; h.leaseInc = o.inc; h.leaseToken = n2s(token); h.leaseExp = n2s(now + o.leaseMs)
end
local function nolease(h) h.leaseOwner = false; h.leaseInc = false; h.leaseToken = false; h.leaseExp = false end
-- isLeaseAbandoned of rules.ts: a lapsed lease is abandoned whoever asks (the holder's own
-- incarnation too: a claim whose reply was lost must not strand the record); a live one only to the
-- owner's other incarnations under reclaimOwn, never to the very incarnation that holds it.
local function abandoned(h, now, o)
  if not h.leaseOwner then return true end
  if num(h, 'leaseExp') <= now then return true end
  if h.leaseOwner == o.owner and h.leaseInc == o.inc then return false end
  return o.reclaim and h.leaseOwner == o.owner
end
-- Validation before the first write (Lua does not roll back): the first problem of a field a
-- record needs, as text naming the key and the field, or nil. It restates the reader's check
-- (stored_records.ts), so that a record the reader cannot read is never claimed.
local function shown(v) if #v > 80 then return string.sub(v, 1, 80) .. '...' end return v end
local function bad(h, f, what) return 'the record at key "' .. h._key .. '" has a bad field "' .. f .. '": ' .. what end
local function need_str(h, f)
  if type(h[f]) ~= 'string' then return 'the record at key "' .. h._key .. '" has no field "' .. f .. '"' end
end
-- kind: nil (any finite number), 'count' (a safe integer >= 0) or 'pos' (a safe integer > 0)
local function need_num(h, f, optional, kind)
  local v = h[f]
  if v == nil or v == false then
    if optional then return nil end
    return 'the record at key "' .. h._key .. '" has no field "' .. f .. '"'
  end
  local n = tonumber(v)
  if n == nil or n ~= n or n == math.huge or n == -math.huge
    or (kind and (n < (kind == 'pos' and 1 or 0) or n ~= math.floor(n) or n > 9007199254740991)) then
    return bad(h, f, 'not a number: ' .. shown(v))
  end
end
local function need_is(h, f, want)
  local p = need_str(h, f)
  if p then return p end
  if h[f] ~= want then return bad(h, f, shown(h[f]) .. ', expected ' .. shown(want)) end
end
local function need_one(h, f, set)
  local p = need_str(h, f)
  if p then return p end
  if not set[h[f]] then return bad(h, f, shown(h[f])) end
end
-- Whether s is one JSON text as JSON.parse reads it (RFC 8259; any \\u escape, a lone surrogate too,
-- and any depth: cjson would refuse both). string.find skips the plain runs in C.
local STR_STOP = '["' .. string.char(92) .. '%z' .. string.char(1) .. '-' .. string.char(31) .. ']'
local ESCAPES = {['"'] = true, ['/'] = true, b = true, f = true, n = true, r = true, t = true}
ESCAPES[string.char(92)] = true
local function json_ok(s)
  local i, n, depth, stack = 1, #s, 0, {}
  local function skip() i = string.find(s, '[^ \\t\\n\\r]', i) or n + 1 end
  local function str()
    i = i + 1
    while true do
      local j = string.find(s, STR_STOP, i)
      if not j then return false end
      local c = string.byte(s, j)
      if c == 34 then i = j + 1; return true end
      if c ~= 92 then return false end
      local e = string.sub(s, j + 1, j + 1)
      if e == 'u' then
        if not string.find(s, '^%x%x%x%x', j + 2) then return false end
        i = j + 6
      elseif ESCAPES[e] then
        i = j + 2
      else
        return false
      end
    end
  end
  local function digits(j) return string.find(s, '[^0-9]', j) or n + 1 end
  local function number()
    local j = i
    if string.byte(s, j) == 45 then j = j + 1 end
    local c = string.byte(s, j)
    if c == 48 then j = j + 1
    elseif c and c >= 49 and c <= 57 then j = digits(j)
    else return false end
    if string.byte(s, j) == 46 then
      local k = digits(j + 1)
      if k == j + 1 then return false end
      j = k
    end
    c = string.byte(s, j)
    if c == 101 or c == 69 then
      j = j + 1
      c = string.byte(s, j)
      if c == 43 or c == 45 then j = j + 1 end
      local k = digits(j)
      if k == j then return false end
      j = k
    end
    i = j
    return true
  end
  -- an object's next member name and colon
  local function name()
    if string.byte(s, i) ~= 34 or not str() then return false end
    skip()
    if string.byte(s, i) ~= 58 then return false end
    i = i + 1
    skip()
    return true
  end
  skip()
  while true do
    local c, opened = string.byte(s, i), false
    if c == 123 or c == 91 then
      i = i + 1
      skip()
      local close = c == 123 and 125 or 93
      if string.byte(s, i) == close then
        i = i + 1
      else
        if c == 123 and not name() then return false end
        depth = depth + 1
        stack[depth] = close
        opened = true
      end
    elseif c == 34 then
      if not str() then return false end
    elseif c == 116 and string.sub(s, i, i + 3) == 'true' then i = i + 4
    elseif c == 102 and string.sub(s, i, i + 4) == 'false' then i = i + 5
    elseif c == 110 and string.sub(s, i, i + 3) == 'null' then i = i + 4
    elseif not number() then
      return false
    end
    if not opened then
      -- after a value: close containers until a comma asks for the next value
      while true do
        skip()
        if depth == 0 then return i > n end
        c = string.byte(s, i)
        if c == 44 then
          i = i + 1
          skip()
          if stack[depth] == 125 and not name() then return false end
          break
        elseif c == stack[depth] then
          i = i + 1
          depth = depth - 1
        else
          return false
        end
      end
    end
  end
end
local function need_json(h, f)
  local p = need_str(h, f)
  if p then return p end
  if not json_ok(h[f]) then return bad(h, f, 'not JSON: ' .. shown(h[f])) end
end
-- The lease fields: all four in the leased state, none in another (the reader's "lease" field).
local function need_lease(h, leased)
  if h.state == leased then
    local p = need_str(h, 'leaseOwner') or need_str(h, 'leaseInc') or need_num(h, 'leaseToken', false, 'pos')
      or need_num(h, 'leaseExp')
    if p then return p end
    if tonumber(h.leaseToken) > tonumber(h.fence) then return bad(h, 'fence', 'below the lease token ' .. h.leaseToken) end
  elseif h.leaseOwner then
    return bad(h, 'leaseOwner', 'a lease in state "' .. shown(h.state) .. '"')
  end
end
-- An older version marked a damaged record it met dead, the problem in its error field after this:
-- read now as the damaged record it was, and set aside.
local QUARANTINED = 'botmesh: quarantined as damaged: '
local function quarantined(h)
  if h.state == 'dead' and type(h.error) == 'string' and string.sub(h.error, 1, #QUARANTINED) == QUARANTINED then
    return string.sub(h.error, #QUARANTINED + 1)
  end
end
-- Records set aside as damaged, per journal j ('in', 'out'): their hashes are kept as they are;
-- <j>:dmg lists the ids in the order they were set aside (score from the counter <j>:dmgn),
-- <j>:dmgu those not reported yet, <j>:dmg:<id> holds problem, at (server time) and reported (0|1).
-- Whether <j>:dmg exists is read once per run: while none is set aside, no id is looked up.
local ANY_ASIDE = {}
local function is_aside(j, id)
  local any = ANY_ASIDE[j]
  if any == nil then
    any = redis.call('EXISTS', P .. j .. ':dmg') == 1
    ANY_ASIDE[j] = any
  end
  return any and redis.call('ZSCORE', P .. j .. ':dmg', id) ~= false
end
local function put_aside(j, id, problem, now)
  if is_aside(j, id) then return false end
  ANY_ASIDE[j] = true
  local n = redis.call('INCR', P .. j .. ':dmgn')
  redis.call('ZADD', P .. j .. ':dmg', n, id)
  redis.call('ZADD', P .. j .. ':dmgu', n, id)
  redis.call('HSET', P .. j .. ':dmg:' .. id, 'problem', problem, 'at', n2s(now), 'reported', '0')
  return true
end
local function aside_problem(j, id) return redis.call('HGET', P .. j .. ':dmg:' .. id, 'problem') or '' end
local function ord_of(om) return tonumber(string.sub(om, 1, 16)) end
`;

const INBOX = `
local IN_FIELDS = {'id', 'kind', 'chatId', 'provider', 'payload', 'receivedAt', 'state', 'attempts', 'nextAttemptAt',
  'leaseOwner', 'leaseInc', 'leaseToken', 'leaseExp', 'fence', 'error', 'updatedAt', 'om'}
local function in_key(id) return P .. 'in:r:' .. id end
-- The chat's active (pending/processing/failed) records in arrival order: score receivedAt, member om
-- (the zero-padded admission order, then the id), so equal scores sort by admission order.
local function act_key(chat) return P .. 'in:act:' .. chat end
-- The records one incarnation of an owner leases (score receivedAt, member om), for reclaimOwn: a
-- restart takes back its previous incarnations' records batch by batch, reading each one once.
-- in:incs:<owner> lists the incarnations that have such a set. (in:owner:<owner>, one set per
-- owner, is what older versions wrote: moved into these by the first reclaiming scan.)
local function own_key(owner, inc) return P .. 'in:own:' .. #owner .. ':' .. owner .. ':' .. inc end
local IN_STATES = {${luaSet(INBOX_STATES)}}
local INM = ${luaMachine(INBOX_TABLE)}
local ACTIVE = {${luaSet(ACTIVE_INBOX_STATES)}}
local IN_KINDS = {message = true, interaction = true}
-- What is damaged in an inbox record, or nil (every field the reader checks, and the index fields).
local function in_problem(h, id)
  if h._bad then return h._bad end
  local p = need_is(h, 'id', id) or need_one(h, 'kind', IN_KINDS) or need_str(h, 'chatId') or need_str(h, 'provider')
    or need_num(h, 'receivedAt') or need_one(h, 'state', IN_STATES) or need_num(h, 'attempts', false, 'count')
    or need_num(h, 'nextAttemptAt', true) or need_num(h, 'fence', false, 'count') or need_num(h, 'updatedAt')
    or need_lease(h, INM.leased) or quarantined(h)
  if p then return p end
  if type(h.om) ~= 'string' or string.sub(h.om, 17) ~= id or not tonumber(string.sub(h.om, 1, 16)) then
    return bad(h, 'om', shown(tostring(h.om or '(none)')))
  end
  return need_json(h, 'payload')
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
local function in_read(id, now, via_om, via_chat)
  if is_aside('in', id) then return nil end
  local h = load(in_key(id))
  if not h then return nil end
  local problem = in_problem(h, id)
  if problem then
    in_aside(id, h, via_om, via_chat, problem, now)
    return nil
  end
  return h
end
-- Takes a (validated) record out of the indexes of its state; in_write puts it in those of its new one.
local function in_unindex(h)
  redis.call('ZREM', P .. 'in:st:' .. h.state, h.om)
  local due = INM.due[h.state]
  if due == 'nextAttemptAt' or due == 'leaseExpiry' then redis.call('ZREM', P .. 'in:timed', h.id) end
  if INM.purgeable[h.state] then redis.call('ZREM', P .. 'in:done', h.id) end
  if h.leaseOwner then redis.call('ZREM', own_key(h.leaseOwner, h.leaseInc), h.om) end
end
local function in_write(h)
  save(h, IN_FIELDS)
  redis.call('ZADD', P .. 'in:st:' .. h.state, h.receivedAt, h.om)
  if ACTIVE[h.state] then
    redis.call('ZADD', act_key(h.chatId), h.receivedAt, h.om)
  else
    redis.call('ZREM', act_key(h.chatId), h.om)
  end
  if INM.due[h.state] == 'nextAttemptAt' then
    redis.call('ZADD', P .. 'in:timed', h.nextAttemptAt or '0', h.id)
  elseif h.state == INM.leased then
    redis.call('ZADD', P .. 'in:timed', h.leaseExp, h.id)
    redis.call('ZADD', own_key(h.leaseOwner, h.leaseInc), h.receivedAt, h.om)
    redis.call('SADD', P .. 'in:incs:' .. h.leaseOwner, h.leaseInc)
  elseif INM.purgeable[h.state] then
    redis.call('ZADD', P .. 'in:done', h.updatedAt, h.id)
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
  local token = num(h, 'fence') + 1
  in_unindex(h)
  h.state = 'processing'; h.nextAttemptAt = false
  lease(h, o, token, now); h.fence = n2s(token); h.updatedAt = n2s(now)
  in_write(h)
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
`;

const OUTBOX = `
local OUT_FIELDS = {'key', 'chatId', 'content', 'contentHash', 'inboundId', 'state', 'attempts', 'nextAttemptAt',
  'leaseOwner', 'leaseInc', 'leaseToken', 'leaseExp', 'fence', 'called', 'messageId', 'error', 'seq', 'createdAt',
  'updatedAt'}
local BLOCKING = {${luaSet(BLOCKING_OUTBOX_STATES)}}
local OUTM = ${luaMachine(OUTBOX_TABLE)}
local function out_key(k) return P .. 'out:r:' .. k end
local function open_key(chat) return P .. 'out:open:' .. chat end
-- Takes a (validated) entry out of the indexes of its state (a due mark left on an entry that is not
-- queued or failed is stale: due scans drop those).
local function out_unindex(h)
  local s = h.state
  redis.call('ZREM', P .. 'out:st:' .. s, h.key)
  if OUTM.due[s] == 'nextAttemptAt' then redis.call('ZREM', P .. 'out:due', h.key) end
  if s == OUTM.leased then redis.call('ZREM', P .. 'out:lease', h.key) end
  if OUTM.purgeable[s] then redis.call('ZREM', P .. 'out:sent', h.key) end
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
  if h.state == OUTM.leased then
    redis.call('ZADD', P .. 'out:lease', h.leaseExp, h.key)
    redis.call('SADD', P .. 'out:owner:' .. h.leaseOwner, h.key)
  elseif OUTM.purgeable[h.state] then
    redis.call('ZADD', P .. 'out:sent', h.updatedAt, h.key)
  end
end
local OUT_STATES = {${luaSet(OUTBOX_STATES)}}
local FLAGS = {['0'] = true, ['1'] = true}
-- The called flag (see OutboxEntry.called): '1' a provider call may have started under the current
-- fence, '0' none did. An entry written before the flag existed has none: read as called.
local function out_called(h) return h.called ~= '0' end
-- What is damaged in an outbox entry, or nil (every field the reader checks, and the index fields).
local function out_problem(h, k)
  if h._bad then return h._bad end
  return need_is(h, 'key', k) or need_str(h, 'chatId') or need_str(h, 'contentHash') or need_one(h, 'state', OUT_STATES)
    or need_num(h, 'seq', false, 'pos') or need_num(h, 'attempts', false, 'count') or need_num(h, 'fence', false, 'count')
    or need_num(h, 'nextAttemptAt', true) or (h.called ~= nil and need_one(h, 'called', FLAGS)) or need_num(h, 'createdAt')
    or need_num(h, 'updatedAt') or need_lease(h, OUTM.leased) or quarantined(h) or need_json(h, 'content')
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
-- chat moves on unless the caller is sync_head, which does it itself).
local function out_read(k, now, via_chat, syncing)
  if is_aside('out', k) then return nil end
  local h = load(out_key(k))
  if not h then return nil end
  local problem = out_problem(h, k)
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
  local token = num(h, 'fence') + 1
  local attempts = num(h, 'attempts')
  local still_called = h.state == 'sending' and out_called(h)
  if h.state ~= 'sending' or out_called(h) then attempts = attempts + 1 end
  out_unindex(h)
  h.state = 'sending'; h.attempts = n2s(attempts); h.nextAttemptAt = false
  lease(h, o, token, now); h.fence = n2s(token); h.called = still_called and '1' or '0'; h.updatedAt = n2s(now)
  out_write(h)
end
local function out_held(h, token) return h ~= nil and h.state == OUTM.leased and h.leaseToken == token end
-- acceptsOutcome of rules.ts: leased with the token, or unknown with the token still its fence
-- (the late outcome of the call whose lease was taken for lost resolves it)
local function out_resolvable(h, token)
  return out_held(h, token) or (h ~= nil and OUTM.late[h.state] and h.fence == token)
end
`;

const LIST = `
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
`;

const DAMAGED = `
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
  /** The script's own part (without the shared functions), for {@link BATCH}. */
  readonly body: string;
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
 * Memory: one key per mutating call (one per batch call of the hot-path
 * writes, see {@link BATCH}), kept this long. Most replies are a few bytes (an
 * admission or a reservation answers its state and times, not the record;
 * an existing entry that `reserve` finds is the exception); a `claimDue` reply holds the claimed records (up to `limit`, with
 * their payloads), so a busy bot keeps about two minutes of claimed records a
 * second time. The reads (get, list, damaged, time; a get or list that
 * meets a damaged record sets it aside, which a second run finds done) and
 * the naturally idempotent session-store writes store nothing.
 */
export const REQUEST_TTL_MS = 120_000;

function script(name: string, parts: string[], body: string, once = false): LuaScript {
  const head = `-- botmesh redis backend: ${name}\n${PRELUDE}${parts.join("")}\n`;
  if (!once) return { name, text: `${head}${body}`, once, body };
  return {
    name,
    once,
    body,
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
  | "inStart"
  | "inClaim"
  | "inClaimDue"
  | "inHeartbeat"
  | "inFinish"
  | "inReplay"
  | "inPurge"
  | "inGet"
  | "inSetAside"
  | "inList"
  | "inDamaged"
  | "inReportDamaged"
  | "outReserve"
  | "outClaimDue"
  | "outHeartbeat"
  | "outMarkCalling"
  | "outFinish"
  | "outRetry"
  | "outDiscard"
  | "outPurge"
  | "outGet"
  | "outSetAside"
  | "outList"
  | "outDamaged"
  | "outReportDamaged"
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
  /**
   * ARGV: P, id, kind, chatId, provider, payload, receivedAt, leased(0|1), owner, inc, leaseMs
   * → ['ok', state, updatedAt, leaseExp or ''] or ['exists'].
   * Leased, the record is leased only when every active record of its chat that comes first
   * (in:act:<chat> up to its receivedAt: the new one is admitted last, so equal scores come first) admits
   * it (in_admits); the walk stops at the first that does not, and the record is admitted pending.
   */
  inAdmit: script("inbox.admit", [INBOX], `
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
`, true),
  /** ARGV: P, id, owner, inc, leaseMs, reclaim */
  inClaim: script("inbox.claim", [INBOX], `
local now = now_ms()
local h = in_read(ARGV[2], now)
local o = opts(3)
if not h or not in_claimable(h, now, o) then return cjson.encode({'none'}) end
in_claim(h, now, o)
return cjson.encode({'ok', flat_of(h)})
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
  for _, s in ipairs({${ACTIVE_INBOX_STATES.map((s) => `'${s}'`).join(", ")}}) do
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
  local light = {}
  for _, inc in ipairs(redis.call('SMEMBERS', incs)) do
    if inc ~= o.inc then
      local own = own_key(o.owner, inc)
      local r = redis.call('ZRANGE', own, 0, limit - 1, 'WITHSCORES')
      if #r == 0 then redis.call('SREM', incs, inc) end
      for i = 1, #r, 2 do light[#light + 1] = {om = r[i], r = tonumber(r[i + 1]), own = own} end
    end
  end
  table.sort(light, function(a, b)
    if a.r ~= b.r then return a.r < b.r end
    return a.om < b.om
  end)
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
    out[#out + 1] = flat_of(h)
  end
end
return cjson.encode(out)
`, true),
  /** ARGV: P, id, token, leaseMs */
  inHeartbeat: script("inbox.heartbeat", [INBOX], `
local now = now_ms()
local h = in_read(ARGV[2], now)
if not in_held(h, ARGV[3]) then return cjson.encode({'stale'}) end
h.leaseExp = n2s(now + tonumber(ARGV[4]))
save(h, {'leaseExp'})
redis.call('ZADD', P .. 'in:timed', h.leaseExp, h.id)
return cjson.encode({'ok'})
`, true),
  /** ARGV: P, id, token, attempt: startedInbound (attempts max(attempts, attempt)) under the lease */
  inStart: script("inbox.start", [INBOX], `
local now = now_ms()
local h = in_read(ARGV[2], now)
if not in_held(h, ARGV[3]) then return cjson.encode({'stale'}) end
if num(h, 'attempts') < tonumber(ARGV[4]) then
  h.attempts = ARGV[4] -- updatedAt is kept: the lists' indexes are by it, and a run's start changes no state
  save(h, {'attempts'})
end
return cjson.encode({'ok'})
`, true),
  /** ARGV: P, id, token, mode (done|dead|retry|schedule), error, retryInMs (schedule: ms until the timer is due) */
  inFinish: script("inbox.finish", [INBOX], `
local now = now_ms()
local h = in_read(ARGV[2], now)
if not in_held(h, ARGV[3]) then return cjson.encode({'stale'}) end
local mode = ARGV[4]
in_unindex(h)
h.nextAttemptAt = false
if mode == 'done' then
  h.state = 'done'
elseif mode == 'dead' then
  h.state = 'dead'; h.error = ARGV[5]
elseif mode == 'schedule' then
  h.state = '${TIMER_STATE}'; h.error = false; h.nextAttemptAt = n2s(now + math.max(0, tonumber(ARGV[6])))
else
  h.state = 'failed'; h.error = ARGV[5]; h.nextAttemptAt = n2s(now + math.max(0, tonumber(ARGV[6])))
end
nolease(h); h.updatedAt = n2s(now)
in_write(h)
return cjson.encode({'ok'})
`, true),
  /** ARGV: P, id */
  inReplay: script("inbox.replay", [INBOX], `
local now = now_ms()
local h = in_read(ARGV[2], now)
if not h or not INM.retryable[h.state] then return cjson.encode({'no'}) end
in_unindex(h)
h.state = 'pending'; h.attempts = '0'; h.nextAttemptAt = false; nolease(h); h.error = false; h.updatedAt = n2s(now)
in_write(h)
return cjson.encode({'ok'})
`, true),
  /** ARGV: P, olderThanMs, batch → [deleted, scanned] */
  inPurge: script("inbox.purge", [INBOX], `
local now = now_ms()
local cutoff = now - tonumber(ARGV[2])
local ids = redis.call('ZRANGEBYSCORE', P .. 'in:done', '-inf', n2s(cutoff), 'LIMIT', 0, tonumber(ARGV[3]))
local n = 0
for _, id in ipairs(ids) do
  local h = in_read(id, now)
  redis.call('ZREM', P .. 'in:done', id)
  if h and INM.purgeable[h.state] then
    redis.call('ZREM', P .. 'in:all', h.om)
    redis.call('ZREM', P .. 'in:chat:' .. h.chatId, h.om)
    redis.call('ZREM', P .. 'in:st:done', h.om)
    redis.call('DEL', h._key)
    n = n + 1
  end
end
return cjson.encode({n2s(n), n2s(#ids)})
`, true),
  /** ARGV: P, id → ['ok', record], ['aside', problem] (a damaged record is set aside first) or [] */
  inGet: script("inbox.get", [INBOX], `
local id = ARGV[2]
if is_aside('in', id) then return cjson.encode({'aside', aside_problem('in', id)}) end
local h = in_read(id, now_ms())
if h then return cjson.encode({'ok', flat_of(h)}) end
if is_aside('in', id) then return cjson.encode({'aside', aside_problem('in', id)}) end
return cjson.encode({})
`),
  /**
   * ARGV: P, id, problem, fence, updatedAt: sets aside a record the caller read but cannot parse, unless
   * it changed since (its fence or updatedAt field differs from the ones read) → ['ok'|'no'|'changed']
   */
  inSetAside: script("inbox.setAside", [INBOX], `
local h = load(in_key(ARGV[2]))
if not h or is_aside('in', ARGV[2]) then return cjson.encode({'no'}) end
if (h.fence or '') ~= ARGV[4] or (h.updatedAt or '') ~= ARGV[5] then return cjson.encode({'changed'}) end
in_aside(ARGV[2], h, nil, nil, ARGV[3], now_ms())
return cjson.encode({'ok'})
`, true),
  /** ARGV: P, hasChat, chatId, limit, nStates, states… */
  inList: script("inbox.list", [INBOX, LIST], `
local chat, limit, want = list_args()
local now = nil
-- A member (om) of an index: its record when readable and wanted; a damaged one is set aside.
local function read(om, via_chat)
  local id = string.sub(om, 17)
  if want and not is_aside('in', id) then
    -- a record in a known state that is not wanted is not read further
    local st = fields(in_key(id), 'state')[1]
    if st and IN_STATES[st] and not want[st] then return nil end
  end
  now = now or now_ms()
  local h = in_read(id, now, om, via_chat)
  if not h or (chat and h.chatId ~= chat) or (want and not want[h.state]) then return nil end
  return flat_of(h)
end
local zkeys = {}
if chat then
  zkeys[1] = P .. 'in:chat:' .. chat
else
  -- every record is in the set of its state (in:all, which older versions also wrote, is not needed)
  for st, _ in pairs(want or IN_STATES) do zkeys[#zkeys + 1] = P .. 'in:st:' .. st end
end
return cjson.encode(list_scan(zkeys, limit, function(om) return read(om, chat) end))
`),
  /** ARGV: P, unreported(0|1), limit → [id, problem, at, reported, …] */
  inDamaged: script("inbox.damaged", [DAMAGED], `return damaged_list('in')`),
  /** ARGV: P, id → ['ok'] when this call marked it reported, else ['no'] */
  inReportDamaged: script("inbox.reportDamaged", [DAMAGED], `return damaged_report('in')`, true),

  // ---- outbox ---------------------------------------------------------------
  /**
   * ARGV: P, key, chatId, content, contentHash, hasInbound, inboundId, leased(0|1), owner, inc, leaseMs
   * → [leased|queued, seq, createdAt, leaseExp or ''], ['exists', entry] or ['aside', problem]
   */
  outReserve: script("outbox.reserve", [OUTBOX], `
local key = out_key(ARGV[2])
local now = now_ms()
if redis.call('EXISTS', key) == 1 then
  local h = out_read(ARGV[2], now)
  if h then return cjson.encode({'exists', flat_of(h)}) end
  return cjson.encode({'aside', aside_problem('out', ARGV[2])})
end
local seq = redis.call('INCR', P .. 'out:seq')
local chat = ARGV[3]
-- a head that is set aside or damaged leaves the chat's open set first; the new entry comes last
local clear = sync_head(chat, now) == nil
local h = {_key = key, key = ARGV[2], chatId = chat, content = ARGV[4], contentHash = ARGV[5],
  inboundId = (ARGV[6] == '1') and ARGV[7] or false, state = 'queued', attempts = '0', nextAttemptAt = n2s(now),
  fence = '0', called = '0', seq = n2s(seq), createdAt = n2s(now), updatedAt = n2s(now)}
local status = 'queued'
if ARGV[8] == '1' and clear then
  h.state = 'sending'; h.attempts = '1'; h.nextAttemptAt = false; h.fence = '1'; lease(h, opts(9), 1, now)
  status = 'leased'
end
out_write(h)
redis.call('ZADD', P .. 'out:chat:' .. chat, h.seq, h.key)
-- the chat's head is unchanged, or it is the new entry
if clear and h.state == 'queued' then redis.call('ZADD', P .. 'out:due', h.nextAttemptAt, h.key) end
return cjson.encode({status, h.seq, h.createdAt, h.leaseExp or ''})
`, true),
  /** ARGV: P, owner, inc, leaseMs, reclaim, resend, limit → [due, ambiguous] */
  outClaimDue: script("outbox.claimDue", [OUTBOX], `
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
    out_unindex(h)
    h.state = 'unknown'; nolease(h); h.nextAttemptAt = false
    if not h.error then h.error = 'the sender was lost during the provider call' end
    h.updatedAt = n2s(now)
    out_write(h)
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
`, true),
  /** ARGV: P, key, token, leaseMs */
  outHeartbeat: script("outbox.heartbeat", [OUTBOX], `
local now = now_ms()
local h = out_read(ARGV[2], now)
if not out_held(h, ARGV[3]) then return cjson.encode({'stale'}) end
h.leaseExp = n2s(now + tonumber(ARGV[4]))
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
local now = now_ms()
local h = out_read(ARGV[2], now)
if not out_held(h, ARGV[3]) then return cjson.encode({'stale'}) end
h.leaseExp = n2s(now + tonumber(ARGV[4]))
redis.call('HSET', h._key, 'leaseExp', h.leaseExp, 'called', '1')
redis.call('ZADD', P .. 'out:lease', h.leaseExp, h.key)
return cjson.encode({'ok'})
`),
  /**
   * ARGV: P, key, token, mode (sent|dead|retry|throttled|unknown), messageId or error, retryInMs. `unknown`
   * (an ambiguous markFailed) is claimDue's move of a lost send: lease dropped, no next attempt, fence and
   * attempts kept; out_write takes it out of its chat's open set and sync_head marks the next head.
   * `throttled` is a retry that gives its attempt back (a 429: nothing was sent).
   */
  outFinish: script("outbox.finish", [OUTBOX], `
local now = now_ms()
local h = out_read(ARGV[2], now)
if not out_resolvable(h, ARGV[3]) then return cjson.encode({'stale'}) end
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
  if mode == 'throttled' then h.attempts = n2s(math.max(0, num(h, 'attempts') - 1)) end
end
nolease(h); h.updatedAt = n2s(now)
out_write(h)
sync_head(h.chatId, now)
return cjson.encode({'ok'})
`, true),
  /** ARGV: P, key */
  outRetry: script("outbox.retry", [OUTBOX], `
local now = now_ms()
local h = out_read(ARGV[2], now)
if not h or not OUTM.retryable[h.state] then return cjson.encode({'no'}) end
out_unindex(h)
h.state = 'queued'; h.nextAttemptAt = n2s(now); h.attempts = '0'; nolease(h); h.updatedAt = n2s(now)
out_write(h)
sync_head(h.chatId, now)
return cjson.encode({'ok'})
`, true),
  /** ARGV: P, key */
  outDiscard: script("outbox.discard", [OUTBOX], `
local now = now_ms()
local h = out_read(ARGV[2], now)
if not h or not OUTM.discardable[h.state] then return cjson.encode({'no'}) end
out_unindex(h)
redis.call('ZREM', open_key(h.chatId), h.key)
redis.call('ZREM', P .. 'out:all', h.key)
redis.call('ZREM', P .. 'out:chat:' .. h.chatId, h.key)
redis.call('DEL', h._key)
sync_head(h.chatId, now)
return cjson.encode({'ok'})
`, true),
  /** ARGV: P, olderThanMs, batch → [deleted, scanned] */
  outPurge: script("outbox.purge", [OUTBOX], `
local now = now_ms()
local cutoff = now - tonumber(ARGV[2])
local ks = redis.call('ZRANGEBYSCORE', P .. 'out:sent', '-inf', n2s(cutoff), 'LIMIT', 0, tonumber(ARGV[3]))
local n = 0
for _, k in ipairs(ks) do
  local h = out_read(k, now)
  redis.call('ZREM', P .. 'out:sent', k)
  if h and OUTM.purgeable[h.state] then
    redis.call('ZREM', P .. 'out:all', k)
    redis.call('ZREM', P .. 'out:chat:' .. h.chatId, k)
    redis.call('ZREM', P .. 'out:st:sent', k)
    redis.call('DEL', h._key)
    n = n + 1
  end
end
return cjson.encode({n2s(n), n2s(#ks)})
`, true),
  /** ARGV: P, key → ['ok', entry], ['aside', problem] (a damaged entry is set aside first) or [] */
  outGet: script("outbox.get", [OUTBOX], `
local k = ARGV[2]
if is_aside('out', k) then return cjson.encode({'aside', aside_problem('out', k)}) end
local h = out_read(k, now_ms())
if h then return cjson.encode({'ok', flat_of(h)}) end
if is_aside('out', k) then return cjson.encode({'aside', aside_problem('out', k)}) end
return cjson.encode({})
`),
  /**
   * ARGV: P, key, problem, fence, updatedAt: sets aside an entry the caller read but cannot parse, unless
   * it changed since (its fence or updatedAt field differs from the ones read) → ['ok'|'no'|'changed']
   */
  outSetAside: script("outbox.setAside", [OUTBOX], `
local k = ARGV[2]
local h = load(out_key(k))
if not h or is_aside('out', k) then return cjson.encode({'no'}) end
if (h.fence or '') ~= ARGV[4] or (h.updatedAt or '') ~= ARGV[5] then return cjson.encode({'changed'}) end
local now = now_ms()
out_aside(k, h, nil, ARGV[3], now)
if type(h.chatId) == 'string' then sync_head(h.chatId, now) end
return cjson.encode({'ok'})
`, true),
  /** ARGV: P, hasChat, chatId, limit, nStates, states… */
  outList: script("outbox.list", [OUTBOX, LIST], `
local chat, limit, want = list_args()
local now = nil
-- A member (key) of an index: its entry when readable and wanted; a damaged one is set aside.
local function read(k)
  if want and not is_aside('out', k) then
    local st = fields(out_key(k), 'state')[1]
    if st and OUT_STATES[st] and not want[st] then return nil end
  end
  now = now or now_ms()
  local h = out_read(k, now, chat)
  if not h or (chat and h.chatId ~= chat) or (want and not want[h.state]) then return nil end
  return flat_of(h)
end
local zkeys = {}
if chat then
  zkeys[1] = P .. 'out:chat:' .. chat
else
  for st, _ in pairs(want or OUT_STATES) do zkeys[#zkeys + 1] = P .. 'out:st:' .. st end
end
return cjson.encode(list_scan(zkeys, limit, read))
`),
  /** ARGV: P, unreported(0|1), limit → [key, problem, at, reported, …] */
  outDamaged: script("outbox.damaged", [DAMAGED], `return damaged_list('out')`),
  /** ARGV: P, key → ['ok'] when this call marked it reported, else ['no'] */
  outReportDamaged: script("outbox.reportDamaged", [DAMAGED], `return damaged_report('out')`, true),

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

/**
 * The operations {@link BATCH} runs: the writes of the hot path (admission, reply, send, completion,
 * heartbeats). Their scripts need only the inbox and outbox functions, and their replies are small.
 */
export const BATCHED: readonly BatchedName[] = [
  "inAdmit",
  "inStart",
  "inHeartbeat",
  "inFinish",
  "outReserve",
  "outHeartbeat",
  "outMarkCalling",
  "outFinish",
];

/** The name of an operation {@link BATCH} runs. */
export type BatchedName =
  | "inAdmit"
  | "inStart"
  | "inHeartbeat"
  | "inFinish"
  | "outReserve"
  | "outHeartbeat"
  | "outMarkCalling"
  | "outFinish";

/**
 * Several operations in one script call: the writes issued in one turn of the event loop go to Redis
 * together. ARGV: P, then per operation its name, once (0|1: whether it is run once per request, see
 * {@link LuaScript.once}), the number of its arguments, and its arguments (after P). Each operation runs
 * as its own script would, in order, each under `pcall`: one that fails (a script error) answers
 * `{"err": message}` and the others go on, as if each had been its own call. The reply is the JSON array
 * of their replies.
 *
 * Run once per request: with `KEYS[2]` the replies of the `once` operations are stored there (joined by
 * newlines: cjson never writes a raw one), and a second run answers those from it and runs the others
 * (`outbox.markCalling`) again, as a re-sent call of its own script would.
 */
export const BATCH: LuaScript = (() => {
  const ops = BATCHED.map((name) => `  ${name} = function()\n${SCRIPTS[name].body}\n  end,`).join("\n");
  const text = `-- botmesh redis backend: batch
local BATCH = ARGV
local ARGV = {BATCH[1]}
${PRELUDE}${INBOX}${OUTBOX}
local OPS = {
${ops}
}
local RQ = KEYS[2]
local stored = nil
if RQ then
  local prev = redis.call('GET', RQ)
  if prev then
    stored = {}
    for part in string.gmatch(prev, '[^\\n]+') do stored[#stored + 1] = part end
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
    local ok, res = pcall(OPS[name])
    if ok then
      r = res
    else
      r = cjson.encode({err = type(res) == 'table' and tostring(res.err) or tostring(res)})
    end
  end
  out[#out + 1] = r
  if once then keep[#keep + 1] = r end
end
if RQ and not stored then redis.call('SET', RQ, table.concat(keep, '\\n'), 'PX', ${REQUEST_TTL_MS}) end
return '[' .. table.concat(out, ',') .. ']'
`;
  return { name: "batch", text, once: true, body: "" };
})();
