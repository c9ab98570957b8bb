-- botmesh redis script: inbox.list
-- include: inbox list
-- once: no
-- KEYS: [1] a key of the prefix's hash slot
-- ARGV: P, hasChat, chatId, limit, nStates, states…
--

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
