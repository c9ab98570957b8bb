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
  const { FileDurability } = await import('../dist/backends/file.js')
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
