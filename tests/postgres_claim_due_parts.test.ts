// The due scans of the Postgres backend in parts (SqlPart in backends/postgres/sql.ts): the assembled
// statements are pinned to tests/fixtures/postgres_claim_due.sql (rewrite it with BOTMESH_WRITE_SQL_FIXTURE=1
// after a change to the SQL meant to be one, and run the Postgres conformance), and parts run alone against
// a schema the backend seeded through its own API.
import { afterAll, describe, expect, test } from "bun:test";
import { readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import postgres from "postgres";
import { PostgresDurability } from "../backends/postgres/mod.ts";
import {
  inboxClaimDueParts,
  inboxSql,
  NOW_MS,
  outboxClaimDueParts,
  outboxSql,
  partAlone,
  type SqlPart,
  type Tables,
  tables,
} from "../backends/postgres/sql.ts";
import type { ClaimOptions, NewInboundRecord, NewOutboxEntry } from "../src/contract.ts";
import { POSTGRES_URL, runId, serviceSkip } from "./support/services.ts";

const FIXTURE = join(import.meta.dir, "fixtures", "postgres_claim_due.sql");
const MARK = /^-- ==== (.+) ====\n/m;

/** Every variant of the due scans, by name, for one fixed schema and prefix. */
function statements(): Record<string, string> {
  const t = tables("bm_schema", "bm_");
  const out: Record<string, string> = {};
  for (const reclaim of [false, true]) {
    for (const resend of [false, true]) {
      out[`outbox.claimDue(reclaimOwn: ${reclaim}, resend: ${resend})`] = outboxSql(t).claimDue(reclaim, resend);
    }
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

/** Every variant's parts, by name, on `t`. */
const variants = (t: Tables): [string, SqlPart[]][] => [
  ...[false, true].flatMap((reclaim) =>
    [false, true].map((resend): [string, SqlPart[]] => [
      `outbox (reclaimOwn: ${reclaim}, resend: ${resend})`,
      outboxClaimDueParts(t, reclaim, resend),
    ])
  ),
  ...[false, true].map((reclaim): [string, SqlPart[]] => [`inbox (reclaimOwn: ${reclaim})`, inboxClaimDueParts(t, reclaim)]),
];

test("each part reads only parts before it, and names are unique", () => {
  for (const [variant, parts] of variants(tables("s", "p_"))) {
    const seen = new Set<string>();
    for (const part of parts) {
      expect(part.reads.filter((name) => !seen.has(name)), `${variant}: ${part.name} reads`).toEqual([]);
      expect(seen.has(part.name), `${variant}: ${part.name}`).toBe(false);
      seen.add(part.name);
    }
  }
});

const skip = await serviceSkip("postgres");
const it = skip ? test.skip : test;
const sql = skip ? null : postgres(POSTGRES_URL, { max: 3, onnotice: () => {} });
const schemas: string[] = [];
afterAll(async () => {
  if (!sql) return;
  for (const schema of schemas) await sql.unsafe(`DROP SCHEMA IF EXISTS "${schema}" CASCADE`);
  await sql.end({ timeout: 1 });
});

const OWNER = "owner-a";
const lease = (incarnation: string, leaseMs: number, owner = OWNER) => ({ owner, incarnation, leaseMs });

/**
 * A fresh schema seeded by `seed` through the backend's API on a test clock, which then moves on 5 s; and a
 * runner of parts alone on it, as the caller (owner-a, inc-1) with limit $4.
 */
function seeded(seed: (b: PostgresDurability) => Promise<void>) {
  const schema = `bm_parts_${runId()}`;
  schemas.push(schema);
  const t = tables(schema, "botmesh_");
  let now = 1_700_000_000_000;
  const ready = skip ? Promise.resolve() : (async () => {
    const b = new PostgresDurability({ sql: sql!, schema, clock: () => now });
    await b.open();
    await seed(b);
    now += 5_000;
  })();
  /**
   * `name` alone, on the test clock, as a statement with claimDue's four parameters: a part may read few of
   * them, and Postgres types each parameter it is given from the text (`args`, never run, declares them).
   */
  const alone = (parts: SqlPart[], name: string) =>
    partAlone(parts, name).replaceAll(NOW_MS, `(${now})::bigint`)
      .replace(/^WITH /, "WITH args AS (SELECT $1::text, $2::text, $3::bigint, $4::bigint),\n    ");
  const args = (limit: number) => [OWNER, "inc-1", 60_000, limit];
  return {
    t,
    ready,
    /** The rows of part `name` of `parts` run alone. */
    async rows(parts: SqlPart[], name: string, limit = 10): Promise<Record<string, unknown>[]> {
      await ready;
      return [...await sql!.unsafe(alone(parts, name), args(limit))];
    },
    /** Runs every part of every variant alone, each in a transaction rolled back; the parts whose run failed otherwise. */
    async everyPart(): Promise<string[]> {
      await ready;
      const rollback = new Error("rollback");
      const failed: string[] = [];
      for (const [variant, parts] of variants(t)) {
        for (const { name } of parts) {
          const error = await sql!.begin(async (tx) => {
            await tx.unsafe(alone(parts, name), args(10));
            throw rollback;
          }).catch((error: unknown) => error);
          if (error !== rollback) failed.push(`${variant}: ${name}: ${(error as Error).message}`);
        }
      }
      return failed;
    },
  };
}

describe("outbox claimDue parts, alone", () => {
  const entry = (key: string, chatId: string): NewOutboxEntry => ({
    key,
    chatId,
    content: { text: key },
    contentHash: "h",
    inboundId: null,
  });
  // Chat `a`: `lapsed`, leased and lapsed before its call was announced. Chat `b`: `called`, lapsed after
  // markCalling, then `b2` queued behind it. Chat `c`: `live`, leased. Chat `d`: `other`, leased (live) by the
  // owner's incarnation `inc-0`. Chat `e`: `e1` queued (its head, due), `e2` behind it.
  const db = seeded(async (b) => {
    await b.outbox.reserve(entry("lapsed", "a"), lease("inc-1", 1_000));
    const called = await b.outbox.reserve(entry("called", "b"), lease("inc-1", 1_000));
    expect(await b.outbox.markCalling("called", called.entry.lease!.token, 1_000)).toBe(true);
    await b.outbox.reserve(entry("b2", "b"));
    await b.outbox.reserve(entry("live", "c"), lease("inc-1", 60_000));
    await b.outbox.reserve(entry("other", "d"), lease("inc-0", 60_000));
    await b.outbox.reserve(entry("e1", "e"));
    await b.outbox.reserve(entry("e2", "e"));
  });
  const part = (name: string, reclaim: boolean, resend: boolean, limit?: number) =>
    db.rows(outboxClaimDueParts(db.t, reclaim, resend), name, limit);
  /** The keys of the outbox rows of `rows` (by their seq), in seq order. */
  async function keys(rows: Record<string, unknown>[]): Promise<string[]> {
    const seqs = rows.map((row) => String(row.seq));
    return (await sql!.unsafe(`SELECT key FROM ${db.t.outbox} WHERE seq::text = ANY($1) ORDER BY seq`, [seqs])).map((row) =>
      row.key as string
    );
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

  it("rsl and rs: the chats flagged resync, not those of entries made unknown; rs those whose snapshot is current", async () => {
    await db.ready;
    // What a race leaves (see "Due marks" in sql.ts), set by hand.
    await sql!.unsafe(`UPDATE ${db.t.chat} SET resync = true WHERE chat_id IN ('b', 'e')`);
    try {
      expect((await part("rsl", false, false)).map((row) => row.chat_id)).toEqual(["e"]);
      expect((await part("rs", false, false)).map((row) => row.chat_id)).toEqual(["e"]);
      expect((await part("rsl", false, true)).map((row) => row.chat_id), "with resend, lost0's chats").toEqual(["e"]);
    } finally {
      await sql!.unsafe(`UPDATE ${db.t.chat} SET resync = false`);
    }
  });

  it("every part of every variant runs alone with the parts it reads (writes rolled back)", async () => {
    expect(await db.everyPart()).toEqual([]);
  });
});

describe("inbox claimDue parts, alone", () => {
  let at = 1_700_000_000_000;
  const record = (id: string, chatId: string): NewInboundRecord => ({
    id,
    kind: "message",
    chatId,
    provider: "test",
    payload: {},
    receivedAt: at++,
  });
  // Chat `a`: `a1`, `a2` pending. Chat `b`: `b1` leased by owner-b (live), `b2` pending. Chat `x`: `x1` leased
  // and lapsed, `x2` pending. Chat `d`: `d1` leased (live) by the owner's incarnation `inc-0`, `d2` pending.
  const db = seeded(async (b) => {
    const admit = async (id: string, chat: string, claim?: ClaimOptions) =>
      expect(await b.inbox.admit(record(id, chat), claim)).not.toBeNull();
    await admit("a1", "a");
    await admit("a2", "a");
    await admit("b1", "b", lease("inc-1", 60_000, "owner-b"));
    await admit("b2", "b");
    await admit("x1", "x", lease("inc-1", 1_000));
    await admit("x2", "x");
    await admit("d1", "d", lease("inc-0", 60_000));
    await admit("d2", "d");
  });
  /** The ids of the records of part `name`'s rows (by their ord), in ord order. */
  async function part(name: string, reclaim: boolean, limit?: number): Promise<string[]> {
    const ords = (await db.rows(inboxClaimDueParts(db.t, reclaim), name, limit)).map((row) => String(row.ord));
    return (await sql!.unsafe(`SELECT id FROM ${db.t.inbox} WHERE ord::text = ANY($1) ORDER BY ord`, [ords])).map((row) =>
      row.id as string
    );
  }

  it("p0: the pending records whose chat no earlier record holds elsewhere (the owner's other incarnations do not under reclaimOwn)", async () => {
    expect(await part("p0", false)).toEqual(["a1", "a2", "x2"]);
    expect(await part("p0", true)).toEqual(["a1", "a2", "x2", "d2"]);
    expect(await part("p0", false, 2)).toEqual(["a1", "a2"]);
  });

  it("p1, p2 and pick: the lapsed lease; the owner's other incarnations'; the oldest $4 of them all", async () => {
    expect(await part("p1", false)).toEqual(["x1"]);
    expect(await part("p2", true)).toEqual(["d1"]);
    expect(await part("pick", true, 3)).toEqual(["a1", "a2", "x1"]);
  });

  it("take: a pick behind a record of its chat that another scan has locked is left", async () => {
    expect(await part("take", false)).toEqual(["a1", "a2", "x1", "x2"]);
    let release!: () => void;
    const released = new Promise<void>((resolve) => (release = resolve));
    let locked!: () => void;
    const holding = new Promise<void>((resolve) => (locked = resolve));
    const other = sql!.begin(async (tx) => {
      await tx.unsafe(`SELECT 1 FROM ${db.t.inbox} WHERE id = 'x1' FOR UPDATE`);
      locked();
      await released;
    });
    try {
      await holding;
      expect(await part("p1", false), "p1 skips it").toEqual([]);
      expect(await part("seen", false)).toEqual(["x1"]);
      expect(await part("locked", false)).toEqual([]);
      expect(await part("bad", false)).toEqual(["x1"]);
      expect(await part("take", false)).toEqual(["a1", "a2"]);
    } finally {
      release();
      await other;
    }
  });

  it("every part of every variant runs alone with the parts it reads (writes rolled back)", async () => {
    expect(await db.everyPart()).toEqual([]);
  });
});
