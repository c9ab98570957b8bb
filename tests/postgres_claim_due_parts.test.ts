// The due scans of the Postgres backend in parts (SqlPart in backends/postgres/sql.ts): the assembled
// statements are pinned to tests/fixtures/postgres_claim_due.sql (rewrite it with BOTMESH_WRITE_SQL_FIXTURE=1
// after a change to the SQL meant to be one, and run the Postgres conformance), and parts run alone against
// a schema the backend seeded through its own API.
import { afterAll, describe, expect, test } from "bun:test";
import { readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import postgres from "postgres";
import { PostgresDurability } from "../backends/postgres/mod.ts";
import { inboxSql, NOW_MS, outboxClaimDueParts, outboxSql, partAlone, type SqlPart, tables } from "../backends/postgres/sql.ts";
import type { NewOutboxEntry } from "../src/contract.ts";
import { POSTGRES_URL, runId, serviceSkip } from "./support/services.ts";

const FIXTURE = join(import.meta.dir, "fixtures", "postgres_claim_due.sql");
const MARK = /^-- ==== (.+) ====\n/m;

/** Every variant of the due scans, by name, for one fixed schema and prefix. */
function statements(): Record<string, string> {
  const t = tables("bm_schema", "bm_");
  const out: Record<string, string> = {};
  for (const reclaim of [false, true]) {
    for (const resend of [false, true]) out[`outbox.claimDue(reclaimOwn: ${reclaim}, resend: ${resend})`] = outboxSql(t).claimDue(reclaim, resend);
  }
  out["inbox.claimDue(reclaimOwn: false)"] = inboxSql(t).claimDue;
  out["inbox.claimDue(reclaimOwn: true)"] = inboxSql(t).claimDueReclaim;
  return out;
}

test("the due scans assembled from their parts are the pinned text, byte for byte", () => {
  const now = statements();
  if (process.env.BOTMESH_WRITE_SQL_FIXTURE === "1") {
    writeFileSync(FIXTURE, Object.entries(now).map(([name, text]) => `-- ==== ${name} ====\n${text}\n`).join("\n"));
  }
  const pinned: Record<string, string> = {};
  const [, ...pieces] = readFileSync(FIXTURE, "utf8").split(MARK);
  for (let i = 0; i < pieces.length; i += 2) pinned[pieces[i]!] = pieces[i + 1]!.replace(/\n\n?$/, "");
  expect(Object.keys(now)).toEqual(Object.keys(pinned));
  for (const [name, text] of Object.entries(now)) expect(text, name).toBe(pinned[name]!);
});

test("each part reads only parts before it, and names are unique", () => {
  for (const reclaim of [false, true]) {
    for (const resend of [false, true]) {
      const seen = new Set<string>();
      for (const part of outboxClaimDueParts(tables("s", "p_"), reclaim, resend)) {
        expect(part.reads.filter((name) => !seen.has(name)), `${part.name} reads`).toEqual([]);
        expect(seen.has(part.name), part.name).toBe(false);
        seen.add(part.name);
      }
    }
  }
});

const skip = await serviceSkip("postgres");
const it = skip ? test.skip : test;

describe("outbox claimDue parts, alone on a schema the backend seeded", () => {
  const sql = skip ? null : postgres(POSTGRES_URL, { max: 2, onnotice: () => {} });
  const schema = `bm_parts_${runId()}`;
  afterAll(async () => {
    if (!sql) return;
    await sql.unsafe(`DROP SCHEMA IF EXISTS "${schema}" CASCADE`);
    await sql.end({ timeout: 1 });
  });

  let now = 1_700_000_000_000;
  const t = tables(schema, "botmesh_");
  const owner = "owner-a";
  const entry = (key: string, chatId: string): NewOutboxEntry => ({ key, chatId, content: { text: key }, contentHash: "h", inboundId: null });
  const lease = (incarnation: string, leaseMs: number) => ({ owner, incarnation, leaseMs });

  /**
   * Chat `a`: `lapsed`, leased and lapsed before its call was announced. Chat `b`: `called`, lapsed after
   * markCalling, then `b2` queued behind it. Chat `c`: `live`, leased. Chat `d`: `other`, leased (live)
   * by the owner's incarnation `inc-0`. Chat `e`: `e1` queued (its head, due), `e2` behind it.
   */
  const seeded = (async () => {
    if (skip) return null;
    const b = new PostgresDurability({ sql: sql!, schema, clock: () => now });
    await b.open();
    await b.outbox.reserve(entry("lapsed", "a"), lease("inc-1", 1_000));
    const called = await b.outbox.reserve(entry("called", "b"), lease("inc-1", 1_000));
    expect(await b.outbox.markCalling("called", called.entry.lease!.token, 1_000)).toBe(true);
    await b.outbox.reserve(entry("b2", "b"));
    await b.outbox.reserve(entry("live", "c"), lease("inc-1", 60_000));
    await b.outbox.reserve(entry("other", "d"), lease("inc-0", 60_000));
    await b.outbox.reserve(entry("e1", "e"));
    await b.outbox.reserve(entry("e2", "e"));
    now += 5_000;
    return b;
  })();

  /**
   * `name` alone, on the test clock, as a statement with claimDue's four parameters: a part may read few of
   * them, and Postgres types each parameter it is given from the text (`args`, never run, declares them).
   */
  const alone = (parts: SqlPart[], name: string) =>
    partAlone(parts, name).replaceAll(NOW_MS, `(${now})::bigint`)
      .replace(/^WITH /, "WITH args AS (SELECT $1::text, $2::text, $3::bigint, $4::bigint),\n    ");
  /** The rows of part `name` of claimDue (reclaim, resend) run alone for the caller (owner-a, inc-1), $4 = `limit`. */
  async function part(name: string, reclaim: boolean, resend: boolean, limit = 10): Promise<Record<string, unknown>[]> {
    await seeded;
    return [...await sql!.unsafe(alone(outboxClaimDueParts(t, reclaim, resend), name), [owner, "inc-1", 60_000, limit])];
  }
  /** The keys of the outbox rows `seqs` (in seq order). */
  async function keys(rows: Record<string, unknown>[]): Promise<string[]> {
    const seqs = rows.map((row) => String(row.seq));
    return (await sql!.unsafe(`SELECT key FROM ${t.outbox} WHERE seq::text = ANY($1) ORDER BY seq`, [seqs])).map((row) => row.key as string);
  }

  it("lost0: the sending entries whose lease lapsed, with whether their call was announced; under reclaimOwn the owner's other incarnations' too", async () => {
    const lost = await part("lost0", false, false);
    expect(await keys(lost)).toEqual(["lapsed", "called"]);
    expect(lost.map((row) => row.uncalled)).toEqual([true, false]);
    expect(await keys(await part("lost0", true, false))).toEqual(["lapsed", "called", "other"]);
    expect(await keys(await part("lost0", false, true, 1)), "with resend, all of it is leased: at most $4").toEqual(["lapsed"]);
  });

  it("called and relost: the ambiguous ones, and the uncalled ones leased again (at most $4)", async () => {
    expect(await keys(await part("called", false, false))).toEqual(["called"]);
    expect(await keys(await part("relost", true, false))).toEqual(["lapsed", "other"]);
    expect(await keys(await part("relost", true, false, 1))).toEqual(["lapsed"]);
  });

  it("heads: the due chat heads only (not behind a sending entry, not a tail), in what $4 leaves after relost", async () => {
    expect(await keys(await part("heads", false, false))).toEqual(["e1"]);
    expect(await keys(await part("heads", false, false, 1)), "relost took the one").toEqual([]);
    expect(await keys(await part("heads", false, false, 2))).toEqual(["e1"]);
  });

  it("rsl and rs: chats flagged resync, not those of entries made unknown; rs those whose snapshot is current", async () => {
    await seeded;
    // What a race leaves (see "Due marks" in sql.ts): flags set by hand.
    await sql!.unsafe(`UPDATE ${t.chat} SET resync = true WHERE chat_id IN ('b', 'e')`);
    try {
      expect((await part("rsl", false, false)).map((row) => row.chat_id)).toEqual(["e"]);
      expect((await part("rs", false, false)).map((row) => row.chat_id)).toEqual(["e"]);
      expect((await part("rsl", false, true)).map((row) => row.chat_id), "with resend, lost0's chats").toEqual(["e"]);
    } finally {
      await sql!.unsafe(`UPDATE ${t.chat} SET resync = false`);
    }
  });

  it("every part of every variant runs alone with the parts it reads (writes rolled back)", async () => {
    await seeded;
    const rollback = new Error("rollback");
    for (const reclaim of [false, true]) {
      for (const resend of [false, true]) {
        const parts: SqlPart[] = outboxClaimDueParts(t, reclaim, resend);
        for (const { name } of parts) {
          const text = alone(parts, name);
          const failed = await sql!.begin(async (tx) => {
            await tx.unsafe(text, [owner, "inc-1", 60_000, 10]);
            throw rollback;
          }).catch((error: unknown) => error);
          expect(failed, `${name} (reclaimOwn: ${reclaim}, resend: ${resend})`).toBe(rollback);
        }
      }
    }
  });
});
