import { afterAll, describe, expect, test } from "bun:test";
import postgres from "postgres";
import type { DurabilityBackend } from "../src/contract.ts";
import { KvDurability } from "../backends/kv/durability.ts";
import { PostgresDurability, PostgresKv, PostgresStore } from "../backends/postgres/mod.ts";
import { runBackendContract, runDurabilityConformance } from "../testing.ts";
import { POSTGRES_URL, runId, serviceSkip } from "./support/services.ts";

const skip = await serviceSkip("postgres");

type Sql = ReturnType<typeof postgres>;

/** A client as a bot process would have one (a pool of 10, NOTICEs silenced). */
function client(): Sql {
  return postgres(POSTGRES_URL, { max: 10, onnotice: () => {} });
}

/**
 * Ends a client as a killed process would leave it: statements already sent
 * may still land (up to 2 s), nothing new is sent.
 */
async function kill(sql: Sql): Promise<void> {
  await sql.end({ timeout: 2 });
}

/** One client for creating and dropping schemas. */
const admin = skip ? null : postgres(POSTGRES_URL, { max: 2, onnotice: () => {} });
afterAll(async () => {
  await admin?.end();
});

/**
 * Damages a record of a {@link PostgresDurability} as a hand edit would: its payload made JSON nested too
 * deep (its content text that is not JSON), the rest of the row as it was.
 */
async function damage(backend: DurabilityBackend, journal: "inbox" | "outbox", id: string): Promise<DurabilityBackend> {
  const { schema, tablePrefix } = backend as PostgresDurability;
  // The inbox record's payload nested far deeper than the journal writes (MAX_STORED_DEPTH); the outbox entry's not JSON.
  const [column, key, value] = journal === "inbox"
    ? ["payload", "id", "[".repeat(300_000) + "]".repeat(300_000)]
    : ["content", "key", "{not json"];
  const rows = await admin!.unsafe(`UPDATE "${schema}"."${tablePrefix}${journal}" SET ${column} = $2 WHERE ${key} = $1`, [id, value]);
  if (rows.count !== 1) throw new Error(`no ${journal} row ${id} to damage`);
  return backend;
}

/**
 * Damages a record of `KvDurability` over {@link PostgresKv} (prefix `bot:`) as a hand edit of its kv row
 * would: an inbox record given a state this library does not know (its index keys kept), an outbox
 * entry's value replaced by a JSON string that is not a record at all.
 */
async function kvDamage(backend: DurabilityBackend, journal: "inbox" | "outbox", id: string): Promise<DurabilityBackend> {
  const table = `"${homes.get(backend)!.schema}"."botmesh_kv"`;
  const key = `bot:r/${journal === "inbox" ? "in" : "out"}/${id.replace(/[%/]/g, (c) => (c === "%" ? "%25" : "%2F"))}`;
  const [row] = await admin!.unsafe(`SELECT value FROM ${table} WHERE key = $1`, [key]);
  if (!row) throw new Error(`no kv row ${key} to damage`);
  const stored = JSON.parse(row.value as string) as { rec: Record<string, unknown> };
  const value = journal === "inbox" ? { ...stored, rec: { ...stored.rec, state: "archived" } } : "{not json";
  await admin!.unsafe(`UPDATE ${table} SET value = $2 WHERE key = $1`, [key, JSON.stringify(value)]);
  return backend;
}

/** What each backend runs on: its schema and its own client (a reopen ends the old one, as a killed process would). */
const homes = new WeakMap<DurabilityBackend, { schema: string; sql: Sql }>();

/**
 * @param timeScale leases, delays and sleeps of the suite are scaled by this: a
 *   round trip to the server is slower than a call into memory, and the generic kv
 *   backend makes several per journal operation.
 */
function setup(
  name: string,
  timeScale: number,
  open: (sql: Sql, schema: string, clock: () => number) => DurabilityBackend | Promise<DurabilityBackend>,
  run: typeof runDurabilityConformance = runDurabilityConformance,
  hurt?: typeof damage,
) {
  const over = async (schema: string, clock: () => number) => {
    const sql = client();
    const backend = await open(sql, schema, clock);
    homes.set(backend, { schema, sql });
    return backend;
  };
  run({
    name,
    create: ({ now }) => over(`bm_conf_${runId()}`, now),
    reopen: async (old, { now }) => {
      const home = homes.get(old)!;
      await kill(home.sql);
      return over(home.schema, now);
    },
    cleanup: async (backend) => {
      const home = homes.get(backend)!;
      await kill(home.sql);
      await admin!.unsafe(`DROP SCHEMA IF EXISTS "${home.schema}" CASCADE`);
    },
    ...(hurt ? { damage: hurt } : {}),
    harness: { describe, test, expect },
    skip,
    timeScale,
    // The statements' time comes from the test's clock (option `clock`): leases lapse in simulated time.
    simulatedTime: true,
  });
}

setup("postgres (PostgresDurability)", 3, (sql, schema, clock) => new PostgresDurability({ sql, schema, clock }), runDurabilityConformance, damage);

// The store's backend and the kv run the same statements and the generic kv layer (whose bot rules
// and crash matrix run over MemoryKv): the journal contract is enough for them.
setup("postgres (PostgresStore#durability)", 3, async (sql, schema, clock) => {
  const store = new PostgresStore({ sql, schema, tablePrefix: "bot_", clock });
  if ((await store.get("greeting")) === undefined) await store.set("greeting", "hello"); // the same client holds both
  expect(await store.get("greeting")).toBe("hello");
  return store.durability();
}, runBackendContract, damage);

// The generic kv layer takes several round trips per journal operation: its short leases get more room.
setup("postgres (KvDurability over PostgresKv)", 6, (sql, schema, clock) => new KvDurability(new PostgresKv({ sql, schema, clock }), { prefix: "bot:" }), runBackendContract, kvDamage);
