import { afterAll, describe, expect, test } from "bun:test";
import postgres from "postgres";
import type { DurabilityBackend } from "../src/backend.ts";
import { kvDurability } from "../backends/kv.ts";
import { PostgresDurability, PostgresKv, PostgresStore } from "../backends/postgres.ts";
import { runBackendContract, runDurabilityConformance } from "../testing.ts";
import { POSTGRES_URL, runId, serviceSkip } from "./support/services.ts";

/**
 * npm test runs this suite in a second process beside the others (two cores busy): its real-time
 * leases get half as much again of margin.
 */
const SHARED_RUN_MARGIN = 1.5;


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
  open: (sql: Sql, schema: string) => DurabilityBackend | Promise<DurabilityBackend>,
  run: typeof runDurabilityConformance = runDurabilityConformance,
) {
  const over = async (schema: string) => {
    const sql = client();
    const backend = await open(sql, schema);
    homes.set(backend, { schema, sql });
    return backend;
  };
  run({
    name,
    create: () => over(`bm_conf_${runId()}`),
    reopen: async (old) => {
      const home = homes.get(old)!;
      await kill(home.sql);
      return over(home.schema);
    },
    cleanup: async (backend) => {
      const home = homes.get(backend)!;
      await kill(home.sql);
      await admin!.unsafe(`DROP SCHEMA IF EXISTS "${home.schema}" CASCADE`);
    },
    harness: { describe, test, expect },
    skip,
    timeScale: timeScale * SHARED_RUN_MARGIN,
  });
}

setup("postgres (PostgresDurability)", 3, (sql, schema) => new PostgresDurability({ sql, schema }));

// The store's backend and the kv run the same statements and the generic kv layer (whose bot rules
// and crash matrix run over MemoryKv): the journal contract is enough for them.
setup("postgres (PostgresStore#durability)", 3, async (sql, schema) => {
  const store = new PostgresStore({ sql, schema, tablePrefix: "bot_" });
  if ((await store.get("greeting")) === undefined) await store.set("greeting", "hello"); // the same client holds both
  expect(await store.get("greeting")).toBe("hello");
  return store.durability();
}, runBackendContract);

setup("postgres (kvDurability over PostgresKv)", 4, (sql, schema) => kvDurability(new PostgresKv({ sql, schema }), { prefix: "bot:" }), runBackendContract);
