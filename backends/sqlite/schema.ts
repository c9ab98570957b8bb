/**
 * The SQL schema: its version and the ordered migrations that create or
 * upgrade a file in place.
 *
 * @module
 */
import { INBOX, OUTBOX, sqlIn, sqlNotIn, sqlStates, statesDueBy, statesWhere } from "../../src/machine.ts";
import { ACTIVE_INBOX_STATES, BLOCKING_OUTBOX_STATES, LEGACY_TIMER_ERROR, TIMER_STATE } from "../../src/rules.ts";
import type { SqliteDatabase } from "../../src/runtime/sqlite.ts";
import { showValue as show } from "../../src/show.ts";

/** The schema version this version of the library writes. */
export const SQLITE_SCHEMA_VERSION: number = 10;

/** One step of the schema: run in the open transaction, on a file at `version - 1`. */
interface Migration {
  version: number;
  up(db: SqliteDatabase, p: string): void;
}

/** The outbox states that block a chat, as an SQL list. */
export const BLOCKING_SQL: string = BLOCKING_OUTBOX_STATES.map((s) => `'${s}'`).join(", ");
/** The active inbox states, as an SQL list. */
export const ACTIVE_SQL: string = ACTIVE_INBOX_STATES.map((s) => `'${s}'`).join(", ");
/** `state = 'processing'`: the leased inbox state. */
export const IN_LEASED_SQL: string = sqlIn("state", statesWhere(INBOX, "leased"));
/** `state = 'sending'`: the leased outbox state. */
export const OUT_LEASED_SQL: string = sqlIn("state", statesWhere(OUTBOX, "leased"));
/** `state <> 'sending'`: an outbox entry that is not leased. */
export const OUT_UNLEASED_SQL: string = sqlNotIn("state", statesWhere(OUTBOX, "leased"));
/** `state = 'done'`: what an inbox purge deletes. */
export const IN_PURGEABLE_SQL: string = sqlIn("state", statesWhere(INBOX, "purgeable"));
/** `state = 'sent'`: what an outbox purge deletes. */
export const OUT_PURGEABLE_SQL: string = sqlIn("state", statesWhere(OUTBOX, "purgeable"));
/** `state <> 'sending'`: what an outbox discard may delete. */
export const OUT_DISCARDABLE_SQL: string = sqlNotIn("state", statesWhere(OUTBOX, (t) => !t.discardable));

/** `CASE state WHEN … END`: a record's due time by its state (NULL: never due). */
function dueCase(table: typeof INBOX | typeof OUTBOX): string {
  const value = { always: "0", nextAttemptAt: "COALESCE(next_attempt_at, 0)", leaseExpiry: "COALESCE(lease_expires_at, 0)" };
  const whens = (Object.keys(table) as (keyof typeof table)[]).flatMap((s) => {
    const due = (table as Record<string, { due: keyof typeof value | "never" }>)[s]!.due;
    return due === "never" ? [] : [`WHEN '${s}' THEN ${value[due]}`];
  });
  return `CASE state ${whens.join(" ")} END`;
}

/**
 * The ordered migrations. Never edit a shipped one: append a new one (its
 * `version` one more than the last) and raise {@link SQLITE_SCHEMA_VERSION}.
 */
const MIGRATIONS: readonly Migration[] = [
  {
    version: 1,
    up(db, p) {
      db.exec(`
        CREATE TABLE ${p}inbox (
          ord INTEGER PRIMARY KEY,
          id TEXT NOT NULL UNIQUE,
          kind TEXT NOT NULL,
          chat_id TEXT NOT NULL,
          provider TEXT NOT NULL,
          payload TEXT NOT NULL,
          received_at INTEGER NOT NULL,
          state TEXT NOT NULL,
          attempts INTEGER NOT NULL,
          next_attempt_at INTEGER,
          lease_owner TEXT,
          lease_incarnation TEXT,
          lease_token INTEGER,
          lease_expires_at INTEGER,
          fence INTEGER NOT NULL,
          error TEXT,
          updated_at INTEGER NOT NULL
        );
        CREATE TABLE ${p}outbox (
          seq INTEGER PRIMARY KEY AUTOINCREMENT,
          key TEXT NOT NULL UNIQUE,
          chat_id TEXT NOT NULL,
          content TEXT NOT NULL,
          content_hash TEXT NOT NULL,
          inbound_id TEXT,
          state TEXT NOT NULL,
          attempts INTEGER NOT NULL,
          next_attempt_at INTEGER,
          lease_owner TEXT,
          lease_incarnation TEXT,
          lease_token INTEGER,
          lease_expires_at INTEGER,
          fence INTEGER NOT NULL,
          message_id TEXT,
          error TEXT,
          created_at INTEGER NOT NULL,
          updated_at INTEGER NOT NULL
        );
        CREATE TABLE ${p}session (
          key TEXT PRIMARY KEY,
          value TEXT NOT NULL,
          expires_at INTEGER
        );
      `);
    },
  },
  {
    // Due scans, reclaims, purges and lists stay O(what they return) at millions of rows.
    version: 2,
    up(db, p) {
      db.exec(`
        ALTER TABLE ${p}inbox ADD COLUMN due_at INTEGER;
        ALTER TABLE ${p}outbox ADD COLUMN due_at INTEGER;
        CREATE INDEX ${p}inbox_due ON ${p}inbox (due_at) WHERE due_at IS NOT NULL;
        CREATE INDEX ${p}inbox_owner ON ${p}inbox (lease_owner) WHERE lease_owner IS NOT NULL;
        CREATE INDEX ${p}inbox_state ON ${p}inbox (state, received_at, ord);
        CREATE INDEX ${p}inbox_done ON ${p}inbox (updated_at) WHERE ${IN_PURGEABLE_SQL};
        CREATE INDEX ${p}outbox_due ON ${p}outbox (due_at) WHERE due_at IS NOT NULL;
        CREATE INDEX ${p}outbox_owner ON ${p}outbox (lease_owner) WHERE lease_owner IS NOT NULL;
        CREATE INDEX ${p}outbox_chat ON ${p}outbox (chat_id, seq) WHERE state IN (${BLOCKING_SQL});
        CREATE INDEX ${p}outbox_state ON ${p}outbox (state, seq);
        CREATE INDEX ${p}outbox_sent ON ${p}outbox (updated_at) WHERE ${OUT_PURGEABLE_SQL};
        CREATE INDEX ${p}session_expiry ON ${p}session (expires_at) WHERE expires_at IS NOT NULL;
        UPDATE ${p}inbox SET due_at = ${dueCase(INBOX)};
        UPDATE ${p}outbox SET due_at = COALESCE(lease_expires_at, 0) WHERE ${OUT_LEASED_SQL};
        UPDATE ${p}outbox AS o SET due_at = COALESCE(next_attempt_at, 0)
          WHERE state IN (${sqlStates(statesDueBy(OUTBOX, "nextAttemptAt"))}) AND NOT EXISTS (
            SELECT 1 FROM ${p}outbox AS b
            WHERE b.chat_id = o.chat_id AND b.state IN (${BLOCKING_SQL}) AND b.seq < o.seq);
      `);
    },
  },
  {
    // Lists read O(limit) rows in their order: all records, one chat's (any
    // state), one state's (several states: one query per state, merged). The
    // inbox due index also orders by receipt, so that claimDue reads a
    // pending backlog (due_at = 0) in order instead of sorting all of it.
    version: 3,
    up(db, p) {
      db.exec(`
        CREATE INDEX ${p}inbox_received ON ${p}inbox (received_at, ord);
        CREATE INDEX ${p}inbox_chat ON ${p}inbox (chat_id, received_at, ord);
        CREATE INDEX ${p}outbox_chat_all ON ${p}outbox (chat_id, seq);
        DROP INDEX ${p}inbox_due;
        CREATE INDEX ${p}inbox_due ON ${p}inbox (due_at, received_at, ord) WHERE due_at IS NOT NULL;
      `);
    },
  },
  {
    // The call marker of an outbox entry (outbox.markCalling): uncalled exactly when `uncalled_fence`
    // equals `fence` (see outboxOf). Existing rows get NULL (no row is rewritten) and read as called:
    // they may have been sent, so a lost one stays ambiguous, as it was. A claim by an older library
    // raises the fence without touching the column: its entry reads as called too.
    version: 4,
    up(db, p) {
      db.exec(`ALTER TABLE ${p}outbox ADD COLUMN uncalled_fence INTEGER;`);
    },
  },
  {
    // An inbox due scan keeps each chat's order: it looks up the chat's `processing` records (a lease
    // held elsewhere holds back the later ones) without reading the chat's settled history.
    version: 5,
    up(db, p) {
      db.exec(`CREATE INDEX ${p}inbox_chat_leased ON ${p}inbox (chat_id, received_at, ord) WHERE ${IN_LEASED_SQL};`);
    },
  },
  {
    // Damaged records are set aside, not deleted (see DamagedRows): `damage` (the problem), `set_aside_at`,
    // `set_aside_seq` (the order they were set aside in) and `damage_reported` (0, then 1), all NULL on a
    // readable row, so that existing rows need no rewrite. Partial indexes: only set-aside rows are in them.
    version: 6,
    up(db, p) {
      for (const table of [`${p}inbox`, `${p}outbox`]) {
        db.exec(`
          ALTER TABLE ${table} ADD COLUMN damage TEXT;
          ALTER TABLE ${table} ADD COLUMN set_aside_at INTEGER;
          ALTER TABLE ${table} ADD COLUMN set_aside_seq INTEGER;
          ALTER TABLE ${table} ADD COLUMN damage_reported INTEGER;
          CREATE INDEX ${table}_aside ON ${table} (set_aside_seq) WHERE set_aside_seq IS NOT NULL;
          CREATE INDEX ${table}_unreported ON ${table} (set_aside_seq) WHERE damage_reported = 0;
        `);
      }
    },
  },
  {
    // A leased admit looks at the active records of its chat (see SqliteInbox.admit) without reading
    // the chat's settled history: a partial index of the active ones only (the due scan's
    // inbox_chat_leased stays, so that it reads a chat's processing records without its pending backlog).
    version: 7,
    up(db, p) {
      db.exec(`CREATE INDEX ${p}inbox_chat_active ON ${p}inbox (chat_id, received_at, ord) WHERE state IN (${ACTIVE_SQL});`);
    },
  },
  {
    // Fewer indexes to maintain per message: the lease-owner indexes served only the reclaim of a previous
    // incarnation's leases (at a restart). Every leased record is in its journal's due index (an inbox
    // `processing` record and an outbox `sending` entry are due at their lease expiry), so the reclaim reads
    // that index instead: O(records due or leased), not O(records held by the owner).
    version: 8,
    up(db, p) {
      db.exec(`DROP INDEX IF EXISTS ${p}inbox_owner; DROP INDEX IF EXISTS ${p}outbox_owner;`);
    },
  },
  {
    // Timers are a state of their own, `scheduled` (see src/machine.ts): an active state, so the index of
    // each chat's active records is built again to hold it. A timer an older version armed as a `failed`
    // record ("Not a failure: a timer, due at …") becomes `scheduled`, due when it was.
    version: 9,
    up(db, p) {
      db.exec(`
        UPDATE ${p}inbox SET state = '${TIMER_STATE}', error = NULL
          WHERE state = 'failed' AND error LIKE '${LEGACY_TIMER_ERROR}%' AND set_aside_seq IS NULL;
        DROP INDEX IF EXISTS ${p}inbox_chat_active;
        CREATE INDEX ${p}inbox_chat_active ON ${p}inbox (chat_id, received_at, ord) WHERE state IN (${ACTIVE_SQL});
      `);
    },
  },
  {
    // An inbox due scan reads the leased records by holder, so that it never reads what the caller itself
    // holds: per chat, the records of each other holder (owner and incarnation) from the first (a lease
    // held elsewhere holds back the chat's later records), and under reclaimOwn the oldest records of each
    // of the owner's other incarnations, a page at a time. A restart's backlog is then reclaimed in work
    // linear in its size (reading every leased record of a chat, or every record of the owner, per scan
    // made it quadratic). inbox_chat_lease takes the place of inbox_chat_leased.
    version: 10,
    up(db, p) {
      db.exec(`
        DROP INDEX IF EXISTS ${p}inbox_chat_leased;
        CREATE INDEX IF NOT EXISTS ${p}inbox_chat_lease ON ${p}inbox (chat_id, lease_owner, lease_incarnation, received_at, ord) WHERE ${IN_LEASED_SQL};
        CREATE INDEX IF NOT EXISTS ${p}inbox_lease ON ${p}inbox (lease_owner, lease_incarnation, received_at, ord) WHERE ${IN_LEASED_SQL};
      `);
    },
  },
];

/** Brings the schema to {@link SQLITE_SCHEMA_VERSION} in one transaction; refuses a newer file. */
export function migrate(db: SqliteDatabase, p: string, file: string): void {
  db.exec("BEGIN IMMEDIATE");
  try {
    db.exec(`CREATE TABLE IF NOT EXISTS ${p}meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)`);
    const row = db.prepare(`SELECT value FROM ${p}meta WHERE key = 'schema_version'`).get();
    const current = row === undefined ? 0 : Number(row.value);
    if (!Number.isInteger(current) || current < 0) {
      throw new Error(`SQLite file ${JSON.stringify(file)} has an invalid schema version ${show(row?.value)}`);
    }
    if (current > SQLITE_SCHEMA_VERSION) {
      throw new Error(
        `SQLite file ${
          JSON.stringify(file)
        } has schema version ${current}, written by a newer @botmesh/durable; this version supports up to schema version ${SQLITE_SCHEMA_VERSION}: upgrade @botmesh/durable to open it`,
      );
    }
    for (const migration of MIGRATIONS) {
      if (migration.version > current) migration.up(db, p);
    }
    if (current < SQLITE_SCHEMA_VERSION) {
      db.prepare(`INSERT INTO ${p}meta (key, value) VALUES ('schema_version', ?)
        ON CONFLICT (key) DO UPDATE SET value = excluded.value`).run(String(SQLITE_SCHEMA_VERSION));
    }
    db.exec("COMMIT");
  } catch (error) {
    try {
      db.exec("ROLLBACK");
    } catch {
      // Nothing to roll back.
    }
    throw error;
  }
}
