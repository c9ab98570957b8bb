-- botmesh redis script: outbox.reserve
-- include: outbox
-- once: yes (mutating: answered from KEYS[2], the request id, when run again)
-- KEYS: [1] a key of the prefix's hash slot, [2] the request id (optional)
-- ARGV: P, key, chatId, content, contentHash, hasInbound, inboundId, leased(0|1), owner, inc, leaseMs, reclaim,
--   calling(0|1: a leased entry is written with its call announced, called = '1'; newOutboxEntry of rules.ts)
-- → [leased|queued, seq, createdAt, leaseExp or ''], ['exists', entry] or ['aside', problem]
--

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
  if ARGV[13] == '1' then h.called = '1' end
  status = 'leased'
end
out_write(h)
redis.call('ZADD', P .. 'out:chat:' .. chat, h.seq, h.key)
-- the chat's head is unchanged, or it is the new entry
if clear and h.state == 'queued' then redis.call('ZADD', P .. 'out:due', h.nextAttemptAt, h.key) end
return cjson.encode({status, h.seq, h.createdAt, h.leaseExp or '', h.called})
