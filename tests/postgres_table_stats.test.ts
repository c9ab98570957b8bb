import { describe, expect, test } from "bun:test";
import type { PostgresClient } from "../backends/postgres/options.ts";
import { CHECK_EVERY_MS, RETRY_AFTER_ERROR_MS, TableStats } from "../backends/postgres/table_stats.ts";

const INBOX = `"s"."botmesh_inbox"`, OUTBOX = `"s"."botmesh_outbox"`;

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
    let now = 0;
    const { sql, statements } = fakeClient(() => [
      { name: INBOX, may: true, stale: true },
      { name: OUTBOX, may: true, stale: false },
      { name: `"s"."other"`, may: true, stale: true },
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
  });

  test("a table the role may not analyze is never asked again; a failed check waits RETRY_AFTER_ERROR_MS", async () => {
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
    expect(statements, "the refused table stays refused").toEqual(["check", "check", "check"]);
    expect(await stats.analyzeStale()).toEqual([]);
  });
});
