// The pack smoke's bot, type-checked and run from a fresh project that installed the packed
// tarball: only package imports. Each backend gets a message, its redelivery, and the same
// message again after a restart on the same store; the reply must go out exactly once.
import { Bot, type DurabilityBackend, MemoryDurability } from "@botmesh/durable";
import { PostgresDurability } from "@botmesh/durable/postgres";
import { SQLiteDurability } from "@botmesh/durable/sqlite";
import { MockProvider } from "@botmesh/durable/testing";
import { countRecords, openBackend } from "@botmesh/durable/ops";
import postgres from "postgres";

const runtime: string = typeof (globalThis as { Bun?: unknown }).Bun === "object" ? "bun" : "node";
const required: boolean = process.env.BOTMESH_REQUIRE_SERVICES === "1";

function check(ok: boolean, what: string): void {
  if (!ok) throw new Error(`pack smoke (${runtime}): ${what}`);
}

/** Runs one bot on `backend` and returns the texts it sent. */
async function session(backend: DurabilityBackend, name: string, instance: number): Promise<string[]> {
  const provider = new MockProvider();
  const bot = new Bot({ provider, durability: { backend, instanceId: `pack-${name}-${instance}` } });
  bot.when(/hi/, (ctx) => ctx.reply(`hello from ${name}`));
  await bot.start();
  await provider.receive({ id: "m1", chatId: "c1", text: "hi" });
  await provider.receive({ id: "m1", chatId: "c1", text: "hi" }); // a redelivery
  await bot.idle();
  await bot.stop();
  return provider.sent.map((s) => JSON.stringify(s.content));
}

/** The reply exactly once: the first session sends it, the one after a restart on the same store does not. */
async function exactlyOnce(name: string, open: () => DurabilityBackend, restarts: boolean): Promise<void> {
  const first = await session(open(), name, 1);
  check(first.length === 1 && first[0] === JSON.stringify(`hello from ${name}`), `${name}: expected one reply, got ${JSON.stringify(first)}`);
  if (restarts) {
    const again = await session(open(), name, 2);
    check(again.length === 0, `${name}: the reply was sent again after a restart: ${JSON.stringify(again)}`);
  }
  console.log(`pack smoke (${runtime}): ${name} ok`);
}

await exactlyOnce("memory", () => new MemoryDurability(), false);
const sqliteFile = `data/${runtime}-${process.pid}.db`;
await exactlyOnce("sqlite", () => new SQLiteDurability({ file: sqliteFile }), true);

// The operator's view of the same file, through the CLI's backend opener.
const opened = await openBackend(`sqlite:${sqliteFile}`);
const counts = await countRecords(opened.backend);
await opened.close();
check(counts.outbox.sent === 1 && counts.inbox.done === 1, `ops: expected 1 sent and 1 done, counted ${JSON.stringify(counts)}`);
console.log(`pack smoke (${runtime}): ops ok`);

const sql = postgres("postgres://postgres@127.0.0.1:5432/test", { max: 2, onnotice: () => {}, connect_timeout: 3 });
let reachable = true;
try {
  await sql`select 1`;
} catch (error) {
  reachable = false;
  if (required) throw new Error(`pack smoke (${runtime}): BOTMESH_REQUIRE_SERVICES=1 but Postgres is not reachable: ${String(error)}`);
  console.warn(`pack smoke (${runtime}): Postgres not reachable, skipped`);
}
if (reachable) {
  const schema = `bm_pack_${runtime}_${Math.random().toString(36).slice(2, 10)}`;
  try {
    await exactlyOnce("postgres", () => new PostgresDurability({ sql, schema }), true);
  } finally {
    await sql.unsafe(`DROP SCHEMA IF EXISTS "${schema}" CASCADE`);
  }
}
await sql.end();
