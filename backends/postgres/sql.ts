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
import { INBOX, OUTBOX, sqlByDue, sqlIn, sqlNotIn, sqlStates, statesDueBy, statesWhere } from "../../src/machine.ts";
import { ACTIVE_INBOX_STATES, BLOCKING_OUTBOX_STATES, LEGACY_TIMER_ERROR, TIMER_STATE } from "../../src/rules.ts";

/** The schema version this version of the library writes. */
export const POSTGRES_SCHEMA_VERSION: number = 7;

/** The server clock in ms since epoch (the replicas' clocks are never used). */
export const NOW_MS: string = "(extract(epoch from clock_timestamp()) * 1000)::bigint";

/** The statement's clock, read once (`n` is a CTE of every statement that needs it); an InitPlan, so index scans can use it. */
const NOW = "(SELECT now FROM n)";

/**
 * One CTE of a statement, to be read and run alone (see {@link partAlone}): its `name`, the parts it `reads`,
 * what its `rows` are (its columns, or what its UPDATE returns), its `text` (the body between `name AS (` and
 * `)`), and a `note`: an SQL comment put above it in the statement.
 */
export interface SqlPart {
  name: string;
  reads: string[];
  rows: string;
  text: string;
  materialized?: boolean;
  note?: string;
}

/** `n`: the statement's clock, read once (see {@link NOW}). */
const NOW_PART: SqlPart = { name: "n", reads: [], rows: "now", text: `SELECT ${NOW_MS} AS now` };

/** `name AS (…)`: a body of one short line inline, a longer one on lines of its own. */
function cte(p: SqlPart): string {
  const body = p.text.includes("\n") || p.text.length > 80 ? `\n      ${p.text}\n    ` : p.text;
  return `${p.note ? `-- ${p.note}\n    ` : ""}${p.name} AS ${p.materialized ? "MATERIALIZED " : ""}(${body})`;
}

/** The statement of `parts` (in order: a part reads only those before it) ending in `last`. */
export function withParts(parts: SqlPart[], last: string): string {
  return `WITH ${parts.map(cte).join(",\n    ")}\n    ${last}`;
}

/** Part `name` alone: `WITH` the parts it reads, directly or not, and itself, `SELECT * FROM name`. */
export function partAlone(parts: SqlPart[], name: string): string {
  if (!parts.some((p) => p.name === name)) throw new Error(`no part ${name}`);
  const needed = new Set([name]);
  for (const p of [...parts].reverse()) if (needed.has(p.name)) p.reads.forEach((r) => needed.add(r));
  return withParts(parts.filter((p) => needed.has(p.name)), `SELECT * FROM ${name}`);
}

/** What a migration `RAISE`s when the schema is newer than this library (the JS side words the error). */
export const NEWER_SCHEMA_MARK: string = "botmesh-schema-newer:";

/** Where schema and table names are allowed: lowercase letters, digits and `_`, not starting with a digit. */
export const IDENTIFIER: RegExp = /^[a-z_][a-z0-9_]*$/;

/** The longest suffix a table or index name gets after the prefix (Postgres cuts names at 63 bytes). */
export const LONGEST_SUFFIX: number = "outbox_chat_touched".length;

/** A double-quoted identifier (names are checked against {@link IDENTIFIER} first; quotes doubled all the same). */
export function ident(name: string): string {
  return `"${name.replaceAll('"', '""')}"`;
}

/** A single-quoted SQL string literal. */
function literal(text: string): string {
  return `'${text.replaceAll("'", "''")}'`;
}

const BLOCKING = BLOCKING_OUTBOX_STATES.map((s) => literal(s)).join(", ");
const ACTIVE = ACTIVE_INBOX_STATES.map((s) => literal(s)).join(", ");
/** The leased inbox state(s) (`processing`). */
const IN_LEASED = statesWhere(INBOX, "leased");
/** The leased outbox state(s) (`sending`). */
const OUT_LEASED = statesWhere(OUTBOX, "leased");
/** Outbox states due at their `next_attempt_at` once first in their chat (`queued`, `failed`). */
const OUT_WAITING = sqlStates(statesDueBy(OUTBOX, "nextAttemptAt"));
/** `acceptsOutcome` of rules.ts for the token `token` (columns prefixed by `r`). */
const outcomeOf = (r: string, token: string) =>
  `((${sqlIn(`${r}state`, OUT_LEASED)} AND ${r}lease_token = ${token}) OR (${
    sqlIn(`${r}state`, statesWhere(OUTBOX, "acceptsLateOutcome"))
  } AND ${r}fence = ${token}))`;

/**
 * A row not set aside as damaged (schema version 5: `set_aside_seq` is set on a row set aside, NULL on every
 * other). Every statement but a read by key or a report leaves set-aside rows out: they are never due, never
 * hold back a chat, never change (the due scans' chat order checks included).
 */
const KEPT = "set_aside_seq IS NULL";
/**
 * What a read returns besides a row's columns: its set-aside mark and problem, and its version (`xmin`), which
 * fences the statement that sets it aside (it applies only to the version read: see `setAside`).
 */
const ASIDE_READ = "set_aside_seq, damage, xmin::text AS xv";
const asideRead = (alias: string) => `${alias}.set_aside_seq, ${alias}.damage, ${alias}.xmin::text AS xv`;

export const INBOX_COLUMNS: string =
  "ord, id, kind, chat_id, provider, payload, received_at, state, attempts, next_attempt_at, lease_owner, lease_incarnation, lease_token, lease_expires_at, fence, error, updated_at";
/** Every inbox column but the payload (what `admit` returns: the payload is the caller's checked copy). */
const INBOX_META_COLUMNS = INBOX_COLUMNS.replace(" payload,", "");
/**
 * The outbox columns. `uncalled_fence` holds the entry's `called` flag (schema version 3): the entry is
 * uncalled (`called: false`) exactly when `uncalled_fence = fence`. Every claim sets it to the fence it
 * issues, a leased or queued reserve to the entry's fence; `markCalling` sets it NULL. So a row written
 * before the column existed (NULL), or claimed by a replica still running a library that predates it
 * (it raises the fence, not this), reads as called: a lost send of theirs stays ambiguous.
 */
export const OUTBOX_COLUMNS: string =
  "seq, key, chat_id, content, content_hash, inbound_id, state, attempts, next_attempt_at, lease_owner, lease_incarnation, lease_token, lease_expires_at, fence, uncalled_fence, message_id, error, created_at, updated_at";
const OUTBOX_META_COLUMNS = OUTBOX_COLUMNS.replace(" content,", "");

/** The qualified names of one schema + prefix. */
export interface Tables {
  schema: string;
  prefix: string;
  meta: string;
  inbox: string;
  outbox: string;
  chat: string;
  chatVersion: string;
  session: string;
  kv: string;
  kvVersion: string;
  /** The sequence of `set_aside_seq` (both journals). */
  asideSeq: string;
  /** The answers of named due scans, kept for their repeats (schema version 7, see `scan_answers.ts`). */
  scanAnswer: string;
}

/** The quoted, schema-qualified names of the tables and sequences under `prefix`. */
export function tables(schema: string, prefix: string): Tables {
  const q = (name: string) => `${ident(schema)}.${ident(prefix + name)}`;
  return {
    schema,
    prefix,
    meta: q("meta"),
    inbox: q("inbox"),
    outbox: q("outbox"),
    chat: q("outbox_chat"),
    chatVersion: q("outbox_chat_ver"),
    session: q("session"),
    kv: q("kv"),
    kvVersion: q("kv_version"),
    asideSeq: q("aside_seq"),
    scanAnswer: q("scan_answer"),
  };
}

/** The next chat row version (the `ver` a statement stamps a chat row with). */
const nextChatVersion = (t: Tables) => `nextval('${t.chatVersion.replaceAll("'", "''")}')`;

/**
 * The ordered migrations, as PL/pgSQL statements run inside the migration
 * block. Never edit a shipped one: append one and raise
 * {@link POSTGRES_SCHEMA_VERSION}.
 */
function migrations(t: Tables): string[] {
  const p = t.prefix;
  const i = (name: string) => ident(p + name);
  return [
    // Version 1.
    `
    CREATE TABLE ${t.inbox} (
      ord bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
      id text COLLATE "C" NOT NULL UNIQUE,
      kind text NOT NULL,
      chat_id text COLLATE "C" NOT NULL,
      provider text NOT NULL,
      payload text NOT NULL,
      received_at double precision NOT NULL,
      state text NOT NULL,
      attempts integer NOT NULL,
      next_attempt_at bigint,
      lease_owner text COLLATE "C",
      lease_incarnation text COLLATE "C",
      lease_token bigint,
      lease_expires_at bigint,
      fence bigint NOT NULL,
      error text,
      updated_at bigint NOT NULL,
      due_at bigint
    );
    CREATE INDEX ${i("inbox_due")} ON ${t.inbox} (due_at, received_at, ord) WHERE due_at IS NOT NULL;
    CREATE INDEX ${i("inbox_owner")} ON ${t.inbox} (lease_owner) WHERE lease_owner IS NOT NULL;
    CREATE INDEX ${i("inbox_received")} ON ${t.inbox} (received_at, ord);
    CREATE INDEX ${i("inbox_chat")} ON ${t.inbox} (chat_id, received_at, ord);
    CREATE INDEX ${i("inbox_state")} ON ${t.inbox} (state, received_at, ord);
    CREATE INDEX ${i("inbox_done")} ON ${t.inbox} (updated_at) WHERE ${sqlIn("state", statesWhere(INBOX, "purgeable"))};

    CREATE TABLE ${t.outbox} (
      seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
      key text COLLATE "C" NOT NULL UNIQUE,
      chat_id text COLLATE "C" NOT NULL,
      content text NOT NULL,
      content_hash text NOT NULL,
      inbound_id text,
      state text NOT NULL,
      attempts integer NOT NULL,
      next_attempt_at bigint,
      lease_owner text COLLATE "C",
      lease_incarnation text COLLATE "C",
      lease_token bigint,
      lease_expires_at bigint,
      fence bigint NOT NULL,
      message_id text,
      error text,
      created_at bigint NOT NULL,
      updated_at bigint NOT NULL,
      due_at bigint
    );
    CREATE INDEX ${i("outbox_due")} ON ${t.outbox} (due_at, seq) WHERE due_at IS NOT NULL;
    CREATE INDEX ${i("outbox_owner")} ON ${t.outbox} (lease_owner) WHERE lease_owner IS NOT NULL;
    CREATE INDEX ${i("outbox_chat_active")} ON ${t.outbox} (chat_id, seq) WHERE state IN (${BLOCKING});
    CREATE INDEX ${i("outbox_chat_all")} ON ${t.outbox} (chat_id, seq);
    CREATE INDEX ${i("outbox_state")} ON ${t.outbox} (state, seq);
    CREATE INDEX ${i("outbox_sent")} ON ${t.outbox} (updated_at) WHERE ${sqlIn("state", statesWhere(OUTBOX, "purgeable"))};

    CREATE SEQUENCE ${t.chatVersion};
    CREATE TABLE ${t.chat} (
      chat_id text COLLATE "C" PRIMARY KEY,
      ver bigint NOT NULL,
      prev bigint,
      touched_at bigint NOT NULL
    );
    CREATE INDEX ${i("outbox_chat_touched")} ON ${t.chat} (touched_at);

    CREATE TABLE ${t.session} (
      key text COLLATE "C" PRIMARY KEY,
      value text NOT NULL,
      expires_at bigint
    );
    CREATE INDEX ${i("session_expiry")} ON ${t.session} (expires_at) WHERE expires_at IS NOT NULL;

    CREATE SEQUENCE ${t.kvVersion};
    CREATE TABLE ${t.kv} (
      key text COLLATE "C" PRIMARY KEY,
      value text NOT NULL,
      version bigint NOT NULL
    );
    `,
    // Version 2: the outbox due index holds chat heads only (see outboxSql); a chat row's `resync`
    // asks a claimDue to find and mark its head. Due marks of entries behind an unsettled one go.
    `
    ALTER TABLE ${t.chat} ADD COLUMN resync boolean NOT NULL DEFAULT false;
    CREATE INDEX ${i("outbox_chat_resync")} ON ${t.chat} (chat_id) WHERE resync;
    UPDATE ${t.outbox} o SET due_at = NULL
      WHERE o.due_at IS NOT NULL AND o.state IN (${OUT_WAITING})
        AND EXISTS (SELECT 1 FROM ${t.outbox} b WHERE b.chat_id = o.chat_id AND b.state IN (${BLOCKING}) AND b.seq < o.seq);
    `,
    // Version 3: the outbox entry's `called` flag (see OUTBOX_COLUMNS). The existing rows get NULL (no
    // rewrite of the table): they read as called, as every entry was treated before the flag existed.
    `
    ALTER TABLE ${t.outbox} ADD COLUMN IF NOT EXISTS uncalled_fence bigint;
    `,
    // Version 4: each chat's active inbox records in arrival order, for the due scan's chat order (see
    // inboxSql). IF NOT EXISTS: an operator may build it beforehand, CONCURRENTLY, under this name.
    `
    CREATE INDEX IF NOT EXISTS ${i("inbox_chat_active")} ON ${t.inbox} (chat_id, received_at, ord) WHERE state IN (${ACTIVE});
    `,
    // Version 5: damaged rows are set aside, not made dead (see "Damaged records" in postgres.ts): `damage` (the
    // problem, naming the column), `set_aside_at`, `set_aside_seq` (the order rows were set aside in) and
    // `damage_reported`, NULL on every other row (no table rewrite). The partial indexes hold set-aside rows
    // only. IF NOT EXISTS: an operator may build them beforehand, CONCURRENTLY, under these names.
    `
    ALTER TABLE ${t.inbox} ADD COLUMN IF NOT EXISTS damage text, ADD COLUMN IF NOT EXISTS set_aside_at bigint,
      ADD COLUMN IF NOT EXISTS set_aside_seq bigint, ADD COLUMN IF NOT EXISTS damage_reported boolean;
    ALTER TABLE ${t.outbox} ADD COLUMN IF NOT EXISTS damage text, ADD COLUMN IF NOT EXISTS set_aside_at bigint,
      ADD COLUMN IF NOT EXISTS set_aside_seq bigint, ADD COLUMN IF NOT EXISTS damage_reported boolean;
    CREATE SEQUENCE IF NOT EXISTS ${t.asideSeq};
    CREATE INDEX IF NOT EXISTS ${i("inbox_aside")} ON ${t.inbox} (set_aside_seq) WHERE set_aside_seq IS NOT NULL;
    CREATE INDEX IF NOT EXISTS ${i("inbox_unreported")} ON ${t.inbox} (set_aside_seq) WHERE damage_reported = false;
    CREATE INDEX IF NOT EXISTS ${i("outbox_aside")} ON ${t.outbox} (set_aside_seq) WHERE set_aside_seq IS NOT NULL;
    CREATE INDEX IF NOT EXISTS ${i("outbox_unreported")} ON ${t.outbox} (set_aside_seq) WHERE damage_reported = false;
    `,
    // Version 6: timers are a state of their own, `scheduled` (see src/machine.ts). It is active, so each
    // chat's active records are indexed again under a new name that holds it (IF NOT EXISTS: an operator
    // may build it beforehand, CONCURRENTLY), and the old index goes. A timer an older version armed as a
    // `failed` record ("Not a failure: a timer, due at …") becomes `scheduled`, due when it was.
    `
    UPDATE ${t.inbox} SET state = '${TIMER_STATE}', error = NULL
      WHERE state = 'failed' AND error LIKE '${LEGACY_TIMER_ERROR}%' AND set_aside_seq IS NULL;
    CREATE INDEX IF NOT EXISTS ${i("inbox_chat_live")} ON ${t.inbox} (chat_id, received_at, ord) WHERE state IN (${ACTIVE});
    DROP INDEX IF EXISTS ${ident(t.schema)}.${i("inbox_chat_active")};
    `,
    // Version 7: the answers of due scans named by a requestId, kept for a while so that a scan whose
    // reply was lost can be asked again (see scan_answers.ts). A new table: nothing else changes.
    `
    CREATE TABLE IF NOT EXISTS ${t.scanAnswer} (
      journal text COLLATE "C" NOT NULL,
      id text COLLATE "C" NOT NULL,
      answer text NOT NULL,
      stored_at bigint NOT NULL,
      PRIMARY KEY (journal, id)
    );
    CREATE INDEX IF NOT EXISTS ${i("scan_answer_at")} ON ${t.scanAnswer} (stored_at);
    `,
  ];
}

/**
 * The migration: one `DO` block, so one statement and one transaction. It
 * takes a transaction-scoped advisory lock on the schema first, so that
 * replicas starting together migrate one after the other (each later one
 * finds the schema current), creates the schema and the meta table when
 * missing, refuses a schema version newer than this library (raising
 * {@link NEWER_SCHEMA_MARK} and the version), and runs the migrations the
 * schema lacks.
 */
export function migrationSql(t: Tables): string {
  const steps = migrations(t);
  if (steps.length !== POSTGRES_SCHEMA_VERSION) throw new Error("migrations and POSTGRES_SCHEMA_VERSION disagree");
  const metaName = `${ident(t.schema)}.${ident(t.prefix + "meta")}`;
  return `DO $botmesh$
DECLARE
  current integer;
BEGIN
  PERFORM pg_advisory_xact_lock(1651471469, hashtext(${literal(`botmesh schema ${t.schema}`)}));
  IF NOT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = ${literal(t.schema)}) THEN
    CREATE SCHEMA ${ident(t.schema)};
  END IF;
  IF to_regclass(${literal(metaName)}) IS NULL THEN
    CREATE TABLE ${t.meta} (key text PRIMARY KEY, value text NOT NULL);
  END IF;
  SELECT value::integer INTO current FROM ${t.meta} WHERE key = 'schema_version';
  current := coalesce(current, 0);
  IF current > ${POSTGRES_SCHEMA_VERSION} THEN
    RAISE EXCEPTION '${NEWER_SCHEMA_MARK}%', current;
  END IF;
${steps.map((step, n) => `  IF current < ${n + 1} THEN${step}  END IF;`).join("\n")}
  IF current < ${POSTGRES_SCHEMA_VERSION} THEN
    INSERT INTO ${t.meta} (key, value) VALUES ('schema_version', '${POSTGRES_SCHEMA_VERSION}')
      ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value;
  END IF;
END
$botmesh$`;
}

// ---- the journals --------------------------------------------------------------
// Parameters are numbered per statement; every bigint parameter is an integer
// (durations are rounded up and clamped by the caller).

/** Whether an inbox record (columns prefixed by `r`, an alias and its dot) is claimable under ($1 owner, $2 incarnation, reclaimOwn) at `now`. */
function inboxClaimable(reclaimOwn: boolean, r = "", now = "n.now"): string {
  // A lapsed lease is abandoned whoever asks (its holder's own incarnation too: a claim whose reply was
  // lost must not strand the record); a live one only under reclaimOwn, for the owner's other incarnations.
  const abandoned = `(${r}lease_owner IS NULL OR ${r}lease_expires_at <= ${now}${
    reclaimOwn ? ` OR (${r}lease_owner = $1 AND ${r}lease_incarnation <> $2)` : ""
  })`;
  return sqlByDue(INBOX, `${r}state`, {
    always: "",
    nextAttemptAt: `coalesce(${r}next_attempt_at, 0) <= ${now}`,
    leaseExpiry: abandoned,
  });
}

/** The SET list of a claim: leased to ($1, $2) for $3 ms with token fence+1, attempts unchanged (a claim is not a run). */
const CLAIM_SET = `state = 'processing', next_attempt_at = NULL,
  lease_owner = $1, lease_incarnation = $2, lease_token = fence + 1, lease_expires_at = n.now + $3::bigint,
  fence = fence + 1, updated_at = n.now, due_at = n.now + $3::bigint`;

/**
 * The SET list of an outbox claim (claimedOutbox of rules.ts): leased to ($1, $2) for $3 ms with
 * token fence+1, uncalled under it, except a lost `sending` entry whose call was announced (re-leased by
 * resendAmbiguous): it stays called. A lost `sending` entry whose call was never announced (uncalled under
 * its fence) started no attempt: the new lease keeps its number.
 */
const OUT_CLAIM_SET = `state = 'sending',
  attempts = CASE WHEN state = 'sending' AND uncalled_fence = fence THEN attempts ELSE attempts + 1 END,
  next_attempt_at = NULL, lease_owner = $1, lease_incarnation = $2, lease_token = fence + 1,
  lease_expires_at = n.now + $3::bigint, fence = fence + 1,
  uncalled_fence = CASE WHEN state = 'sending' AND uncalled_fence IS DISTINCT FROM fence THEN NULL ELSE fence + 1 END,
  updated_at = n.now,
  due_at = n.now + $3::bigint`;

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
  /** `schedule`: $3 ms until the timer is due (`scheduled`, lease dropped, attempts unchanged). */
  schedule: string;
  /** `heartbeat` of several records: `$1` a JSON array of `{ id, token, lease_ms }`; returns the renewed ids as `mkey`. */
  heartbeatMany: string;
  complete: string;
  /** `complete` of several records: `$1` a JSON array of `{ id, token }`; returns the completed ids as `mkey`. */
  completeMany: string;
  fail: string;
  get: string;
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
    schedule: `WITH ${n} UPDATE ${t.inbox} SET state = '${TIMER_STATE}',
        next_attempt_at = n.now + $3::bigint, error = NULL,
        lease_owner = NULL, lease_incarnation = NULL, lease_token = NULL, lease_expires_at = NULL,
        updated_at = n.now, due_at = n.now + $3::bigint
      FROM n WHERE id = $1 AND ${sqlIn("state", IN_LEASED)} AND lease_token = $2 AND ${KEPT} RETURNING 1 AS ok`,
    heartbeatMany: `WITH ${n}, u AS (SELECT * FROM json_to_recordset($1::text::json) AS u(id text, token bigint, lease_ms bigint))
      UPDATE ${t.inbox} AS r SET lease_expires_at = n.now + u.lease_ms, due_at = n.now + u.lease_ms
      FROM n, u WHERE r.id = u.id AND ${sqlIn("r.state", IN_LEASED)} AND r.lease_token = u.token AND r.${KEPT} RETURNING r.id AS mkey`,
    complete: `WITH ${n} UPDATE ${t.inbox} SET state = 'done', lease_owner = NULL, lease_incarnation = NULL,
        lease_token = NULL, lease_expires_at = NULL, next_attempt_at = NULL, updated_at = n.now, due_at = NULL
      FROM n WHERE id = $1 AND ${sqlIn("state", IN_LEASED)} AND lease_token = $2 AND ${KEPT} RETURNING 1 AS ok`,
    completeMany: `WITH ${n}, u AS (SELECT * FROM json_to_recordset($1::text::json) AS u(id text, token bigint))
      UPDATE ${t.inbox} AS r SET state = 'done', lease_owner = NULL, lease_incarnation = NULL,
        lease_token = NULL, lease_expires_at = NULL, next_attempt_at = NULL, updated_at = n.now, due_at = NULL
      FROM n, u WHERE r.id = u.id AND ${sqlIn("r.state", IN_LEASED)} AND r.lease_token = u.token AND r.${KEPT} RETURNING r.id AS mkey`,
    // $3: dead; $4: error; $5: retry delay (ms).
    fail: `WITH ${n} UPDATE ${t.inbox} SET
        state = CASE WHEN $3::boolean THEN 'dead' ELSE 'failed' END,
        next_attempt_at = CASE WHEN $3::boolean THEN NULL ELSE n.now + $5::bigint END,
        error = $4, lease_owner = NULL, lease_incarnation = NULL, lease_token = NULL, lease_expires_at = NULL,
        updated_at = n.now,
        due_at = CASE WHEN $3::boolean THEN NULL ELSE n.now + $5::bigint END
      FROM n WHERE id = $1 AND ${sqlIn("state", IN_LEASED)} AND lease_token = $2 AND ${KEPT} RETURNING 1 AS ok`,
    get: `SELECT ${INBOX_COLUMNS}, ${ASIDE_READ} FROM ${t.inbox} WHERE id = $1`,
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

/** What the parts of inbox claimDue are built for: the tables and reclaimOwn. */
interface InboxScan {
  t: Tables;
  reclaim: boolean;
}

/** holdsChat of rules.ts for the record `b` (an alias): a live lease (only a processing record has one) neither the caller's nor one it may take. */
const heldElsewhere = (b: string, reclaim: boolean) =>
  `${b}.lease_expires_at > ${NOW} AND (${b}.lease_owner IS DISTINCT FROM $1${
    reclaim ? "" : ` OR ${b}.lease_incarnation IS DISTINCT FROM $2`
  })`;

/**
 * That no earlier record of the chat of `i` is held elsewhere in the snapshot, so a chat held elsewhere does
 * not fill the batch. A probe of the chat's active records (their index: no state or owner test another index
 * could serve) per row; OFFSET 0 keeps it one (not a join with every leased record).
 */
const chatFree = ({ t, reclaim }: InboxScan) =>
  `NOT EXISTS (
        SELECT 1 FROM ${t.inbox} b WHERE b.chat_id = i.chat_id AND b.state IN (${ACTIVE}) AND b.${KEPT}
          AND (b.received_at, b.ord) < (i.received_at, i.ord) AND ${heldElsewhere("b", reclaim)} OFFSET 0)`;

/** The columns of a branch (`p0`, `p1`, `p2`). */
const BRANCH_COLUMNS = "i.ord, i.chat_id, i.received_at";

/** `p0`: the pending records (due at 0) whose chat is free, oldest first from the due index, $4, locked. */
function pendingDue(s: InboxScan): SqlPart {
  return {
    name: "p0",
    reads: ["n"],
    rows: "ord, chat_id, received_at",
    text: `SELECT ${BRANCH_COLUMNS} FROM ${s.t.inbox} i WHERE i.due_at = 0 AND i.${KEPT} AND ${chatFree(s)}
      ORDER BY i.received_at, i.ord LIMIT $4 FOR UPDATE OF i SKIP LOCKED`,
  };
}

/**
 * `p1`: the records due at a time that has come (retries, timers, lapsed leases) whose chat is free, by a range
 * of the due index, $4, locked. It sorts by expressions (`+ 0`) so that the planner reads the due range rather
 * than walk the receipt index in order (its estimate of that range is poor).
 */
function timedDue(s: InboxScan): SqlPart {
  return {
    name: "p1",
    reads: ["n"],
    rows: "ord, chat_id, received_at",
    text: `SELECT ${BRANCH_COLUMNS} FROM ${s.t.inbox} i WHERE i.due_at > 0 AND i.due_at <= ${NOW} AND i.${KEPT} AND ${chatFree(s)}
      ORDER BY i.received_at + 0, i.ord LIMIT $4 FOR UPDATE OF i SKIP LOCKED`,
  };
}

/** `p2` (reclaimOwn): the records leased by the owner's other incarnations whose chat is free (owner index), $4, locked. */
function otherIncarnations(s: InboxScan): SqlPart {
  return {
    name: "p2",
    reads: ["n"],
    rows: "ord, chat_id, received_at",
    text: `SELECT ${BRANCH_COLUMNS} FROM ${s.t.inbox} i
      WHERE i.lease_owner = $1 AND ${sqlIn("i.state", IN_LEASED)} AND i.lease_incarnation <> $2 AND i.${KEPT} AND ${chatFree(s)}
      ORDER BY i.received_at, i.ord LIMIT $4 FOR UPDATE OF i SKIP LOCKED`,
  };
}

/** `pick`: the oldest $4 of the branches. */
function picked({ reclaim }: InboxScan): SqlPart {
  return {
    name: "pick",
    reads: reclaim ? ["p0", "p1", "p2"] : ["p0", "p1"],
    rows: "ord, chat_id, received_at",
    text: `SELECT u.ord, u.chat_id, u.received_at FROM (SELECT * FROM p0 UNION SELECT * FROM p1${reclaim ? " UNION SELECT * FROM p2" : ""}) u
      ORDER BY u.received_at, u.ord LIMIT $4`,
  };
}

/** `c`: the pick, materialized (several parts read it). */
const PICK_KEPT: SqlPart = {
  name: "c",
  reads: ["pick"],
  rows: "chat_id, received_at, ord",
  materialized: true,
  text: "SELECT pick.chat_id, pick.received_at, pick.ord FROM pick",
};

/** `seen`: per chat of the pick, its other active records up to its last picked one (in the snapshot). */
function earlierSeen({ t }: InboxScan): SqlPart {
  return {
    name: "seen",
    reads: ["c"],
    rows: "ord, chat_id, received_at",
    materialized: true,
    text: `SELECT s.ord, s.chat_id, s.received_at
      FROM (SELECT DISTINCT ON (c.chat_id) c.chat_id, c.received_at, c.ord FROM c ORDER BY c.chat_id, c.received_at DESC, c.ord DESC) l
      CROSS JOIN LATERAL (
        SELECT e.ord, e.chat_id, e.received_at FROM ${t.inbox} e
        WHERE e.chat_id = l.chat_id AND e.state IN (${ACTIVE}) AND e.${KEPT} AND (e.received_at, e.ord) <= (l.received_at, l.ord)
      ) s
      WHERE s.ord NOT IN (SELECT ord FROM c)`,
  };
}

/**
 * `locked`: the records of `seen` locked FOR KEY SHARE SKIP LOCKED, which reads their latest version; it waits
 * for nothing and does not hold up a heartbeat or a completion.
 */
function earlierLocked({ t }: InboxScan): SqlPart {
  return {
    name: "locked",
    reads: ["seen"],
    rows: "ord, chat_id, received_at and what holdsChat and the claimable check read",
    materialized: true,
    text: `SELECT k.ord, k.chat_id, k.received_at, k.state, k.next_attempt_at, k.lease_owner, k.lease_incarnation, k.lease_expires_at,
        k.set_aside_seq
      FROM ${t.inbox} k WHERE k.ord = ANY(ARRAY(SELECT ord FROM seen))
      FOR KEY SHARE OF k SKIP LOCKED`,
  };
}

/**
 * `bad`: the records of `seen` that keep the later picks of their chat from being taken: held elsewhere (latest
 * version), claimable but not picked (another scan may be taking it), or not locked (another scan has it locked).
 */
function earlierBlocking({ reclaim }: InboxScan): SqlPart {
  return {
    name: "bad",
    reads: ["locked", "seen", "n"],
    rows: "chat_id, received_at, ord",
    text: `SELECT k.chat_id, k.received_at, k.ord FROM locked k WHERE k.${KEPT} AND ((${heldElsewhere("k", reclaim)}) OR ${
      inboxClaimable(reclaim, "k.", NOW)
    })
      UNION ALL
      SELECT s.chat_id, s.received_at, s.ord FROM seen s WHERE s.ord NOT IN (SELECT ord FROM locked)`,
  };
}

/** `take`: the picks with no `bad` record before them in their chat. */
const TAKEN: SqlPart = {
  name: "take",
  reads: ["c", "bad"],
  rows: "ord",
  text: `SELECT c.ord FROM c WHERE NOT EXISTS (
        SELECT 1 FROM bad WHERE bad.chat_id = c.chat_id AND (bad.received_at, bad.ord) < (c.received_at, c.ord))`,
};

/**
 * The parts of inbox claimDue, in statement order. Due records in arrival order, in LIMITed branches that each
 * read an index in order (so a backlog of settled rows, or a long pending queue, is never walked): `p0`, `p1`
 * and with reclaimOwn `p2`. Each branch locks what it reads (FOR UPDATE SKIP LOCKED: concurrent claimers take
 * disjoint sets) and leaves out a record that an earlier one of its chat holds back in the statement's snapshot;
 * `pick` keeps the oldest $4 of them. The branches' other rows (at most 2 × $4) stay locked until the statement
 * ends, then are free.
 *
 * Chat order (holdsChat of rules.ts) is then checked on the latest row versions, which the snapshot may not
 * hold: a concurrent scan may have leased an earlier record of the chat and committed, or be leasing it now.
 * A picked record is taken only when no earlier record of its chat (`seen`, `locked`) is `bad`. The picked
 * records themselves are locked by their branch, which rechecked them on their latest version. So of two
 * concurrent scans that pick from one chat, the one whose picks come later in the chat finds the other's
 * earlier picks locked, or leased elsewhere once the other committed, or still claimable, and leaves the rest
 * of the chat to a later scan.
 */
export function inboxClaimDueParts(t: Tables, reclaim: boolean): SqlPart[] {
  const s: InboxScan = { t, reclaim };
  const branches = reclaim ? [pendingDue(s), timedDue(s), otherIncarnations(s)] : [pendingDue(s), timedDue(s)];
  return [NOW_PART, ...branches, picked(s), PICK_KEPT, earlierSeen(s), earlierLocked(s), earlierBlocking(s), TAKEN];
}

/** Inbox claimDue: its parts, then the UPDATE that leases what is taken, the claimable check repeated. */
export function inboxClaimDueSql(t: Tables, reclaim: boolean): string {
  return withParts(
    inboxClaimDueParts(t, reclaim),
    `UPDATE ${t.inbox} AS r SET ${CLAIM_SET} FROM take, n
    WHERE r.ord = take.ord AND ${inboxClaimable(reclaim, "r.")} AND r.${KEPT}
    RETURNING ${INBOX_COLUMNS.split(", ").map((c) => `r.${c}`).join(", ")}, ${asideRead("r")}`,
  );
}

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
  markFailed: string;
  markAmbiguous: string;
  get: string;
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
      ON CONFLICT (chat_id) DO UPDATE SET ver = EXCLUDED.ver, prev = c.ver, touched_at = EXCLUDED.touched_at,
        resync = c.resync OR c.ver IS DISTINCT FROM (SELECT ver FROM snap)
      RETURNING c.chat_id
    )`;
  // A heartbeat (or, with `set`, markCalling) of several entries: `$1` a JSON array of { key, token, lease_ms }.
  const renewMany = (set: string) => `WITH ${n},
    w AS (SELECT * FROM json_to_recordset($1::text::json) AS w(key text, token bigint, lease_ms bigint))
    UPDATE ${t.outbox} AS o SET lease_expires_at = n.now + w.lease_ms, due_at = n.now + w.lease_ms${set}
    FROM n, w WHERE o.key = w.key AND ${sqlIn("o.state", OUT_LEASED)} AND o.lease_token = w.token AND o.${KEPT} RETURNING o.key AS mkey`;
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
    // $1 key, $2 chat, $3 content, $4 hash, $5 inbound id, $6 lease?, $7 owner, $8 incarnation, $9 lease ms.
    reserve: `WITH ${n},
    old AS (SELECT ${OUTBOX_COLUMNS}, ${ASIDE_READ} FROM ${t.outbox} WHERE key = $1),
    snap AS (SELECT ver FROM ${t.chat} WHERE chat_id = $2),
    lk AS (
      INSERT INTO ${t.chat} AS c (chat_id, ver, prev, touched_at, resync)
      SELECT $2, ${nextVer}, NULL, n.now, (SELECT ver FROM snap) IS NOT NULL FROM n WHERE NOT EXISTS (SELECT 1 FROM old)
      ON CONFLICT (chat_id) DO UPDATE SET ver = EXCLUDED.ver, prev = c.ver, touched_at = EXCLUDED.touched_at,
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
        CASE WHEN d.leased THEN 1 ELSE 0 END,
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
        inbound_id text, leased boolean, owner text, inc text, lease_ms bigint)
    ),
    old AS (SELECT ${OUTBOX_COLUMNS}, ${ASIDE_READ} FROM ${t.outbox} WHERE key IN (SELECT key FROM w)),
    snap AS (SELECT c.chat_id, c.ver FROM ${t.chat} c WHERE c.chat_id IN (SELECT chat_id FROM w)),
    lk AS (
      INSERT INTO ${t.chat} AS c (chat_id, ver, prev, touched_at, resync)
      SELECT w.chat_id, ${nextVer}, NULL, n.now, EXISTS (SELECT 1 FROM snap s WHERE s.chat_id = w.chat_id) FROM w, n
      WHERE NOT EXISTS (SELECT 1 FROM old WHERE old.key = w.key)
      ORDER BY w.chat_id
      ON CONFLICT (chat_id) DO UPDATE SET ver = EXCLUDED.ver, prev = c.ver, touched_at = EXCLUDED.touched_at,
        resync = c.resync OR c.ver IS DISTINCT FROM (SELECT s.ver FROM snap s WHERE s.chat_id = c.chat_id)
      RETURNING c.chat_id, c.prev
    ),
    h AS MATERIALIZED (
      SELECT w.i, w.key, w.chat_id, w.content, w.content_hash, w.inbound_id, w.leased, w.owner, w.inc, w.lease_ms, n.now,
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
        CASE WHEN d.dl THEN 1 ELSE 0 END,
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
      WHERE o.key = w.key AND ${outcomeOf("o.", "w.token")}
        AND o.${KEPT}
    ),
    snap AS (SELECT c.chat_id, c.ver FROM ${t.chat} c WHERE c.chat_id IN (SELECT chat_id FROM e)),
    lk AS (
      INSERT INTO ${t.chat} AS c (chat_id, ver, prev, touched_at, resync)
      SELECT ec.chat_id, ${nextVer}, NULL, n.now, true FROM (SELECT DISTINCT chat_id FROM e) ec, n ORDER BY ec.chat_id
      ON CONFLICT (chat_id) DO UPDATE SET ver = EXCLUDED.ver, prev = c.ver, touched_at = EXCLUDED.touched_at,
        resync = c.resync OR c.ver IS DISTINCT FROM (SELECT s.ver FROM snap s WHERE s.chat_id = c.chat_id)
      RETURNING c.chat_id
    ),
    u AS (
      UPDATE ${t.outbox} AS o SET state = 'sent', message_id = e.message_id, lease_owner = NULL,
        lease_incarnation = NULL, lease_token = NULL, lease_expires_at = NULL, next_attempt_at = NULL,
        updated_at = n.now, due_at = NULL
      FROM n, e, lk WHERE o.seq = e.seq AND lk.chat_id = e.chat_id
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

/** What the parts of outbox claimDue are built for: the tables, reclaimOwn and resendAmbiguous. */
interface OutboxScan {
  t: Tables;
  reclaim: boolean;
  resend: boolean;
}

/** The outbox columns of the row alias `alias`. */
const outboxColumnsOf = (alias: string) => OUTBOX_COLUMNS.split(", ").map((c) => `${alias}.${c}`).join(", ");

/**
 * `lost0`: the abandoned `sending` entries (lease lapsed: a sending entry's due mark is its lease's expiry;
 * or, under reclaimOwn, leased by the owner's other incarnations), locked, with whether their call was never
 * announced (`uncalled`; read from the locked, latest row version, so a markCalling that committed first
 * makes it called). With resend all of them are leased again, so at most $4.
 */
function abandonedSends({ t, reclaim, resend }: OutboxScan): SqlPart {
  return {
    name: "lost0",
    reads: ["n"],
    rows: "seq, chat_id, uncalled",
    text: `SELECT o.seq, o.chat_id, coalesce(o.uncalled_fence = o.fence, false) AS uncalled FROM ${t.outbox} o
      WHERE ${sqlIn("o.state", statesDueBy(OUTBOX, "leaseExpiry"))} AND o.${KEPT} AND (o.due_at <= ${NOW}${
      reclaim ? ` OR (o.lease_owner = $1 AND o.lease_incarnation <> $2)` : ""
    })
      ORDER BY o.seq${resend ? " LIMIT $4" : ""}
      FOR UPDATE OF o SKIP LOCKED`,
  };
}

/** `lost` with resend: every abandoned entry is leased again (the uncalled ones reported as due only). */
const ALL_ABANDONED: SqlPart = { name: "lost", reads: ["lost0"], rows: "seq, uncalled", text: "SELECT l.seq, l.uncalled FROM lost0 l" };

/** `called` (without resend): the abandoned entries whose call was announced, so whose outcome is ambiguous. */
const CALLED_ABANDONED: SqlPart = {
  name: "called",
  reads: ["lost0"],
  rows: "seq, chat_id",
  text: "SELECT l.seq, l.chat_id FROM lost0 l WHERE NOT l.uncalled",
};

/**
 * `lc`: the chat rows of the called entries, locked (SKIP LOCKED: a called entry whose chat row another
 * statement holds is left to a later scan). Moving an entry to `unknown` changes which entries block its chat.
 */
function calledChatsLocked({ t }: OutboxScan): SqlPart {
  return {
    name: "lc",
    reads: ["called"],
    rows: "chat_id",
    text: `SELECT c.chat_id FROM ${t.chat} c WHERE c.chat_id IN (SELECT chat_id FROM called)
      FOR UPDATE OF c SKIP LOCKED`,
  };
}

/**
 * `lcu`: the locked chat rows stamped with a new version, `resync` set when the locked version is not the
 * snapshot's; `current` when it is (the snapshot holds the chat's blocking entries).
 */
function calledChatsStamped({ t }: OutboxScan): SqlPart {
  return {
    name: "lcu",
    reads: ["lc", "n"],
    rows: "chat_id, current",
    text: `UPDATE ${t.chat} AS c SET ver = ${nextChatVersion(t)}, prev = c.ver, touched_at = n.now,
        resync = c.resync OR c.ver IS DISTINCT FROM (SELECT s.ver FROM ${t.chat} s WHERE s.chat_id = c.chat_id)
      FROM lc, n WHERE c.chat_id = lc.chat_id
      RETURNING c.chat_id, c.prev IS NOT DISTINCT FROM (SELECT s.ver FROM ${t.chat} s WHERE s.chat_id = c.chat_id) AS current`,
  };
}

/** `lnh`: the next head of each current chat of `lcu` (the called entries left out), when it waits: due-marked by `rsm`. */
function calledChatsNextHeads({ t }: OutboxScan): SqlPart {
  return {
    name: "lnh",
    reads: ["lcu", "called"],
    rows: "seq",
    note: "The next head of a chat whose snapshot is current (the entries made unknown left out): due-marked below.",
    text: `SELECT h.seq FROM lcu CROSS JOIN LATERAL (
        SELECT b.seq, b.state FROM ${t.outbox} b
        WHERE b.chat_id = lcu.chat_id AND b.state IN (${BLOCKING}) AND b.${KEPT} AND b.seq NOT IN (SELECT seq FROM called)
        ORDER BY b.seq LIMIT 1
      ) h
      WHERE lcu.current AND h.state IN (${OUT_WAITING})`,
  };
}

/** `lost` without resend: the called entries that go `unknown`, those whose chat row was locked (or that have none). */
function calledToUnknown({ t }: OutboxScan): SqlPart {
  return {
    name: "lost",
    reads: ["called", "lcu"],
    rows: "seq, uncalled",
    text: `SELECT l.seq, false AS uncalled FROM called l
      WHERE l.chat_id IN (SELECT chat_id FROM lcu) OR NOT EXISTS (SELECT 1 FROM ${t.chat} x WHERE x.chat_id = l.chat_id)`,
  };
}

/**
 * `relost` (without resend): the uncalled abandoned entries, leased again as due work (no attempt was started:
 * OUT_CLAIM_SET keeps their attempts), at most $4 and before the heads. They stay `sending`: no chat lock.
 */
const UNCALLED_RELEASED: SqlPart = {
  name: "relost",
  reads: ["lost0"],
  rows: "seq",
  text: "SELECT l.seq FROM lost0 l WHERE l.uncalled ORDER BY l.seq LIMIT $4",
};

/** `amb`: the entries of `lost` written: `unknown` (lease dropped, no due mark), or with resend leased again. */
function abandonedSettled({ t, resend }: OutboxScan): SqlPart {
  const set = resend ? OUT_CLAIM_SET : `state = 'unknown', lease_owner = NULL, lease_incarnation = NULL, lease_token = NULL,
        lease_expires_at = NULL, next_attempt_at = NULL,
        error = coalesce(error, 'the sender was lost during the provider call'), updated_at = n.now, due_at = NULL`;
  return {
    name: "amb",
    reads: ["lost", "n"],
    rows: "the entries' columns, xv, uncalled",
    text: `UPDATE ${t.outbox} AS a SET ${set}
      FROM lost, n WHERE a.seq = lost.seq
      RETURNING ${outboxColumnsOf("a")}, a.xmin::text AS xv, lost.uncalled`,
  };
}

/** `rsl`: up to 100 chat rows flagged `resync`, locked (SKIP LOCKED), but for the chats of `lost0`'s entries made unknown. */
function resyncChatsLocked({ t, resend }: OutboxScan): SqlPart {
  const skipped = resend ? "lost0" : "called";
  return {
    name: "rsl",
    reads: [skipped],
    rows: "chat_id, ver (the locked, latest version)",
    note: "Chats flagged for resync (not those of entries made unknown: their rows are updated above).",
    text: `SELECT c.chat_id, c.ver FROM ${t.chat} c
      WHERE c.resync AND c.chat_id NOT IN (SELECT chat_id FROM ${skipped})
      ORDER BY c.chat_id LIMIT 100
      FOR UPDATE OF c SKIP LOCKED`,
  };
}

/** `rs`: the chats of `rsl` whose snapshot is current (their head can be found in it). */
function resyncChatsCurrent({ t }: OutboxScan): SqlPart {
  return {
    name: "rs",
    reads: ["rsl"],
    rows: "chat_id",
    note: "Only those whose locked (latest) version is the one this snapshot sees.",
    text: `SELECT rsl.chat_id FROM rsl WHERE rsl.ver = (SELECT s.ver FROM ${t.chat} s WHERE s.chat_id = rsl.chat_id)`,
  };
}

/** `rsc`: the flag of the chats of `rs` cleared. */
function resyncCleared({ t }: OutboxScan): SqlPart {
  return {
    name: "rsc",
    reads: ["rs"],
    rows: "chat_id",
    text: `UPDATE ${t.chat} AS c SET resync = false FROM rs WHERE c.chat_id = rs.chat_id RETURNING c.chat_id`,
  };
}

/** `rsh`: the head of each chat of `rsc` (its first blocking entry, by the active index), when it waits. */
function resyncHeads({ t }: OutboxScan): SqlPart {
  return {
    name: "rsh",
    reads: ["rsc"],
    rows: "seq",
    text: `SELECT h.seq FROM rsc CROSS JOIN LATERAL (
        SELECT b.seq, b.state FROM ${t.outbox} b
        WHERE b.chat_id = rsc.chat_id AND b.state IN (${BLOCKING}) AND b.${KEPT} ORDER BY b.seq LIMIT 1
      ) h
      WHERE h.state IN (${OUT_WAITING})`,
  };
}

/**
 * `rsm`: the heads of `rsh` (and `lnh`) without a due mark get one (SKIP LOCKED: a head locked by another
 * claimDue is being leased by it). This statement's `heads` reads the snapshot: the next scan leases them.
 */
function headsMarked({ t, resend }: OutboxScan): SqlPart {
  return {
    name: "rsm",
    reads: resend ? ["rsh", "n"] : ["rsh", "lnh", "n"],
    rows: "1 per head marked",
    text: `UPDATE ${t.outbox} AS m SET due_at = coalesce(m.next_attempt_at, n.now) FROM n
      WHERE m.seq = ANY(ARRAY(
        SELECT x.seq FROM ${t.outbox} x WHERE x.seq IN (SELECT seq FROM rsh${resend ? "" : " UNION ALL SELECT seq FROM lnh"})
          AND x.due_at IS NULL
        FOR UPDATE OF x SKIP LOCKED))
      RETURNING 1`,
  };
}

/**
 * `heads`: the due chat heads, by the due index (a due mark on an entry that is not its chat's head, a
 * stray, is passed over), locked (SKIP LOCKED), oldest first, as many as $4 leaves after the abandoned
 * entries leased again (`amb` with resend, `relost` without).
 */
function dueHeads({ t, resend }: OutboxScan): SqlPart {
  const taken = resend ? "amb" : "relost";
  return {
    name: "heads",
    reads: ["n", taken],
    rows: "seq",
    text: `SELECT o.seq FROM ${t.outbox} o
      WHERE o.due_at IS NOT NULL AND o.due_at <= ${NOW} AND o.state IN (${OUT_WAITING}) AND o.${KEPT}
        AND NOT EXISTS (
          SELECT 1 FROM ${t.outbox} b
          WHERE b.chat_id = o.chat_id AND b.state IN (${BLOCKING}) AND b.${KEPT} AND b.seq < o.seq)
      ORDER BY o.seq
      LIMIT greatest(0, $4 - (SELECT count(*) FROM ${taken}))
      FOR UPDATE OF o SKIP LOCKED`,
  };
}

/** `due`: the heads (and without resend `relost`) leased to the caller (claimedOutbox of rules.ts). */
function dueLeased({ t, resend }: OutboxScan): SqlPart {
  return {
    name: "due",
    reads: resend ? ["heads", "n"] : ["heads", "relost", "n"],
    rows: "the entries' columns, xv",
    note: "The rows of lost0 and heads are locked (their state rechecked when locked): no state check needed here.",
    text: `UPDATE ${t.outbox} AS d SET ${OUT_CLAIM_SET}
      FROM (SELECT seq FROM heads${resend ? "" : " UNION ALL SELECT seq FROM relost"}) p, n WHERE d.seq = p.seq
      RETURNING ${outboxColumnsOf("d")}, d.xmin::text AS xv`,
  };
}

/**
 * The parts of outbox claimDue, in statement order. It resolves the abandoned sends first: an uncalled one
 * is leased again, a called one is ambiguous (`unknown`, which no longer blocks its chat, so only with its chat
 * row locked; or with resend leased again as well, counted against $4 like the uncalled ones). Then it finds
 * and marks the heads of the chats flagged `resync` (see "Due marks" at {@link outboxSql}), and leases the due
 * heads, $4 in all with the abandoned entries leased again.
 */
export function outboxClaimDueParts(t: Tables, reclaim: boolean, resend: boolean): SqlPart[] {
  const s: OutboxScan = { t, reclaim, resend };
  const lost = resend
    ? [ALL_ABANDONED]
    : [CALLED_ABANDONED, calledChatsLocked(s), calledChatsStamped(s), calledChatsNextHeads(s), calledToUnknown(s), UNCALLED_RELEASED];
  return [
    NOW_PART,
    abandonedSends(s),
    ...lost,
    abandonedSettled(s),
    resyncChatsLocked(s),
    resyncChatsCurrent(s),
    resyncCleared(s),
    resyncHeads(s),
    headsMarked(s),
    dueHeads(s),
    dueLeased(s),
  ];
}

/** Outbox claimDue: its parts, then each entry it returns with its `part`: `ambiguous` (from `amb`, called) or `due`. */
export function outboxClaimDueSql(t: Tables, reclaim: boolean, resend: boolean): string {
  return withParts(
    outboxClaimDueParts(t, reclaim, resend),
    `SELECT CASE WHEN amb.uncalled THEN 'due' ELSE 'ambiguous' END AS part, ${OUTBOX_COLUMNS}, xv FROM amb
    UNION ALL SELECT 'due' AS part, ${OUTBOX_COLUMNS}, xv FROM due`,
  );
}

// ---- the session store and the kv ---------------------------------------------------

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
