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
