import { describe, expect, test } from "bun:test";
import type { PostgresClient } from "../backends/postgres/options.ts";
import { CHECK_EVERY_MS, RETRY_AFTER_ERROR_MS, TableStats } from "../backends/postgres/table_stats.ts";

let schemas = 0;
/** The tables of a schema of their own: a process keeps one set of checks per set of tables. */
function tableNames(): { INBOX: string; OUTBOX: string } {
  const s = `"s${++schemas}"`;
  return { INBOX: `${s}."botmesh_inbox"`, OUTBOX: `${s}."botmesh_outbox"` };
}

/** A client that answers the check with `rows` (or fails it) and records every statement. */
function fakeClient(answer: () => Record<string, unknown>[] | Error) {
  const statements: string[] = [];
  const sql = {
    unsafe(text: string) {
      statements.push(text.startsWith("ANALYZE") ? text : "check");
      if (text.startsWith("ANALYZE")) return Promise.resolve([]);
      const a = answer();
      return a instanceof Error ? Promise.reject(a) : Promise.resolve(a);
    },
  } as unknown as PostgresClient;
  return { sql, statements };
}

/** Lets the background check run to its end. */
const settle = () => new Promise((r) => setTimeout(r, 0));

describe("Postgres table statistics after a burst", () => {
  test("checks at most every CHECK_EVERY_MS, one at a time; analyzes the stale tables it may, only its own", async () => {
    const { INBOX, OUTBOX } = tableNames();
    let now = 0;
    const { sql, statements } = fakeClient(() => [
      { name: INBOX, may: true, stale: true },
      { name: OUTBOX, may: true, stale: false },
      { name: `"other"."botmesh_inbox"`, may: true, stale: true },
    ]);
    const stats = new TableStats(sql, [INBOX, OUTBOX], async () => {}, () => now);
    stats.check();
    stats.check(); // under way: not a second one
    await settle();
    expect(statements).toEqual(["check", `ANALYZE (SKIP_LOCKED) ${INBOX}`]);
    now += CHECK_EVERY_MS - 1;
    stats.check();
    await settle();
    expect(statements.length, "too soon").toBe(2);
    now += 1;
    stats.check();
    await settle();
    expect(statements.slice(2)).toEqual(["check", `ANALYZE (SKIP_LOCKED) ${INBOX}`]);
    // Another backend on the same tables (one per request) shares the checks.
    const again = new TableStats(sql, [INBOX, OUTBOX], async () => {}, () => now);
    again.check();
    await settle();
    expect(statements.length, "checked just now by the other").toBe(4);
  });

  test("a table the role may not analyze is not; a failed check waits RETRY_AFTER_ERROR_MS", async () => {
    const { INBOX, OUTBOX } = tableNames();
    let now = 0;
    let fail = false;
    const { sql, statements } = fakeClient(() => fail ? new Error("connection lost") : [{ name: OUTBOX, may: false, stale: true }]);
    const stats = new TableStats(sql, [INBOX, OUTBOX], async () => {}, () => now);
    stats.check();
    await settle();
    expect(statements).toEqual(["check"]);
    fail = true;
    now += CHECK_EVERY_MS;
    stats.check();
    await settle();
    expect(statements).toEqual(["check", "check"]);
    now += CHECK_EVERY_MS;
    stats.check();
    await settle();
    expect(statements.length, "waits after the failure").toBe(2);
    fail = false;
    now += RETRY_AFTER_ERROR_MS;
    stats.check();
    await settle();
    expect(statements, "still not analyzed").toEqual(["check", "check", "check"]);
    expect(await stats.analyzeStale()).toEqual([]);
  });
});
