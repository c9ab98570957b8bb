// Smoke test of the npm build of @botmesh/durable/sqlite (run `tsup` first), on any runtime:
//   node scripts/sqlite-smoke.mjs                 (Node 20: better-sqlite3; Node ≥ 22.5: node:sqlite)
//   deno run -A scripts/sqlite-smoke.mjs          (node:sqlite)
//   bun scripts/sqlite-smoke.mjs                  (bun:sqlite)
// Store set/get/TTL, admit → claim → complete, reserve → markSent, and a second
// instance on the same file that sees the claim and cannot steal it.
import assert from 'node:assert/strict'
import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { SQLiteDurability, SQLiteStore } from '../dist/backends/sqlite/mod.js'

const runtime = globalThis.Bun ? `Bun ${globalThis.Bun.version}` : globalThis.Deno ? `Deno ${globalThis.Deno.version.deno}` : `Node ${process.version}`
const dir = mkdtempSync(join(tmpdir(), 'botmesh-sqlite-smoke-'))
const file = join(dir, 'data', 'bot.db') // the directory is created on open
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms))
const owner = (name) => ({ owner: name, incarnation: `${name}-1`, leaseMs: 60_000 })

try {
  // Session store: set/get/TTL.
  const store = new SQLiteStore({ file })
  await store.open()
  await store.set('chat:1', { step: 2, text: 'héllo ✓ 🎉' })
  await store.set('short', 1, { ttlMs: 30 })
  assert.deepEqual(await store.get('chat:1'), { step: 2, text: 'héllo ✓ 🎉' })
  assert.equal(await store.get('short'), 1)
  await sleep(60)
  assert.equal(await store.get('short'), undefined, 'an expired value is not returned')
  await store.delete('chat:1')
  assert.equal(await store.get('chat:1'), undefined)

  // Journals in the same file.
  const a = store.durability()
  await a.open()
  assert.equal(a.name, 'sqlite')
  assert.equal(a.scope, 'host')
  const driver = a.driver
  const admitted = await a.inbox.admit({ id: 'm1', kind: 'message', chatId: 'c1', provider: 'smoke', payload: { text: 'hi' }, receivedAt: Date.now() })
  assert.equal(admitted.state, 'pending')
  assert.equal(await a.inbox.admit({ ...admitted, payload: {} }), null, 'a redelivery is not journaled twice')
  const [claimed] = await a.inbox.claimDue({ ...owner('A'), limit: 10 })
  assert.equal(claimed.id, 'm1')
  assert.equal(claimed.lease.token, 2) // claims never issue the writer's token 1

  const reserved = await a.outbox.reserve({ key: 'm1:1', chatId: 'c1', content: { text: 'hello' }, contentHash: 'h', inboundId: 'm1' }, owner('A'))
  assert.equal(reserved.status, 'leased')

  // A second instance on the same file (as another process would) sees the claims and cannot steal them.
  const b = new SQLiteDurability({ file })
  await b.open()
  assert.equal((await b.inbox.get('m1')).lease.owner, 'A')
  assert.equal(await b.inbox.claim('m1', owner('B')), null, 'a live lease is not taken')
  assert.deepEqual(await b.inbox.claimDue({ ...owner('B'), limit: 10 }), [])
  const other = await b.outbox.claimDue({ ...owner('B'), limit: 10 })
  assert.deepEqual([other.due.length, other.ambiguous.length], [0, 0])
  assert.equal((await b.outbox.reserve({ key: 'm1:1', chatId: 'c1', content: { text: 'hello' }, contentHash: 'h', inboundId: 'm1' }, owner('B'))).status, 'exists')
  await assert.rejects(b.inbox.complete('m1', claimed.lease.token + 1), { name: 'StaleLeaseError' })

  await a.outbox.markSent('m1:1', reserved.entry.lease.token, 'provider-msg-1')
  await a.inbox.complete('m1', claimed.lease.token)
  assert.equal((await b.inbox.get('m1')).state, 'done')
  const sent = await b.outbox.get('m1:1')
  assert.equal(sent.state, 'sent')
  assert.equal(sent.messageId, 'provider-msg-1')

  await b.close()
  await a.close()
  await store.close()
  await assert.rejects(a.inbox.get('m1'), /not open/)
  console.log(`sqlite-smoke: ok on ${runtime} with ${driver}`)
} finally {
  rmSync(dir, { recursive: true, force: true })
}
