-- botmesh redis include: prelude (first in every script)
-- P (ARGV[1], the key prefix), the slot guard, the script run's time, and the helpers of every script.
--

local P = ARGV[1]
{{SLOT_GUARD}}-- One TIME per script run (a batch of operations shares it: the run is atomic).
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
-- A record's fields (the list of its journal) as a table, made by make from the HMGET reply (a field
-- the hash lacks is false), nil when there is no key. A key of another type reads as a record whose
-- _bad names the problem: a damaged one, set aside like any other; so does a hash without any of the
-- fields. _o: the values as stored, by position in _fields, so that save writes only what changed.
local function load(key, fields, make)
  local r = redis.pcall('HMGET', key, unpack(fields))
  if r.err then return {_key = key, _bad = 'the key "' .. key .. '" holds no hash (' .. r.err .. ')'} end
  local any = false
  for i = 1, #fields do
    if r[i] then any = true; break end
  end
  if not any and redis.call('EXISTS', key) == 0 then return nil end
  local h = make(r)
  h._key = key
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
-- Writes the fields (of the record's list) that differ from the stored ones; a new record (no _o),
-- every one it has.
local function save(h, fields)
  local set, del, o, all = {}, {}, h._o, h._fields
  for k, f in ipairs(fields) do
    local v = h[f]
    if o then
      -- the field's position in the record's list (a save of a few fields looks it up)
      local i = k
      if fields ~= all then
        i = 1
        while all[i] ~= f do
          if i >= #all then error({err = 'ERR botmesh: the field "' .. f .. '" is not one of the record at key "' .. h._key .. '"'}) end
          i = i + 1
        end
      end
      if v == nil or v == false then
        if o[i] then del[#del + 1] = f; o[i] = false end
      elseif o[i] ~= v then
        set[#set + 1] = f; set[#set + 1] = v; o[i] = v
      end
    elseif v ~= nil and v ~= false then
      set[#set + 1] = f; set[#set + 1] = v
    end
  end
  if #set > 0 then redis.call('HSET', h._key, unpack(set)) end
  if #del > 0 then redis.call('HDEL', h._key, unpack(del)) end
  if not o then
    -- a new record is saved whole first: later saves find their fields' places in this list
    o = {}
    for i, f in ipairs(fields) do o[i] = type(h[f]) == 'string' and h[f] or false end
    h._o = o
    h._fields = fields
  end
end
-- A record's move from state ws (nil: a new record) to state s, in the index of each state (<st><state>).
local function restate(st, member, score, s, ws)
  if ws then redis.call('ZREM', st .. ws, member) end
  redis.call('ZADD', st .. s, score, member)
end
-- The same move for the sorted set key that holds the records of some states (kept[state]): the record
-- enters it or leaves it; between two of those states its member and score stay.
local function zkeep(key, member, score, kept, s, ws)
  local is, was = kept[s], ws and kept[ws]
  if is and not was then redis.call('ZADD', key, score, member)
  elseif was and not is then redis.call('ZREM', key, member) end
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
  -- what the journal writes (digits, no leading zero, at most 15: a safe integer) without tonumber
  if #v < 16 and string.find(v, '^[1-9]%d*$') or (v == '0' and kind ~= 'pos') then return nil end
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
-- The constants of the JSON check are literals in the functions' bodies: a script builds every local
-- and closure of its includes on each call, and a literal costs nothing then.
-- json_walk: whether s is one JSON text, read character by character (any depth). string.find skips
-- the plain runs in C.
local function json_walk(s)
  local i, n, depth, stack = 1, #s, 0, {}
  local function skip() i = string.find(s, '[^ \t\n\r]', i) or n + 1 end
  local function str()
    i = i + 1
    while true do
      local j = string.find(s, '["\\%z\1-\31]', i)
      if not j then return false end
      local c = string.byte(s, j)
      if c == 34 then i = j + 1; return true end
      if c ~= 92 then return false end
      local e = string.sub(s, j + 1, j + 1)
      if e == 'u' then
        if not string.find(s, '^%x%x%x%x', j + 2) then return false end
        i = j + 6
      elseif e ~= '' and string.find('"\\/bfnrt', e, 1, true) then
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
-- Whether s is one JSON text as JSON.parse reads it (RFC 8259; any \u escape, a lone surrogate too,
-- and any depth: cjson would refuse both). Read by reductions that run in C (gsub): the escapes of
-- strings, then each string becomes \1 and each literal or number \2, whitespace goes, and the innermost
-- array or object becomes \2 while its members are well formed, until one value is left. A raw control
-- character is JSON nowhere (but whitespace \t \n \r): one in a string leaves its quotes unread, one
-- elsewhere is never reduced, and a text holding a marker is refused first. A text nested deeper than
-- 32 is read by json_walk.
local j_bad = false
-- an escape becomes DEL (\127): a character a string may hold raw, and no literal, number or whitespace may
local function j_escape(c, hex)
  if c == 'u' then
    if #hex == 4 then return '\127' end
  elseif string.find('"\\/bfnrt', c, 1, true) then
    return '\127' .. hex
  end
  j_bad = true
end
local function j_token(t)
  if t == 'true' or t == 'false' or t == 'null' or string.find(t, '^%-?[1-9]%d*$') or t == '0' or t == '-0' then
    return '\2'
  end
  local p = string.match(t, '^%-?0()') or string.match(t, '^%-?[1-9]%d*()')
  if p then
    p = string.match(t, '^%.%d+()', p) or p
    p = string.match(t, '^[eE][%+%-]?%d+()', p) or p
    if p == #t + 1 then return '\2' end
  end
  j_bad = true
end
-- members: one, then ", one" each (the content of an innermost container, its members made one character)
local function j_list(c, one, more)
  if string.sub(c, 1, 1) ~= one then return false end
  return string.gsub(string.sub(c, 2), more, '') == ''
end
local function j_array(c)
  if c == '' or j_list(string.gsub(c, '[\1\2]', 'v'), 'v', ',v') then return '\2' end
  j_bad = true
end
local function j_object(c)
  if c == '' or j_list(string.gsub(c, '\1:[\1\2]', 'm'), 'm', ',m') then return '\2' end
  j_bad = true
end
local function json_reduce(s)
  if string.find(s, '\1', 1, true) or string.find(s, '\2', 1, true) then return false end
  local t = s
  j_bad = false
  if string.find(t, '\\', 1, true) then t = string.gsub(t, '\\(.)(%x?%x?%x?%x?)', j_escape) end
  t = string.gsub(string.gsub(t, '"[^"\\%z\1-\31]*"', '\1'), '[%w%.%+%-]+', j_token)
  if j_bad then return false end
  t = string.gsub(t, '[ \t\n\r]+', '')
  for _ = 1, 32 do
    if t == '\1' or t == '\2' then return true end
    local a, b
    t, a = string.gsub(t, '%[([^%[%]{}]*)%]', j_array)
    t, b = string.gsub(t, '{([^%[%]{}]*)}', j_object)
    if j_bad or a + b == 0 then return false end
  end
  if t == '\1' or t == '\2' then return true end
  return json_walk(s)
end
-- json_ok: whether s is one JSON text as JSON.parse reads it. Most texts are decided by Redis' cjson.decode
-- (C): its parse is strict on structure, strings and escapes, and lenient in three things only, which
-- are checked here: a NUL ends its text, raw control characters pass in strings (a text holding either
-- goes to json_reduce: the strings dropped here hold none, and one that does is left with its quotes),
-- and numbers (strtod: a leading + or zeros, 1., hex, inf, nan), whose tokens, once the strings are
-- dropped, j_token reads as JSON does. A text cjson refuses is decided by json_reduce (JSON.parse takes a
-- lone surrogate escape, or deeper nesting, that cjson does not). That is the cjson Redis and Valkey
-- bundle (lua-cjson); the differential test of json_ok runs on the server the tests use.
local function json_ok(s)
  if string.find(s, '\0', 1, true) or not pcall(cjson.decode, s) then return json_reduce(s) end
  local t = s
  if string.find(t, '\\', 1, true) then t = string.gsub(t, '\\.', '') end
  t = string.gsub(t, '"[^"%c]*"', '')
  if string.find(t, '"', 1, true) then return json_reduce(s) end
  if not string.find(t, '[%w%.%+%-]') then return true end
  j_bad = false
  string.gsub(t, '[%w%.%+%-]+', j_token)
  return not j_bad
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
