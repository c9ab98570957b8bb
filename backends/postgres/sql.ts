/**
 * The SQL text of the Postgres backend (`backends/postgres/`): the schema
 * and its migrations, and every statement the journals, the session store
 * and the kv run. Each statement is built once per schema and table prefix
 * and prepared by the driver (one round trip per call after the first).
 *
 * The state sets and preconditions come from the state table
 * (`src/machine.ts`), rendered as SQL; the conformance suite keeps the
 * statements equal to the rules of `src/rules.ts`.
 *
 * @module
 */
import { INBOX, OUTBOX, sqlByDue, sqlIn, sqlNotIn, statesWhere } from "../../src/machine.ts";
import { TIMER_STATE } from "../../src/rules.ts";
import { ACTIVE, ASIDE_READ, asideRead, BLOCKING, chatTouchedAt, CLAIM_SET, IN_LEASED, INBOX_COLUMNS, INBOX_META_COLUMNS, inboxClaimable, KEPT, nextChatVersion, NOW_MS, OUT_LEASED, OUT_WAITING, OUTBOX_COLUMNS, OUTBOX_META_COLUMNS, outcomeOf, probe, type Tables } from "./sql_common.ts";
import { inboxClaimDueSql, outboxClaimDueSql } from "./sql_claim_due.ts";
export * from "./sql_common.ts";
export * from "./sql_schema.ts";
export * from "./sql_claim_due.ts";

/** The statements of the inbox journal. */
export interface InboxSql {
  admit: string;
  /** `admit` of several records: `$1` a JSON array of `{ i, id, kind, chat_id, provider, payload, received_at, leased, owner, inc, lease_ms }`. */
  admitMany: string;
  claim: string;
  claimReclaim: string;
  claimDue: string;
  claimDueReclaim: string;
  heartbeat: string;
  /** `start`: $3 the run's attempt number (attempts become the greater of the two). */
  start: string;
  /** `start` of several records: `$1` a JSON array of `{id, token, attempt}`. */
  startMany: string;
  /** `schedule`: $3 ms until the timer is due (`scheduled`, lease dropped, attempts unchanged). */
  schedule: string;
  /** `heartbeat` of several records: `$1` a JSON array of `{ id, token, lease_ms }`; returns the renewed ids as `mkey`. */
  heartbeatMany: string;
  complete: string;
  /** `complete` of several records: `$1` a JSON array of `{ id, token }`; returns the completed ids as `mkey`. */
  completeMany: string;
  fail: string;
  get: string;
  /** The rows of the ids in `$1`, a JSON array of them (the repeat of a named due scan). */
  getMany: string;
  replay: string;
  purge: string;
  list(chat: boolean, states: number): string;
}

/** The statements of the damaged rows of a journal (see "Damaged records" in postgres.ts). */
export interface AsideSql {
  /**
   * Sets a row aside ($1 its `ord`/`seq`, $2 the version read, $3 the problem): only the version read, and
   * only once (of concurrent callers, one changes it). Its stored columns are kept; `due_at` is cleared.
   */
  setAside: string;
  /** The row at $1 (`ord`/`seq`), as a read returns it. */
  row: string;
  /** The rows set aside, in the order they were set aside, at most $1. */
  damaged(unreported: boolean): string;
  /** Marks the set-aside row $1 (id or key) reported, once. */
  report: string;
}

/** The damaged-row statements of a journal but `setAside`. */
function asideSql(table: string, pk: string, idColumn: string, columns: string): Omit<AsideSql, "setAside"> {
  const list = `SELECT ${idColumn} AS id, damage, set_aside_at, damage_reported FROM ${table}`;
  return {
    row: `SELECT ${columns}, ${ASIDE_READ} FROM ${table} WHERE ${pk} = $1::bigint`,
    damaged: (unreported) =>
      `${list} WHERE ${unreported ? "damage_reported = false" : "set_aside_seq IS NOT NULL"} ORDER BY set_aside_seq LIMIT $1`,
    report: `UPDATE ${table} SET damage_reported = true WHERE ${idColumn} = $1 AND damage_reported = false RETURNING 1 AS ok`,
  };
}

/** What a set-aside changes: the mark, the problem ($3), the time, the order; and the due mark goes. */
const asideSet = (t: Tables) =>
  `damage = $3, set_aside_at = n.now, set_aside_seq = nextval('${t.asideSeq.replaceAll("'", "''")}'), damage_reported = false,
  due_at = NULL`;

/** The inbox statements for `t`. */
export function inboxSql(t: Tables): InboxSql & AsideSql {
  const n = `n AS (SELECT ${NOW_MS} AS now)`;
  const claimOne = (reclaim: boolean) =>
    `WITH ${n} UPDATE ${t.inbox} SET ${CLAIM_SET} FROM n WHERE id = $4 AND ${inboxClaimable(reclaim)} AND ${KEPT}
      RETURNING ${INBOX_COLUMNS}, ${asideRead(t.inbox)}`;
  // Chat order at admission (admitsLeased of rules.ts): a leased admit of chat `chat` received at `at`,
  // for the lease (`owner`, `inc`), is held back by an active record of its chat that comes before it (received
  // at or before `at`: an equal one was admitted earlier) and comes first in a due scan (pending, a retry that is
  // due, a lapsed lease) or is held by another lease than the caller's own live one. One probe of the chat's
  // active records (`inbox_chat_active`, set-aside rows left out), stopping at the first such record; OFFSET 0
  // keeps it a probe. Another admission of the chat racing on another replica is not seen (documented).
  const heldBack = (chat: string, at: string, owner: string, inc: string) => `EXISTS (
        SELECT 1 FROM ${t.inbox} b WHERE b.chat_id = ${chat} AND b.state IN (${ACTIVE}) AND b.${KEPT} AND b.received_at <= ${at}
          AND ${sqlByDue(INBOX, "b.state", {
    always: "",
    nextAttemptAt: "COALESCE(b.next_attempt_at, 0) <= n.now",
    leaseExpiry: `(b.lease_expires_at > n.now AND b.lease_owner = ${owner} AND b.lease_incarnation = ${inc}) IS NOT TRUE`,
  })}
        OFFSET 0)`;
  return {
    // One statement: the insert, leased when $7 is true and no active record of its chat comes first (see
    // heldBack), or nothing when the id is known. The check (a subplan inside CASE) runs only when $7 is true, and
    // once: \`g\` is a subquery kept apart by OFFSET 0 (pulled up, each CASE reading \`g.leased\` would run it
    // again). The INSERT comes first in the text, so that pg_stat_activity (1 KB of it by default) shows it.
    admit: `WITH ${n} INSERT INTO ${t.inbox} (id, kind, chat_id, provider, payload, received_at, state, attempts,
        next_attempt_at, lease_owner, lease_incarnation, lease_token, lease_expires_at, fence, error, updated_at, due_at)
      SELECT $1, $2, $3::text, $4, $5, $6::double precision,
        CASE WHEN g.leased THEN 'processing' ELSE 'pending' END,
        CASE WHEN g.leased THEN 1 ELSE 0 END,
        NULL,
        CASE WHEN g.leased THEN $8::text END,
        CASE WHEN g.leased THEN $9::text END,
        CASE WHEN g.leased THEN 1 END,
        CASE WHEN g.leased THEN n.now + $10::bigint END,
        CASE WHEN g.leased THEN 1 ELSE 0 END,
        NULL, n.now,
        CASE WHEN g.leased THEN n.now + $10::bigint ELSE 0 END
      FROM n, (
        SELECT CASE WHEN $7::boolean THEN NOT ${heldBack("$3::text", "$6::double precision", "$8::text", "$9::text")} ELSE false END AS leased
        FROM n OFFSET 0
      ) g
      ON CONFLICT (id) DO NOTHING
      RETURNING ${INBOX_META_COLUMNS}`,
    // In the order of the array (\`i\`): the identity column numbers the rows as a lone admit would. A leased row
    // is checked against the table (heldBack) and against the rows of this statement that come before it in its
    // chat, which the statement's snapshot does not see: \`mixed\` marks (a window over the earlier rows of its
    // chat) a row behind one that is not leased under its own lease (owner, incarnation, a live lease); only such
    // a row looks at those rows one by one, leaving out a row whose id is known (it inserts nothing). So a group
    // admits exactly as its admits would one after another, in call order. \`g\` is kept apart by OFFSET 0: each
    // row's checks run once, not once per column that reads \`g.ok\`.
    admitMany: `WITH ${n}, u AS (
        SELECT * FROM json_to_recordset($1::text::json) AS u(i integer, id text, kind text, chat_id text, provider text,
          payload text, received_at double precision, leased boolean, owner text, inc text, lease_ms bigint)
      )
      INSERT INTO ${t.inbox} (id, kind, chat_id, provider, payload, received_at, state, attempts,
        next_attempt_at, lease_owner, lease_incarnation, lease_token, lease_expires_at, fence, error, updated_at, due_at)
      SELECT g.id, g.kind, g.chat_id, g.provider, g.payload, g.received_at,
        CASE WHEN g.ok THEN 'processing' ELSE 'pending' END,
        CASE WHEN g.ok THEN 1 ELSE 0 END,
        NULL,
        CASE WHEN g.ok THEN g.owner END,
        CASE WHEN g.ok THEN g.inc END,
        CASE WHEN g.ok THEN 1 END,
        CASE WHEN g.ok THEN n.now + g.lease_ms END,
        CASE WHEN g.ok THEN 1 ELSE 0 END,
        NULL, n.now,
        CASE WHEN g.ok THEN n.now + g.lease_ms ELSE 0 END
      FROM n, (
        SELECT w.*, CASE
            WHEN NOT w.leased THEN false
            WHEN w.mixed AND EXISTS (
              SELECT 1 FROM u v WHERE v.chat_id = w.chat_id AND (v.received_at, v.i) < (w.received_at, w.i)
                AND NOT (v.leased AND v.lease_ms > 0 AND v.owner = w.owner AND v.inc = w.inc)
                AND NOT EXISTS (SELECT 1 FROM ${t.inbox} x WHERE x.id = v.id)) THEN false
            ELSE NOT ${heldBack("w.chat_id", "w.received_at", "w.owner", "w.inc")}
          END AS ok
        FROM n, (
          SELECT u.*, COALESCE(bool_or(NOT (u.leased AND u.lease_ms > 0)) OVER e
            OR min(u.owner) OVER e <> u.owner OR max(u.owner) OVER e <> u.owner
            OR min(u.inc) OVER e <> u.inc OR max(u.inc) OVER e <> u.inc, false) AS mixed
          FROM u WINDOW e AS (PARTITION BY u.chat_id ORDER BY u.received_at, u.i ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)
        ) w
        OFFSET 0
      ) g
      ORDER BY g.i
      ON CONFLICT (id) DO NOTHING
      RETURNING ${INBOX_META_COLUMNS}, id AS mkey`,
    claim: claimOne(false),
    claimReclaim: claimOne(true),
    claimDue: inboxClaimDueSql(t, false),
    claimDueReclaim: inboxClaimDueSql(t, true),
    ...asideSql(t.inbox, "ord", "id", INBOX_COLUMNS),
    setAside: `WITH ${n} UPDATE ${t.inbox} SET ${asideSet(t)}
      FROM n WHERE ord = $1::bigint AND ${t.inbox}.xmin = $2::text::xid AND ${KEPT} RETURNING 1 AS ok`,
    heartbeat: `WITH ${n} UPDATE ${t.inbox} SET lease_expires_at = n.now + $3::bigint, due_at = n.now + $3::bigint
      FROM n WHERE id = $1 AND ${sqlIn("state", IN_LEASED)} AND lease_token = $2 AND ${KEPT} RETURNING 1 AS ok`,
    start: `WITH ${n} UPDATE ${t.inbox} SET attempts = greatest(attempts, $3::integer)
      FROM n WHERE id = $1 AND ${sqlIn("state", IN_LEASED)} AND lease_token = $2 AND ${KEPT} RETURNING 1 AS ok`,
    startMany: `WITH ${n}, u AS (SELECT * FROM json_to_recordset($1::text::json) AS u(id text, token bigint, attempt integer))
      UPDATE ${t.inbox} AS r SET attempts = greatest(r.attempts, u.attempt)
      FROM n, u WHERE r.id = ANY(ARRAY(SELECT id FROM u)) AND r.id = u.id AND ${sqlIn("r.state", IN_LEASED)} AND r.lease_token = u.token AND r.${KEPT} RETURNING r.id AS mkey`,
    schedule: `WITH ${n} UPDATE ${t.inbox} SET state = '${TIMER_STATE}',
        next_attempt_at = n.now + $3::bigint, error = NULL,
        lease_owner = NULL, lease_incarnation = NULL, lease_token = NULL, lease_expires_at = NULL,
        updated_at = n.now, due_at = n.now + $3::bigint
      FROM n WHERE id = $1 AND ${sqlIn("state", IN_LEASED)} AND lease_token = $2 AND ${KEPT} RETURNING 1 AS ok`,
    heartbeatMany: `WITH ${n}, u AS (SELECT * FROM json_to_recordset($1::text::json) AS u(id text, token bigint, lease_ms bigint))
      UPDATE ${t.inbox} AS r SET lease_expires_at = n.now + u.lease_ms, due_at = n.now + u.lease_ms
      FROM n, u WHERE r.id = ANY(ARRAY(SELECT id FROM u)) AND r.id = u.id AND ${sqlIn("r.state", IN_LEASED)} AND r.lease_token = u.token AND r.${KEPT} RETURNING r.id AS mkey`,
    complete: `WITH ${n} UPDATE ${t.inbox} SET state = 'done', lease_owner = NULL, lease_incarnation = NULL,
        lease_token = NULL, lease_expires_at = NULL, next_attempt_at = NULL, updated_at = n.now, due_at = NULL
      FROM n WHERE id = $1 AND ${sqlIn("state", IN_LEASED)} AND lease_token = $2 AND ${KEPT} RETURNING 1 AS ok`,
    completeMany: `WITH ${n}, u AS (SELECT * FROM json_to_recordset($1::text::json) AS u(id text, token bigint))
      UPDATE ${t.inbox} AS r SET state = 'done', lease_owner = NULL, lease_incarnation = NULL,
        lease_token = NULL, lease_expires_at = NULL, next_attempt_at = NULL, updated_at = n.now, due_at = NULL
      FROM n, u WHERE r.id = ANY(ARRAY(SELECT id FROM u)) AND r.id = u.id AND ${sqlIn("r.state", IN_LEASED)} AND r.lease_token = u.token AND r.${KEPT} RETURNING r.id AS mkey`,
    // $3: dead; $4: error; $5: retry delay (ms).
    fail: `WITH ${n} UPDATE ${t.inbox} SET
        state = CASE WHEN $3::boolean THEN 'dead' ELSE 'failed' END,
        next_attempt_at = CASE WHEN $3::boolean THEN NULL ELSE n.now + $5::bigint END,
        error = $4, lease_owner = NULL, lease_incarnation = NULL, lease_token = NULL, lease_expires_at = NULL,
        updated_at = n.now,
        due_at = CASE WHEN $3::boolean THEN NULL ELSE n.now + $5::bigint END
      FROM n WHERE id = $1 AND ${sqlIn("state", IN_LEASED)} AND lease_token = $2 AND ${KEPT} RETURNING 1 AS ok`,
    get: `SELECT ${INBOX_COLUMNS}, ${ASIDE_READ} FROM ${t.inbox} WHERE id = $1`,
    getMany: `SELECT r.* FROM (SELECT DISTINCT json_array_elements_text($1::text::json) COLLATE "C" AS id) k
      CROSS JOIN ${probe(t.inbox, `${INBOX_COLUMNS}, ${ASIDE_READ}`, "id", "k.id")} r`,
    replay: `WITH ${n} UPDATE ${t.inbox} SET state = 'pending', attempts = 0, next_attempt_at = NULL,
        lease_owner = NULL, lease_incarnation = NULL, lease_token = NULL, lease_expires_at = NULL,
        error = NULL, updated_at = n.now, due_at = 0
      FROM n WHERE id = $1 AND ${sqlIn("state", statesWhere(INBOX, "retryable"))} AND ${KEPT} RETURNING 1 AS ok`,
    // One bounded batch ($2 rows) of `done` records changed more than $1 ms ago, oldest first. `= ANY(ARRAY(…))`
    // (not `IN (…)`, which the planner may hash-join against the whole table) deletes them by the primary key.
    purge: `DELETE FROM ${t.inbox} WHERE ord = ANY(ARRAY(
        SELECT ord FROM ${t.inbox}
        WHERE ${sqlIn("state", statesWhere(INBOX, "purgeable"))} AND updated_at <= (SELECT ${NOW_MS}) - $1::bigint AND ${KEPT}
        ORDER BY updated_at LIMIT $2 FOR UPDATE SKIP LOCKED))`,
    list: (chat, states) => listSql(t.inbox, `${INBOX_COLUMNS}, ${ASIDE_READ}`, "received_at, ord", chat, states),
  };
}

// ---- inbox claimDue, in parts --------------------------------------------------------
// As outbox claimDue's (see SqlPart). $1 owner, $2 incarnation, $3 lease ms, $4 limit.

/** A list of the rows not set aside: optional chat ($1), states ($2…), the limit last. */
function listSql(table: string, columns: string, order: string, chat: boolean, states: number): string {
  const where: string[] = [KEPT];
  let k = 1;
  if (chat) where.push(`chat_id = $${k++}`);
  if (states > 0) where.push(`state IN (${Array.from({ length: states }, () => `$${k++}`).join(", ")})`);
  return `SELECT ${columns} FROM ${table} WHERE ${where.join(" AND ")} ORDER BY ${order} LIMIT $${k}`;
}

/** The statements of the outbox journal. */
export interface OutboxSql {
  reserve: string;
  /**
   * `reserve` of several entries of distinct chats and keys: `$1` a JSON array of `{ i, key, chat_id, content,
   * content_hash, inbound_id, leased, owner, inc, lease_ms }`; returns each entry's row (as `reserve` does) with
   * its key as `mkey`.
   */
  reserveMany: string;
  claimDue(reclaimOwn: boolean, resend: boolean): string;
  heartbeat: string;
  /** `heartbeat` of several entries: `$1` a JSON array of `{ key, token, lease_ms }`; returns the renewed keys as `mkey`. */
  heartbeatMany: string;
  markCalling: string;
  /** `markCalling` of several entries: `$1` as {@link OutboxSql.heartbeatMany}. */
  markCallingMany: string;
  markSent: string;
  /** `markSent` of several entries: `$1` a JSON array of `{ key, token, message_id }`; returns the sent keys as `mkey`. */
  markSentMany: string;
  /** Locks the chat rows of `$1` (a JSON array of chat ids) in chat order: a group's first statement (see `connection.ts`). */
  lockChats: string;
  markFailed: string;
  markAmbiguous: string;
  get: string;
  /** The rows of the keys in `$1`, a JSON array of them (the repeat of a named due scan). */
  getMany: string;
  retry: string;
  discard: string;
  purge: string;
  purgeChats: string;
  list(chat: boolean, states: number): string;
}

/**
 * The outbox statements for `t`.
 *
 * ## Due marks: chat heads only
 * `due_at` (the due index) is set on an entry that is `queued`/`failed` only when it is its
 * chat's head (no earlier entry of the chat is `queued`, `sending` or `failed`), so a due scan
 * reads the heads and never the tail queued behind them: O(due), not O(all). A due mark on a
 * non-head (a "stray", e.g. the old head after a `retry` of an earlier entry) is harmless: the
 * scan re-checks headship. The invariant: every `queued`/`failed` head carries a due mark, or its
 * chat row has `resync` set (a claimDue then finds and marks the head).
 *
 * Every statement that changes which entries of a chat block it (reserve; markSent, markFailed,
 * discard, setAside, retry; claimDue's move of a lost `sending` entry to `unknown`) first locks
 * the chat row and stamps it with a new version (`ver`), in the same statement. The chat row
 * lock serializes them per chat. A statement that finds the version it replaced equal to the one
 * its own snapshot saw knows its snapshot holds the chat's current blocking entries (every change
 * to them committed since would have changed the version), and marks the head itself.
 *
 * The race this guards against: a reserve sees an unsettled head in its snapshot and stores its
 * new entry without a due mark; a statement settling that head at the same moment, whose snapshot
 * started before the reserve committed, cannot see the new entry, so it cannot mark it, and
 * nothing else would: the entry would be stranded. Here the settle waits for the chat row lock
 * held by the reserve, then sees the chat's version differ from its snapshot's and sets `resync`.
 * (The other order: the settle commits first, then the reserve sees the version changed and sets
 * `resync`.) So whenever a statement's snapshot may be stale for its chat, it sets `resync`.
 *
 * claimDue consumes `resync` through a partial index: it locks such chat rows (SKIP LOCKED),
 * and for those whose locked version equals its snapshot's (its snapshot is current for the chat,
 * and the lock keeps it so until commit) it clears the flag and marks the head, found by the
 * active `(chat_id, seq)` index (`LATERAL … LIMIT 1`). The marked head is leased by the next
 * scan. claimDue never waits: every row it locks it takes with SKIP LOCKED; a head locked by
 * another claimDue is being leased by it. The other statements lock the chat row before the
 * entries (the entry UPDATE joins the chat lock's CTE), so no two of them deadlock.
 */
export function outboxSql(t: Tables): OutboxSql & AsideSql {
  const n = `n AS (SELECT ${NOW_MS} AS now)`;
  // acceptsOutcome of rules.ts ($2 the token): leased with it, or `unknown` with it still the fence
  // (a late outcome of the call whose lease was taken for lost resolves the entry).
  const OUTCOME_OF = `${outcomeOf("", "$2")} AND ${KEPT}`;
  const nextVer = nextChatVersion(t);
  // The chat lock of a statement whose entry is the one row of CTE `e` (seq, chat_id, in the snapshot):
  // `snap` the chat's version in the snapshot; `lk` upserts the chat row (waits for the other
  // statements of the chat), stamps a new version and sets `resync` when the version it replaced
  // is not the snapshot's (or the row is new).
  const chatLock = `
    snap AS (SELECT c.ver FROM ${t.chat} c WHERE c.chat_id = (SELECT chat_id FROM e)),
    lk AS (
      INSERT INTO ${t.chat} AS c (chat_id, ver, prev, touched_at, resync)
      SELECT e.chat_id, ${nextVer}, NULL, n.now, true FROM e, n
      ON CONFLICT (chat_id) DO UPDATE SET ver = EXCLUDED.ver, prev = c.ver, touched_at = ${chatTouchedAt("c", "EXCLUDED.touched_at")},
        resync = c.resync OR c.ver IS DISTINCT FROM (SELECT ver FROM snap)
      RETURNING c.chat_id
    )`;
  // A heartbeat (or, with `set`, markCalling) of several entries: `$1` a JSON array of { key, token, lease_ms }.
  const renewMany = (set: string) => `WITH ${n},
    w AS (SELECT * FROM json_to_recordset($1::text::json) AS w(key text, token bigint, lease_ms bigint))
    UPDATE ${t.outbox} AS o SET lease_expires_at = n.now + w.lease_ms, due_at = n.now + w.lease_ms${set}
    FROM n, w WHERE o.key = ANY(ARRAY(SELECT key FROM w)) AND o.key = w.key AND ${sqlIn("o.state", OUT_LEASED)} AND o.lease_token = w.token AND o.${KEPT} RETURNING o.key AS mkey`;
  // After the settle `u` (seq, chat_id) of an entry: the chat's next head (the first entry that blocks,
  // other than the settled one, in the snapshot) gets its due mark when it has none.
  const nextHead = (when = "true") => `
    nx AS (
      UPDATE ${t.outbox} AS o SET due_at = coalesce(o.next_attempt_at, n.now)
      FROM n, (
        SELECT b.seq FROM ${t.outbox} b, u
        WHERE ${when} AND b.chat_id = u.chat_id AND b.state IN (${BLOCKING}) AND b.${KEPT} AND b.seq <> u.seq
        ORDER BY b.seq LIMIT 1
      ) h
      WHERE o.seq = h.seq AND o.state IN (${OUT_WAITING}) AND o.due_at IS NULL
      RETURNING 1
    )`;
  return {
    // One statement (see the module documentation of postgres.ts, "Per-chat order", and "Due marks" above):
    // `old` the entry when the key is known (in this statement's snapshot); `snap` the chat row's
    // version in that snapshot; `lk` upserts the chat row, which waits for and then serializes
    // the statements of one chat, and returns the version it replaced (`prev`), setting `resync`
    // when that is not the snapshot's. The entry is the chat's head when nothing changed the chat
    // since the snapshot (prev = snap) and the snapshot has no unsettled entry of the chat: only
    // then is it due-marked, and leased when $6. The seq is drawn after the chat row is locked,
    // so a chat's seqs follow the order its reserves took the lock.
    // $1 key, $2 chat, $3 content, $4 hash, $5 inbound id, $6 lease?, $7 owner, $8 incarnation, $9 lease ms,
    // $10 calling? (a leased entry is written with its call announced: `uncalled_fence` NULL, see newOutboxEntry).
    reserve: `WITH ${n},
    old AS (SELECT ${OUTBOX_COLUMNS}, ${ASIDE_READ} FROM ${t.outbox} WHERE key = $1),
    snap AS (SELECT ver FROM ${t.chat} WHERE chat_id = $2),
    lk AS (
      INSERT INTO ${t.chat} AS c (chat_id, ver, prev, touched_at, resync)
      SELECT $2, ${nextVer}, NULL, n.now, (SELECT ver FROM snap) IS NOT NULL FROM n WHERE NOT EXISTS (SELECT 1 FROM old)
      ON CONFLICT (chat_id) DO UPDATE SET ver = EXCLUDED.ver, prev = c.ver, touched_at = ${chatTouchedAt("c", "EXCLUDED.touched_at")},
        resync = c.resync OR c.ver IS DISTINCT FROM (SELECT ver FROM snap)
      RETURNING c.prev
    ),
    h AS MATERIALIZED (
      SELECT n.now, (lk.prev IS NOT DISTINCT FROM (SELECT ver FROM snap)
        AND NOT EXISTS (SELECT 1 FROM ${t.outbox} b WHERE b.chat_id = $2 AND b.state IN (${BLOCKING}) AND b.${KEPT})) AS head
      FROM n, lk
    ),
    d AS (SELECT h.now, h.head, ($6::boolean AND h.head) AS leased FROM h),
    ins AS (
      INSERT INTO ${t.outbox} (key, chat_id, content, content_hash, inbound_id, state, attempts, next_attempt_at,
        lease_owner, lease_incarnation, lease_token, lease_expires_at, fence, uncalled_fence, message_id, error, created_at, updated_at,
        due_at)
      SELECT $1, $2, $3, $4, $5::text,
        CASE WHEN d.leased THEN 'sending' ELSE 'queued' END,
        CASE WHEN d.leased THEN 1 ELSE 0 END,
        CASE WHEN d.leased THEN NULL ELSE d.now END,
        CASE WHEN d.leased THEN $7::text END,
        CASE WHEN d.leased THEN $8::text END,
        CASE WHEN d.leased THEN 1 END,
        CASE WHEN d.leased THEN d.now + $9::bigint END,
        CASE WHEN d.leased THEN 1 ELSE 0 END,
        CASE WHEN d.leased AND $10::boolean THEN NULL WHEN d.leased THEN 1 ELSE 0 END,
        NULL, NULL, d.now, d.now,
        CASE WHEN d.leased THEN d.now + $9::bigint WHEN d.head THEN d.now END
      FROM d
      ON CONFLICT (key) DO NOTHING
      RETURNING ${OUTBOX_META_COLUMNS}
    )
    SELECT 'new' AS status, ${OUTBOX_META_COLUMNS}, NULL::text AS content, NULL::bigint AS set_aside_seq, NULL::text AS damage,
      NULL::text AS xv FROM ins
    UNION ALL
    SELECT 'exists' AS status, ${OUTBOX_META_COLUMNS}, content, set_aside_seq, damage, xv FROM old`,
    // `reserve` of entries of distinct chats (the caller never puts two of one chat, or of one key, in one
    // statement), each exactly as a lone reserve: `old`, `snap`, `lk` (the chat rows locked in chat order),
    // `h` per entry; the entries are inserted in call order (`i`), so their seqs follow it.
    reserveMany: `WITH ${n},
    w AS (
      SELECT * FROM json_to_recordset($1::text::json) AS w(i integer, key text, chat_id text, content text, content_hash text,
        inbound_id text, leased boolean, owner text, inc text, lease_ms bigint, calling boolean)
    ),
    old AS (SELECT o.* FROM w CROSS JOIN ${probe(t.outbox, `${OUTBOX_COLUMNS}, ${ASIDE_READ}`, "key", "w.key")} o),
    snap AS (SELECT c.chat_id, c.ver FROM w CROSS JOIN ${probe(t.chat, "chat_id, ver", "chat_id", "w.chat_id")} c),
    lk AS (
      INSERT INTO ${t.chat} AS c (chat_id, ver, prev, touched_at, resync)
      SELECT w.chat_id, ${nextVer}, NULL, n.now, EXISTS (SELECT 1 FROM snap s WHERE s.chat_id = w.chat_id) FROM w, n
      WHERE NOT EXISTS (SELECT 1 FROM old WHERE old.key = w.key)
      ORDER BY w.chat_id COLLATE "C"
      ON CONFLICT (chat_id) DO UPDATE SET ver = EXCLUDED.ver, prev = c.ver, touched_at = ${chatTouchedAt("c", "EXCLUDED.touched_at")},
        resync = c.resync OR c.ver IS DISTINCT FROM (SELECT s.ver FROM snap s WHERE s.chat_id = c.chat_id)
      RETURNING c.chat_id, c.prev
    ),
    h AS MATERIALIZED (
      SELECT w.i, w.key, w.chat_id, w.content, w.content_hash, w.inbound_id, w.leased, w.owner, w.inc, w.lease_ms, w.calling, n.now,
        (lk.prev IS NOT DISTINCT FROM (SELECT s.ver FROM snap s WHERE s.chat_id = w.chat_id)
          AND NOT EXISTS (SELECT 1 FROM ${t.outbox} b WHERE b.chat_id = w.chat_id AND b.state IN (${BLOCKING}) AND b.${KEPT})) AS head
      FROM w JOIN lk ON lk.chat_id = w.chat_id, n
    ),
    d AS (SELECT h.*, (h.leased AND h.head) AS dl FROM h),
    ins AS (
      INSERT INTO ${t.outbox} (key, chat_id, content, content_hash, inbound_id, state, attempts, next_attempt_at,
        lease_owner, lease_incarnation, lease_token, lease_expires_at, fence, uncalled_fence, message_id, error, created_at, updated_at,
        due_at)
      SELECT d.key, d.chat_id, d.content, d.content_hash, d.inbound_id,
        CASE WHEN d.dl THEN 'sending' ELSE 'queued' END,
        CASE WHEN d.dl THEN 1 ELSE 0 END,
        CASE WHEN d.dl THEN NULL ELSE d.now END,
        CASE WHEN d.dl THEN d.owner END,
        CASE WHEN d.dl THEN d.inc END,
        CASE WHEN d.dl THEN 1 END,
        CASE WHEN d.dl THEN d.now + d.lease_ms END,
        CASE WHEN d.dl THEN 1 ELSE 0 END,
        CASE WHEN d.dl AND d.calling IS TRUE THEN NULL WHEN d.dl THEN 1 ELSE 0 END,
        NULL, NULL, d.now, d.now,
        CASE WHEN d.dl THEN d.now + d.lease_ms WHEN d.head THEN d.now END
      FROM d ORDER BY d.i
      ON CONFLICT (key) DO NOTHING
      RETURNING ${OUTBOX_META_COLUMNS}
    )
    SELECT 'new' AS status, ${OUTBOX_META_COLUMNS}, NULL::text AS content, NULL::bigint AS set_aside_seq, NULL::text AS damage,
      NULL::text AS xv, key AS mkey FROM ins
    UNION ALL
    SELECT 'exists' AS status, ${OUTBOX_META_COLUMNS}, content, set_aside_seq, damage, xv, key AS mkey FROM old`,
    claimDue: (reclaim, resend) => outboxClaimDueSql(t, reclaim, resend),
    ...asideSql(t.outbox, "seq", "key", OUTBOX_COLUMNS),
    // An entry set aside no longer blocks its chat: when it did, it settles as markSent does (chat lock, the
    // next head gets its due mark). Its state, lease and content are kept as stored.
    setAside: `WITH ${n},
    e AS (SELECT seq, chat_id FROM ${t.outbox} WHERE seq = $1::bigint AND xmin = $2::text::xid AND ${KEPT}),${chatLock},
    u AS (
      UPDATE ${t.outbox} SET ${asideSet(t)}
      FROM n, lk WHERE seq = $1::bigint AND ${t.outbox}.xmin = $2::text::xid AND ${t.outbox}.${KEPT}
      RETURNING seq, ${t.outbox}.chat_id, ${t.outbox}.state
    ),${nextHead(`u.state IN (${BLOCKING})`)}
    SELECT 1 AS ok FROM u`,
    heartbeat: `WITH ${n} UPDATE ${t.outbox} SET lease_expires_at = n.now + $3::bigint, due_at = n.now + $3::bigint
      FROM n WHERE key = $1 AND ${sqlIn("state", OUT_LEASED)} AND lease_token = $2 AND ${KEPT} RETURNING 1 AS ok`,
    // A heartbeat that also journals the provider call (called: uncalled_fence no longer the fence).
    markCalling: `WITH ${n} UPDATE ${t.outbox} SET lease_expires_at = n.now + $3::bigint, due_at = n.now + $3::bigint,
        uncalled_fence = NULL
      FROM n WHERE key = $1 AND ${sqlIn("state", OUT_LEASED)} AND lease_token = $2 AND ${KEPT} RETURNING 1 AS ok`,
    // (Each row locked by its own probe, the probes made in chat order.)
    lockChats: `WITH k AS MATERIALIZED (SELECT DISTINCT json_array_elements_text($1::text::json) COLLATE "C" AS chat_id ORDER BY 1)
      SELECT 1 FROM k CROSS JOIN ${probe(t.chat, "1", "chat_id", "k.chat_id", "FOR UPDATE")} l`,
    heartbeatMany: renewMany(""),
    markCallingMany: renewMany(", uncalled_fence = NULL"),
    // markSent of several entries, as they would be one after another in one transaction: the chats of the
    // entries are locked (in chat order, so two such statements never wait on each other in a cycle) and
    // stamped as a lone markSent does, then the entries settle, then each chat's next head (the first
    // blocking entry that is not one settled here) gets its due mark.
    markSentMany: `WITH ${n},
    w AS (SELECT * FROM json_to_recordset($1::text::json) AS w(key text, token bigint, message_id text)),
    e AS (
      SELECT o.seq, o.chat_id, w.key, w.token, w.message_id FROM ${t.outbox} o, w
      WHERE o.key = ANY(ARRAY(SELECT key FROM w)) AND o.key = w.key AND ${outcomeOf("o.", "w.token")}
        AND o.${KEPT}
      ORDER BY o.seq
    ),
    snap AS (SELECT c.chat_id, c.ver FROM ${t.chat} c WHERE c.chat_id IN (SELECT chat_id FROM e)),
    lk AS (
      INSERT INTO ${t.chat} AS c (chat_id, ver, prev, touched_at, resync)
      SELECT ec.chat_id, ${nextVer}, NULL, n.now, true FROM (SELECT DISTINCT chat_id FROM e) ec, n ORDER BY ec.chat_id
      ON CONFLICT (chat_id) DO UPDATE SET ver = EXCLUDED.ver, prev = c.ver, touched_at = ${chatTouchedAt("c", "EXCLUDED.touched_at")},
        resync = c.resync OR c.ver IS DISTINCT FROM (SELECT s.ver FROM snap s WHERE s.chat_id = c.chat_id)
      RETURNING c.chat_id
    ),
    u AS (
      UPDATE ${t.outbox} AS o SET state = 'sent', message_id = e.message_id, lease_owner = NULL,
        lease_incarnation = NULL, lease_token = NULL, lease_expires_at = NULL, next_attempt_at = NULL,
        updated_at = n.now, due_at = NULL
      FROM n, e WHERE o.seq = e.seq AND e.chat_id = ANY(ARRAY(SELECT chat_id FROM lk))
        AND ${outcomeOf("o.", "e.token")} AND o.${KEPT}
      RETURNING o.seq, o.chat_id, e.key
    ),
    nx AS (
      UPDATE ${t.outbox} AS o SET due_at = coalesce(o.next_attempt_at, n.now)
      FROM n, (
        SELECT h.seq FROM (SELECT DISTINCT chat_id FROM u) uc CROSS JOIN LATERAL (
          SELECT b.seq FROM ${t.outbox} b
          WHERE b.chat_id = uc.chat_id AND b.state IN (${BLOCKING}) AND b.${KEPT} AND b.seq NOT IN (SELECT seq FROM u)
          ORDER BY b.seq LIMIT 1
        ) h
      ) h
      WHERE o.seq = h.seq AND o.state IN (${OUT_WAITING}) AND o.due_at IS NULL
      RETURNING 1
    )
    SELECT key AS mkey FROM u`,
    markSent: `WITH ${n},
    e AS (SELECT seq, chat_id FROM ${t.outbox} WHERE key = $1 AND ${OUTCOME_OF}),${chatLock},
    u AS (
      UPDATE ${t.outbox} SET state = 'sent', message_id = $3, lease_owner = NULL,
        lease_incarnation = NULL, lease_token = NULL, lease_expires_at = NULL, next_attempt_at = NULL,
        updated_at = n.now, due_at = NULL
      FROM n, lk WHERE key = $1 AND ${OUTCOME_OF} RETURNING seq, ${t.outbox}.chat_id
    ),${nextHead()}
    SELECT 1 AS ok FROM u`,
    // A retry (not dead) leaves the entry the chat's head, or makes a resolved `unknown` one block its chat
    // again: its due mark is a head's, or a stray (an earlier entry blocks) that the scan re-checks, and the
    // old head's mark becomes a stray. Dead settles it (the next head gets its mark). $6: a throttled
    // retry (a 429: nothing was sent) gives its attempt back.
    markFailed: `WITH ${n},
    e AS (SELECT seq, chat_id FROM ${t.outbox} WHERE key = $1 AND ${OUTCOME_OF}),${chatLock},
    u AS (
      UPDATE ${t.outbox} SET
        state = CASE WHEN $3::boolean THEN 'dead' ELSE 'failed' END,
        next_attempt_at = CASE WHEN $3::boolean THEN NULL ELSE n.now + $5::bigint END,
        error = $4, lease_owner = NULL, lease_incarnation = NULL, lease_token = NULL, lease_expires_at = NULL,
        updated_at = n.now,
        attempts = CASE WHEN $6::boolean THEN greatest(0, ${t.outbox}.attempts - 1) ELSE ${t.outbox}.attempts END,
        due_at = CASE WHEN $3::boolean THEN NULL ELSE n.now + $5::bigint END
      FROM n, lk WHERE key = $1 AND ${OUTCOME_OF} RETURNING seq, ${t.outbox}.chat_id
    ),${nextHead("$3::boolean")}
    SELECT 1 AS ok FROM u`,
    // markFailed with an ambiguous outcome ($3 the error): `unknown` exactly as claimDue's move of a lost
    // `sending` entry (lease dropped, next_attempt_at NULL, fence and attempts kept, no due mark). It no
    // longer blocks its chat: it settles like markSent (chat lock, the next head gets its due mark).
    markAmbiguous: `WITH ${n},
    e AS (SELECT seq, chat_id FROM ${t.outbox} WHERE key = $1 AND ${OUTCOME_OF}),${chatLock},
    u AS (
      UPDATE ${t.outbox} SET state = 'unknown', next_attempt_at = NULL, error = $3, lease_owner = NULL,
        lease_incarnation = NULL, lease_token = NULL, lease_expires_at = NULL, updated_at = n.now, due_at = NULL
      FROM n, lk WHERE key = $1 AND ${OUTCOME_OF} RETURNING seq, ${t.outbox}.chat_id
    ),${nextHead()}
    SELECT 1 AS ok FROM u`,
    get: `SELECT ${OUTBOX_COLUMNS}, ${ASIDE_READ} FROM ${t.outbox} WHERE key = $1`,
    getMany: `SELECT o.* FROM (SELECT DISTINCT json_array_elements_text($1::text::json) COLLATE "C" AS key) k
      CROSS JOIN ${probe(t.outbox, `${OUTBOX_COLUMNS}, ${ASIDE_READ}`, "key", "k.key")} o`,
    // The entry becomes unsettled again (chat lock: a reserve of the chat whose snapshot predates this
    // one does not lease past it). Due-marked when it is the chat's head in the snapshot; an old head
    // keeps its mark (a stray, re-checked by the scan).
    retry: `WITH ${n},
    e AS (SELECT seq, chat_id FROM ${t.outbox} WHERE key = $1 AND ${sqlIn("state", statesWhere(OUTBOX, "retryable"))} AND ${KEPT}),${chatLock},
    r AS (
      UPDATE ${t.outbox} AS o SET state = 'queued', next_attempt_at = n.now, attempts = 0, lease_owner = NULL,
        lease_incarnation = NULL, lease_token = NULL, lease_expires_at = NULL, updated_at = n.now,
        due_at = CASE WHEN NOT EXISTS (
          SELECT 1 FROM ${t.outbox} b WHERE b.chat_id = o.chat_id AND b.state IN (${BLOCKING}) AND b.${KEPT} AND b.seq < o.seq
        ) THEN n.now END
      FROM n, lk WHERE o.key = $1 AND ${sqlIn("o.state", statesWhere(OUTBOX, "retryable"))} AND o.${KEPT} RETURNING o.chat_id
    )
    SELECT count(*)::int AS n FROM r`,
    discard: `WITH ${n},
    e AS (SELECT seq, chat_id FROM ${t.outbox} WHERE key = $1 AND ${sqlNotIn("state", statesWhere(OUTBOX, (t) => !t.discardable))} AND ${KEPT}),${chatLock},
    u AS (
      DELETE FROM ${t.outbox} USING lk WHERE key = $1 AND ${sqlNotIn("state", statesWhere(OUTBOX, (t) => !t.discardable))} AND ${KEPT} RETURNING seq, ${t.outbox}.chat_id
    ),${nextHead()}
    SELECT 1 AS ok FROM u`,
    purge: `DELETE FROM ${t.outbox} WHERE seq = ANY(ARRAY(
        SELECT seq FROM ${t.outbox}
        WHERE ${sqlIn("state", statesWhere(OUTBOX, "purgeable"))} AND updated_at <= (SELECT ${NOW_MS}) - $1::bigint AND ${KEPT}
        ORDER BY updated_at LIMIT $2 FOR UPDATE SKIP LOCKED))`,
    // Chat rows untouched for $1 ms whose chat has no entry left.
    purgeChats: `DELETE FROM ${t.chat} WHERE chat_id = ANY(ARRAY(
        SELECT c.chat_id FROM ${t.chat} c
        WHERE c.touched_at <= (SELECT ${NOW_MS}) - $1::bigint
          AND NOT EXISTS (SELECT 1 FROM ${t.outbox} o WHERE o.chat_id = c.chat_id)
        ORDER BY c.touched_at LIMIT $2 FOR UPDATE SKIP LOCKED))`,
    list: (chat, states) => listSql(t.outbox, `${OUTBOX_COLUMNS}, ${ASIDE_READ}`, "seq", chat, states),
  };
}

// ---- outbox claimDue, in parts -------------------------------------------------------
// Each CTE of the statement is a part of its own (see SqlPart), so that it can be read, and run, alone.
// The parameters are claimDue's: $1 owner, $2 incarnation, $3 lease ms, $4 limit.

/** The statements of the session store. */
export interface SessionSql {
  get: string;
  set: string;
  delete: string;
  sweep: string;
}

/** The session statements for `t`. */
export function sessionSql(t: Tables): SessionSql {
  return {
    get: `SELECT value FROM ${t.session} WHERE key = $1 AND (expires_at IS NULL OR expires_at > (SELECT ${NOW_MS}))`,
    // $3: ttl in ms, or null.
    set: `INSERT INTO ${t.session} (key, value, expires_at) VALUES ($1, $2, ${NOW_MS} + $3::bigint)
      ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value, expires_at = EXCLUDED.expires_at`,
    delete: `DELETE FROM ${t.session} WHERE key = $1`,
    sweep: `DELETE FROM ${t.session} WHERE key = ANY(ARRAY(
        SELECT key FROM ${t.session} WHERE expires_at <= (SELECT ${NOW_MS})
        ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED))`,
  };
}

/** The statements of the kv. */
export interface KvSql {
  get: string;
  setAny: string;
  setNew: string;
  setIf: string;
  delete: string;
  deleteIf: string;
  now: string;
  list(upper: boolean, after: boolean, limit: boolean): string;
}

/** The kv statements for `t`. Versions come from one sequence: never reused, not even after a delete. */
export function kvSql(t: Tables): KvSql {
  const next = `nextval('${t.kvVersion.replaceAll("'", "''")}')`;
  return {
    get: `SELECT key, value, version FROM ${t.kv} WHERE key = $1`,
    setAny: `INSERT INTO ${t.kv} (key, value, version) VALUES ($1, $2, ${next})
      ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value, version = EXCLUDED.version RETURNING version`,
    setNew: `INSERT INTO ${t.kv} (key, value, version) VALUES ($1, $2, ${next})
      ON CONFLICT (key) DO NOTHING RETURNING version`,
    setIf: `UPDATE ${t.kv} SET value = $2, version = ${next} WHERE key = $1 AND version = $3::bigint RETURNING version`,
    delete: `DELETE FROM ${t.kv} WHERE key = $1`,
    deleteIf: `DELETE FROM ${t.kv} WHERE key = $1 AND version = $2::bigint`,
    now: `SELECT ${NOW_MS} AS now`,
    // $1 lower bound (the prefix), then the upper bound, `after` and the limit when present.
    list: (upper, after, limit) => {
      let k = 2;
      const where = [`key >= $1`];
      if (upper) where.push(`key < $${k++}`);
      if (after) where.push(`key > $${k++}`);
      return `SELECT key, value, version FROM ${t.kv} WHERE ${where.join(" AND ")} ORDER BY key COLLATE "C"${
        limit ? ` LIMIT $${k}` : ""
      }`;
    },
  };
}
