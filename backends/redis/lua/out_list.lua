-- botmesh redis script: outbox.list
-- include: outbox list
-- once: no
-- KEYS: [1] a key of the prefix's hash slot
-- ARGV: P, hasChat, chatId, limit, nStates, states…
--

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
