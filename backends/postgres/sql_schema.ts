/**
 * The Postgres backend's schema: its version and the ordered migrations,
 * run as one `DO` block under an advisory lock.
 *
 * @module
 */
import { INBOX, OUTBOX, sqlIn, statesWhere } from "../../src/machine.ts";
import { LEGACY_TIMER_ERROR, TIMER_STATE } from "../../src/rules.ts";
import { ACTIVE, BLOCKING, ident, literal, NEWER_SCHEMA_MARK, OUT_WAITING, type Tables } from "./sql_common.ts";

/** How full (%) an inbox page is written, so that a run's start finds room for a HOT update (version 10). */
export const INBOX_FILLFACTOR: number = 80;

/** The schema version this version of the library writes. */
export const POSTGRES_SCHEMA_VERSION: number = 10;

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
    // Version 8: the inbox by lease holder, so that a due scan never reads the leases the caller itself holds:
    // the holders (owner, incarnation) of leases, each an index range (a reclaim reads each other incarnation's
    // oldest records), and per chat its active records by holder (the unleased ones first), for the chat-order
    // checks. A restart's backlog is then reclaimed in work linear in its size. IF NOT EXISTS: an operator may
    // build them beforehand, CONCURRENTLY, under these names.
    `
    CREATE INDEX IF NOT EXISTS ${i("inbox_lease")} ON ${t.inbox} (lease_owner, lease_incarnation, received_at, ord)
      WHERE ${sqlIn("state", statesWhere(INBOX, "leased"))};
    CREATE INDEX IF NOT EXISTS ${i("inbox_holder_chat")} ON ${t.inbox} (chat_id, lease_owner, lease_incarnation, received_at, ord)
      WHERE state IN (${ACTIVE});
    `,
    // Version 9: the indexes of leases by owner alone go. No statement reads them (the inbox's leases are read
    // by holder, version 8; the outbox's lost sends by state), and each lease written (an admission, a
    // reservation, a claim, a heartbeat) wrote an entry in them.
    `
    DROP INDEX IF EXISTS ${ident(t.schema)}.${i("inbox_owner")};
    DROP INDEX IF EXISTS ${ident(t.schema)}.${i("outbox_owner")};
    `,
    // Version 10: the inbox's pages keep a fifth free. A run's start writes attempts alone, no indexed
    // column, so it is a HOT update (no new index entry) when the record's page has room; pages packed
    // full (fillfactor 100) put each start on another page, with an entry in every inbox index: in a
    // restart's recovery, one of a record's three updates. Applies to the pages written from now on.
    `
    ALTER TABLE ${t.inbox} SET (fillfactor = ${INBOX_FILLFACTOR});
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
