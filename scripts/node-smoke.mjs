// Smoke test of the npm build on plain Node (run `npm run build` first).
// Drives one bot end to end through dist/, including a redelivered message.
import assert from 'node:assert/strict'
import { Bot, MemoryDurability } from '../dist/mod.js'
import { MockProvider } from '../dist/testing.js'

const provider = new MockProvider()
const bot = new Bot({ provider, durability: { backend: new MemoryDurability(), instanceId: 'smoke' } })
bot.when(/hi/, (ctx) => ctx.reply('hello'))

await bot.start()
await provider.receive({ id: 'm1', chatId: 'c1', text: 'hi' })
await provider.receive({ id: 'm1', chatId: 'c1', text: 'hi' }) // redelivery: dropped
await bot.idle()

assert.equal(provider.sent.length, 1, `expected exactly one send, got ${JSON.stringify(provider.sent)}`)
const [sent] = provider.sent
assert.equal(sent.chatId, 'c1')
assert.equal(sent.content, 'hello')
assert.equal(sent.idempotencyKey, 'm1:1')
assert.ok(sent.messageId !== undefined && sent.messageId !== null && sent.messageId !== '', 'send has a messageId')
assert.equal(bot.durability.metrics().inboundDuplicates, 1)

await bot.stop()
console.log(`node-smoke: ok on Node ${process.version}`)

// The file backend through the npm build: journal, restart from disk, the lock.
{
  const { FileDurability } = await import('../dist/backends/file/mod.js')
  const { mkdtempSync, rmSync, existsSync } = await import('node:fs')
  const { tmpdir } = await import('node:os')
  const { join } = await import('node:path')
  const dir = mkdtempSync(join(tmpdir(), 'botmesh-node-smoke-'))
  try {
    const path = join(dir, 'bot.json')
    const provider = new MockProvider()
    const bot = new Bot({ provider, durability: { backend: new FileDurability({ path }), instanceId: 'smoke-file' } })
    bot.when(/hi/, (ctx) => ctx.reply('hello from file'))
    await bot.start()
    assert.ok(existsSync(`${path}.lock`), 'the lock file exists while the bot runs')
    await provider.receive({ id: 'f1', chatId: 'c1', text: 'hi' })
    await bot.idle()
    await bot.stop()
    assert.ok(!existsSync(`${path}.lock`), 'the lock file is gone after stop()')
    const reopened = new FileDurability({ path })
    await reopened.open()
    assert.equal((await reopened.inbox.get('f1'))?.state, 'done')
    assert.equal((await reopened.outbox.get('f1:1'))?.state, 'sent')
    await reopened.close()
  } finally {
    rmSync(dir, { recursive: true, force: true })
  }
}
console.log('node-smoke: file backend ok')

// The shared backends through the npm build, on the real servers (skipped when one is not
// reachable, unless BOTMESH_REQUIRE_SERVICES=1 as in CI).
{
  const { connect } = await import('node:net')
  const reachable = (port) => new Promise((resolve) => {
    const s = connect({ host: '127.0.0.1', port })
    const done = (ok) => { s.destroy(); resolve(ok) }
    s.setTimeout(1000, () => done(false))
    s.once('connect', () => done(true))
    s.once('error', () => done(false))
  })
  const required = process.env.BOTMESH_REQUIRE_SERVICES === '1'
  const id = Math.random().toString(36).slice(2, 10)
  const roundTrip = async (name, backend) => {
    const provider = new MockProvider()
    const bot = new Bot({ provider, durability: { backend, instanceId: `smoke-${name}` } })
    bot.when(/hi/, (ctx) => ctx.reply(`hello from ${name}`))
    await bot.start()
    await provider.receive({ id: 'p1', chatId: 'c1', text: 'hi' })
    await provider.receive({ id: 'p1', chatId: 'c1', text: 'hi' })
    await bot.idle()
    await bot.stop()
    assert.deepEqual(provider.sent.map((s) => s.content), [`hello from ${name}`])
    assert.equal((await backend.inbox.get('p1'))?.state, 'done')
    assert.equal((await backend.outbox.get('p1:1'))?.state, 'sent')
    console.log(`node-smoke: ${name} backend ok`)
  }
  if (await reachable(5432)) {
    const { default: postgres } = await import('postgres')
    const { PostgresDurability } = await import('../dist/backends/postgres/mod.js')
    const sql = postgres('postgres://postgres@127.0.0.1:5432/test', { max: 4, onnotice: () => {}, fetch_types: false })
    const schema = `bm_smoke_${id}`
    try {
      await roundTrip('postgres', new PostgresDurability({ sql, schema }))
    } finally {
      await sql.unsafe(`DROP SCHEMA IF EXISTS "${schema}" CASCADE`)
      await sql.end()
    }
  } else if (required) throw new Error('BOTMESH_REQUIRE_SERVICES=1 but postgres is not reachable')
  else console.warn('node-smoke: postgres not reachable, skipped')
  if (await reachable(6379)) {
    const { default: IORedis } = await import('ioredis')
    const { RedisDurability } = await import('../dist/backends/redis/mod.js')
    const client = new IORedis('redis://127.0.0.1:6379')
    const keyPrefix = `bm-smoke-${id}:`
    try {
      await roundTrip('redis', new RedisDurability({ client, keyPrefix }))
    } finally {
      const keys = await client.keys(`{${keyPrefix}}*`)
      if (keys.length) await client.del(...keys)
      client.disconnect()
    }
  } else if (required) throw new Error('BOTMESH_REQUIRE_SERVICES=1 but redis is not reachable')
  else console.warn('node-smoke: redis not reachable, skipped')
}

// The channel providers through the npm build, with Web Crypto and fetch of Node itself: an update in
// through each webhook handler, the reply out through an injected fetch.
{
  const { TelegramProvider } = await import('../dist/providers/telegram/mod.js')
  const calls = []
  const telegram = new TelegramProvider({
    token: '123:abc',
    secretToken: 'smoke-secret',
    fetch: async (url, init) => {
      calls.push({ url: String(url), body: JSON.parse(init.body) })
      return Response.json({ ok: true, result: { message_id: 77, date: 1, chat: { id: 5, type: 'private' } } })
    },
  })
  const bot = new Bot({ provider: telegram, durability: { backend: new MemoryDurability(), instanceId: 'smoke-tg' } })
  bot.when(/ping/, (ctx) => ctx.reply('pong'))
  await bot.start()
  const update = { update_id: 1, message: { message_id: 1, date: 1, chat: { id: 5, type: 'private' }, text: 'ping' } }
  const post = (secret) => telegram.webhook(new Request('http://smoke/', {
    method: 'POST',
    headers: { 'content-type': 'application/json', 'x-telegram-bot-api-secret-token': secret },
    body: JSON.stringify(update),
  }))
  assert.equal((await post('wrong')).status, 401)
  assert.equal((await post('smoke-secret')).status, 200)
  assert.equal((await post('smoke-secret')).status, 200) // a redelivery: dropped
  await bot.idle()
  assert.deepEqual(calls.map((c) => [c.url, c.body.chat_id, c.body.text]), [['https://api.telegram.org/bot123:abc/sendMessage', '5', 'pong']])
  assert.equal((await bot.durability.outbox.get('tg:123:1:5:1:1')).messageId, '77')
  await bot.stop()
  console.log('node-smoke: telegram provider ok')
}
{
  const { WhatsAppProvider } = await import('../dist/providers/whatsapp/mod.js')
  const { createHmac } = await import('node:crypto')
  const calls = []
  const whatsapp = new WhatsAppProvider({
    accessToken: 'token',
    phoneNumberId: '1001',
    appSecret: 'app-secret',
    verifyToken: 'verify-me',
    fetch: async (url, init) => {
      calls.push({ url: String(url), body: JSON.parse(init.body) })
      return Response.json({ messaging_product: 'whatsapp', messages: [{ id: 'wamid.OUT1' }] })
    },
  })
  const bot = new Bot({ provider: whatsapp, durability: { backend: new MemoryDurability(), instanceId: 'smoke-wa' } })
  bot.when(/ping/, (ctx) => ctx.reply('pong'))
  await bot.start()
  const verify = await whatsapp.webhook(new Request('http://smoke/?hub.mode=subscribe&hub.verify_token=verify-me&hub.challenge=42'))
  assert.equal(await verify.text(), '42')
  const body = JSON.stringify({
    object: 'whatsapp_business_account',
    entry: [{ id: 'waba', changes: [{ field: 'messages', value: {
      messaging_product: 'whatsapp',
      metadata: { display_phone_number: '15550001', phone_number_id: '1001' },
      messages: [{ id: 'wamid.IN1', from: '4917', timestamp: '1700000000', type: 'text', text: { body: 'ping' } }],
    } }] }],
  })
  const signature = `sha256=${createHmac('sha256', 'app-secret').update(body).digest('hex')}`
  const post = (sig) => whatsapp.webhook(new Request('http://smoke/', { method: 'POST', headers: { 'content-type': 'application/json', 'x-hub-signature-256': sig }, body }))
  assert.equal((await post('sha256=00')).status, 401)
  assert.equal((await post(signature)).status, 200)
  await bot.idle()
  assert.equal(calls.length, 1)
  assert.equal(calls[0].body.to, '4917')
  assert.equal(calls[0].body.text.body, 'pong')
  assert.equal((await bot.durability.outbox.get('wamid.IN1:1')).messageId, 'wamid.OUT1')
  await bot.stop()
  console.log('node-smoke: whatsapp provider ok')
}

// A grammY bot made durable through the npm build: webhook (std/http adapter), keys from Node's
// AsyncLocalStorage, a redelivery dropped, an edit passed straight through.
{
  const { Bot: GrammyBot, webhookCallback } = await import('grammy')
  const { durable } = await import('../dist/providers/grammy/mod.js')
  const calls = []
  let nextId = 0
  const bot = new GrammyBot('123456:smoke', {
    botInfo: { id: 123456, is_bot: true, first_name: 'Smoke', username: 'smoke_bot' },
    client: {
      fetch: async (url, init) => {
        const method = String(url).split('/').pop()
        calls.push({ method, body: JSON.parse(init.body) })
        return Response.json({ ok: true, result: method === 'sendMessage' ? { message_id: ++nextId, date: 0, chat: { id: 42, type: 'private' }, text: JSON.parse(init.body).text } : true })
      },
    },
  })
  bot.on('message:text', async (ctx) => {
    const sent = await ctx.reply(`echo ${ctx.message.text}`)
    await ctx.api.editMessageText(ctx.chat.id, sent.message_id, `echo ${ctx.message.text}!`)
  })
  const safe = durable(bot, { durability: { backend: new MemoryDurability(), instanceId: 'smoke-grammy' } })
  await safe.start()
  const handle = webhookCallback(bot, 'std/http')
  const update = { update_id: 7, message: { message_id: 3, date: 0, chat: { id: 42, type: 'private' }, text: 'hi' } }
  const post = () => handle(new Request('http://smoke/', { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(update) }))
  assert.equal((await post()).status, 200)
  assert.equal((await post()).status, 200) // a redelivery
  await safe.idle()
  assert.deepEqual(calls.map((c) => c.method), ['sendMessage', 'editMessageText'])
  assert.deepEqual((await safe.durability.outbox.list()).map((e) => e.key), ['tg:123456:7:42:3:1'])
  await safe.stop()
  console.log('node-smoke: grammY plugin ok')
}

// A Telegraf bot made durable through the npm build: Telegraf's webhookCallback on node:http, its calls
// to a Bot API on node:http, keys from Node's AsyncLocalStorage, a redelivery dropped, an edit passed
// straight through.
{
  const { createServer } = await import('node:http')
  const { Telegraf } = await import('telegraf')
  const { durable } = await import('../dist/providers/telegraf/mod.js')
  const listen = async (server) => {
    await new Promise((resolve) => server.listen(0, '127.0.0.1', resolve))
    return `http://127.0.0.1:${server.address().port}`
  }
  const calls = []
  let nextId = 0
  const api = createServer(async (req, res) => {
    let body = ''
    for await (const chunk of req) body += chunk
    const method = String(req.url).split('/').pop()
    const params = body === '' ? {} : JSON.parse(body)
    calls.push({ method, params })
    const result = method === 'getMe'
      ? { id: 123456, is_bot: true, first_name: 'Smoke', username: 'smoke_bot' }
      : method === 'sendMessage' ? { message_id: ++nextId, date: 0, chat: { id: 42, type: 'private' }, text: params.text } : true
    res.writeHead(200, { 'content-type': 'application/json' })
    res.end(JSON.stringify({ ok: true, result }))
  })
  const bot = new Telegraf('123456:smoke', { telegram: { apiRoot: await listen(api) } })
  bot.on('text', async (ctx) => {
    const sent = await ctx.reply(`echo ${ctx.message.text}`)
    await ctx.telegram.editMessageText(ctx.chat.id, sent.message_id, undefined, `echo ${ctx.message.text}!`)
  })
  const safe = durable(bot, { durability: { backend: new MemoryDurability(), instanceId: 'smoke-telegraf' } })
  await safe.start()
  const hook = createServer(bot.webhookCallback('/'))
  const url = await listen(hook)
  const update = { update_id: 7, message: { message_id: 3, date: 0, chat: { id: 42, type: 'private' }, text: 'hi' } }
  const post = () => fetch(url, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(update) })
  assert.equal((await post()).status, 200)
  assert.equal((await post()).status, 200) // a redelivery
  await safe.idle()
  assert.deepEqual(calls.map((c) => c.method), ['getMe', 'sendMessage', 'editMessageText'])
  assert.deepEqual((await safe.durability.outbox.list()).map((e) => e.key), ['tg:123456:7:42:3:1'])
  await safe.stop()
  hook.close()
  api.close()
  console.log('node-smoke: Telegraf plugin ok')
}

// A BuilderBot bot on DurableMetaProvider through the npm build: the webhook on BuilderBot's own Polka
// server (bot.httpServer), signed POSTs, the Graph API on node:http, a capture flow, a redelivery dropped.
{
  const { createServer } = await import('node:http')
  const { createHmac } = await import('node:crypto')
  const { addKeyword, createBot, createFlow } = await import('@builderbot/bot')
  const { DurableMetaProvider } = await import('../dist/providers/builderbot/mod.js')
  const { MemoryStore } = await import('../dist/mod.js')
  const sends = []
  const graph = createServer(async (req, res) => {
    let body = ''
    for await (const chunk of req) body += chunk
    sends.push(JSON.parse(body))
    res.writeHead(200, { 'content-type': 'application/json' })
    res.end(JSON.stringify({ messaging_product: 'whatsapp', contacts: [{ input: '34600000001', wa_id: '34600000001' }], messages: [{ id: `wamid.out${sends.length}` }] }))
  })
  await new Promise((resolve) => graph.listen(0, '127.0.0.1', resolve))
  const provider = new DurableMetaProvider({
    whatsapp: { accessToken: 'EAAG-smoke', phoneNumberId: '1065', appSecret: 'smoke-secret', verifyToken: 'v', graphBase: `http://127.0.0.1:${graph.address().port}` },
    durability: { backend: new MemoryDurability(), instanceId: 'smoke-builderbot' },
    store: new MemoryStore(),
  })
  const flow = addKeyword('pedido').addAnswer('¿Qué talla?', { capture: true }, async (ctx, { state, flowDynamic }) => {
    await state.update({ size: ctx.body })
    await flowDynamic(`talla ${ctx.body}`)
  })
  const bot = await createBot({ flow: createFlow([flow]), provider, database: provider.database })
  provider.attach(bot)
  bot.httpServer(0)
  await provider.start()
  while (provider.server.server?.listening !== true) await new Promise((resolve) => setTimeout(resolve, 5))
  const hook = `http://127.0.0.1:${provider.server.server.address().port}/webhook`
  const post = (id, text) => {
    const body = JSON.stringify({ object: 'whatsapp_business_account', entry: [{ id: '1', changes: [{ field: 'messages', value: { messaging_product: 'whatsapp', metadata: { display_phone_number: '1', phone_number_id: '1065' }, messages: [{ from: '34600000001', id, timestamp: '1', type: 'text', text: { body: text } }] } }] }] })
    const signature = `sha256=${createHmac('sha256', 'smoke-secret').update(body).digest('hex')}`
    return fetch(hook, { method: 'POST', headers: { 'content-type': 'application/json', 'x-hub-signature-256': signature }, body })
  }
  assert.equal((await post('wamid.in1', 'pedido')).status, 200)
  await provider.idle()
  assert.equal((await post('wamid.in2', 'M')).status, 200)
  assert.equal((await post('wamid.in2', 'M')).status, 200) // a redelivery
  await provider.idle()
  assert.deepEqual(sends.map((s) => s.text.body), ['¿Qué talla?', 'talla M'])
  assert.deepEqual(sends.map((s) => s.biz_opaque_callback_data), ['wamid.in1:1', 'wamid.in2:1'])
  assert.equal(provider.state.getMyState('34600000001')().size, 'M')
  await provider.stop()
  graph.close()
  console.log('node-smoke: BuilderBot provider ok')
}

// The Baileys provider through the npm build, over a socket shaped like makeWASocket's: an upsert
// journaled and answered with the message id derived from the outbox key, its offline replay dropped.
{
  const { BaileysProvider, baileysMessageIdFor } = await import('../dist/providers/baileys/mod.js')
  const { EventEmitter } = await import('node:events')
  const ev = new EventEmitter()
  const sends = []
  const sock = {
    ev,
    user: { id: '15550000000:7@s.whatsapp.net' },
    sendMessage: async (jid, content, options) => {
      sends.push({ jid, content, options })
      return { key: { remoteJid: jid, fromMe: true, id: options.messageId } }
    },
  }
  const provider = new BaileysProvider({ socket: sock, mediaKey: 'a media key of sixteen bytes' })
  const bot = new Bot({ provider, durability: { backend: new MemoryDurability(), instanceId: 'smoke-baileys' } })
  bot.when(/ping/, (ctx) => ctx.reply('pong'))
  await bot.start()
  const msg = { key: { remoteJid: '4917@s.whatsapp.net', fromMe: false, id: '3A01' }, message: { conversation: 'ping' }, messageTimestamp: 1700000000 }
  ev.emit('messages.upsert', { messages: [msg], type: 'notify' })
  ev.emit('messages.upsert', { messages: [structuredClone(msg)], type: 'append' })
  await provider.idle()
  await bot.idle()
  assert.equal(sends.length, 1)
  assert.deepEqual(sends[0].content, { text: 'pong' })
  assert.equal(sends[0].options.messageId, await baileysMessageIdFor('4917@s.whatsapp.net,0,3A01:1'))
  await bot.stop()
  console.log('node-smoke: baileys provider ok')
}
