// PostgresDurability behind PgBouncer in transaction pooling mode: the client made with `prepare: false`
// (each statement unnamed), every write one transaction. The journal contract runs through it.
import { afterAll, describe, expect, test } from "bun:test";
import postgres from "postgres";
import type { DurabilityBackend } from "../src/contract.ts";
import { PostgresDurability } from "../backends/postgres/mod.ts";
import { statementError } from "../backends/postgres/connection.ts";
import { runBackendContract, runDurabilityConformance } from "../testing.ts";
import { type PgBouncer, pgbouncerSkip, startPgBouncer } from "./support/pgbouncer.ts";
import { POSTGRES_URL, runId, serviceSkip } from "./support/services.ts";

const skip = (await serviceSkip("postgres")) || pgbouncerSkip();
const bouncer: PgBouncer | null = skip ? null : await startPgBouncer("transaction");
type Sql = ReturnType<typeof postgres>;
/** Schemas are created and dropped on a direct connection. */
const admin = skip ? null : postgres(POSTGRES_URL, { max: 2, onnotice: () => {} });
afterAll(async () => {
  await admin?.end();
  await bouncer?.stop();
});

const homes = new WeakMap<DurabilityBackend, { schema: string; sql: Sql }>();

function setup(
  name: string,
  run: typeof runDurabilityConformance,
  open: (sql: Sql, schema: string, clock: () => number) => DurabilityBackend | Promise<DurabilityBackend>,
) {
  const over = async (schema: string, clock: () => number) => {
    const sql = postgres(bouncer!.url, { max: 10, prepare: false, onnotice: () => {} });
    const backend = await open(sql, schema, clock);
    homes.set(backend, { schema, sql });
    return backend;
  };
  run({
    name,
    create: ({ now }) => over(`bm_pgb_${runId()}`, now),
    reopen: async (old, { now }) => {
      const home = homes.get(old)!;
      await home.sql.end({ timeout: 2 });
      return over(home.schema, now);
    },
    cleanup: async (backend) => {
      const home = homes.get(backend)!;
      await home.sql.end({ timeout: 2 });
      await admin!.unsafe(`DROP SCHEMA IF EXISTS "${home.schema}" CASCADE`);
    },
    harness: { describe, test, expect },
    skip,
    timeScale: 3,
    // The statements' time comes from the test's clock (option `clock`): leases lapse in simulated time.
    simulatedTime: true,
  });
}

// A pooler in front of the same statements: the journal contract (every statement, group commits
// included) through it; the bot's rules and the crash matrix run on Postgres directly.
setup("postgres through PgBouncer, transaction pooling (PostgresDurability)", runBackendContract, (sql, schema, clock) => new PostgresDurability({ sql, schema, clock }));

describe("a prepared statement lost between server connections", () => {
  test("is reported with what to change (prepare: false, or session pooling)", () => {
    const lost = Object.assign(new Error('prepared statement "p3" does not exist'), { code: "26000" });
    const text = statementError(lost);
    expect(text.startsWith('prepared statement "p3" does not exist (')).toBe(true);
    expect(text).toContain("pool_mode=transaction");
    expect(text).toContain("prepare: false");
    expect(statementError(Object.assign(new Error("deadlock detected"), { code: "40P01" }))).toBe("deadlock detected");
  });
});
