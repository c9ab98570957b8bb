/**
 * What the Postgres backend's statements share: the server clock, the
 * parts a statement is assembled from ({@link SqlPart}), identifiers and
 * literals, the state sets of the state table rendered as SQL, the column
 * lists, the table names, and the claim rules.
 *
 * @module
 */
import { INBOX, OUTBOX, sqlByDue, sqlIn, sqlStates, statesDueBy, statesWhere } from "../../src/machine.ts";
import { ACTIVE_INBOX_STATES, BLOCKING_OUTBOX_STATES, WRITER_TOKEN } from "../../src/rules.ts";
import type { InboundState, OutboxState } from "../../src/contract.ts";

/** The server clock in ms since epoch (the replicas' clocks are never used). */
export const NOW_MS: string = "(extract(epoch from clock_timestamp()) * 1000)::bigint";

/** The statement's clock, read once (`n` is a CTE of every statement that needs it); an InitPlan, so index scans can use it. */
export const NOW = "(SELECT now FROM n)";

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
export const NOW_PART: SqlPart = { name: "n", reads: [], rows: "now", text: `SELECT ${NOW_MS} AS now` };

/** `name AS (…)`: a body of one short line inline, a longer one on lines of its own. */
export function cte(p: SqlPart): string {
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
export function literal(text: string): string {
  return `'${text.replaceAll("'", "''")}'`;
}

export const BLOCKING: string = BLOCKING_OUTBOX_STATES.map((s) => literal(s)).join(", ");
export const ACTIVE: string = ACTIVE_INBOX_STATES.map((s) => literal(s)).join(", ");
/** The leased inbox state(s) (`processing`). */
export const IN_LEASED: readonly InboundState[] = statesWhere(INBOX, "leased");
/** The leased outbox state(s) (`sending`). */
export const OUT_LEASED: readonly OutboxState[] = statesWhere(OUTBOX, "leased");
/** Outbox states due at their `next_attempt_at` once first in their chat (`queued`, `failed`). */
export const OUT_WAITING: string = sqlStates(statesDueBy(OUTBOX, "nextAttemptAt"));
/** `acceptsOutcome` of rules.ts for the token `token` (columns prefixed by `r`). */
export const outcomeOf = (r: string, token: string): string =>
  `((${sqlIn(`${r}state`, OUT_LEASED)} AND ${r}lease_token = ${token}) OR (${
    sqlIn(`${r}state`, statesWhere(OUTBOX, "acceptsLateOutcome"))
  } AND ${r}fence = ${token}))`;

/**
 * A row not set aside as damaged (schema version 5: `set_aside_seq` is set on a row set aside, NULL on every
 * other). Every statement but a read by key or a report leaves set-aside rows out: they are never due, never
 * hold back a chat, never change (the due scans' chat order checks included).
 */
export const KEPT = "set_aside_seq IS NULL";

/**
 * A LATERAL FROM item: the row of `table` whose unique `column` equals `value` (a column of the rows
 * before it), read by its own index probe. A multi-row statement looks its keys up this way, not with
 * `column = ANY(…)`: the plan a prepared statement keeps was made when the table may have been empty,
 * and for a lookup of all keys at once that plan reads the whole table however much it has grown,
 * while a probe per key is the cheaper plan at any size.
 */
export function probe(table: string, columns: string, column: string, value: string, lock = ""): string {
  return `LATERAL (SELECT ${columns} FROM ${table} WHERE ${column} = ${value} ${lock || "LIMIT 1"})`;
}
/**
 * What a read returns besides a row's columns: its set-aside mark and problem, and its version (`xmin`), which
 * fences the statement that sets it aside (it applies only to the version read: see `setAside`).
 */
export const ASIDE_READ = "set_aside_seq, damage, xmin::text AS xv";
export const asideRead = (alias: string): string => `${alias}.set_aside_seq, ${alias}.damage, ${alias}.xmin::text AS xv`;

export const INBOX_COLUMNS: string =
  "ord, id, kind, chat_id, provider, payload, received_at, state, attempts, next_attempt_at, lease_owner, lease_incarnation, lease_token, lease_expires_at, fence, error, updated_at";
/** Every inbox column but the payload (what `admit` returns: the payload is the caller's checked copy). */
export const INBOX_META_COLUMNS: string = INBOX_COLUMNS.replace(" payload,", "");
/**
 * The outbox columns. `uncalled_fence` holds the entry's `called` flag (schema version 3): the entry is
 * uncalled (`called: false`) exactly when `uncalled_fence = fence`. Every claim sets it to the fence it
 * issues, a leased or queued reserve to the entry's fence; `markCalling` sets it NULL. So a row written
 * before the column existed (NULL), or claimed by a replica still running a library that predates it
 * (it raises the fence, not this), reads as called: a lost send of theirs stays ambiguous.
 */
export const OUTBOX_COLUMNS: string =
  "seq, key, chat_id, content, content_hash, inbound_id, state, attempts, next_attempt_at, lease_owner, lease_incarnation, lease_token, lease_expires_at, fence, uncalled_fence, message_id, error, created_at, updated_at";
export const OUTBOX_META_COLUMNS: string = OUTBOX_COLUMNS.replace(" content,", "");

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
export const nextChatVersion = (t: Tables): string => `nextval('${t.chatVersion.replaceAll("'", "''")}')`;

/**
 * A chat row's `touched_at` is stamped again only once it is this old. A stamp that leaves it as it was
 * changes no indexed column, so the chat lock's update (two per message) is a HOT update: no index entry,
 * less WAL. Its one reader, the purge of chat rows untouched for an hour or more, is a minute early at most.
 */
export const CHAT_TOUCH_EVERY_MS = 60_000;

/** `touched_at` of the chat row `row` (an alias) stamped at `now` (an expression), per {@link CHAT_TOUCH_EVERY_MS}. */
export const chatTouchedAt = (row: string, now: string): string =>
  `CASE WHEN ${row}.touched_at <= ${now} - ${CHAT_TOUCH_EVERY_MS} THEN ${now} ELSE ${row}.touched_at END`;


// ---- the journals --------------------------------------------------------------
// Parameters are numbered per statement; every bigint parameter is an integer
// (durations are rounded up and clamped by the caller).

/** Whether an inbox record (columns prefixed by `r`, an alias and its dot) is claimable under ($1 owner, $2 incarnation, reclaimOwn) at `now`. */
export function inboxClaimable(reclaimOwn: boolean, r = "", now = "n.now"): string {
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

/** The token a claim issues (claimToken of rules.ts: above the fence and above the writer's token). */
const CLAIM_TOKEN = `GREATEST(fence, ${WRITER_TOKEN}) + 1`;

/** The SET list of a claim: leased to ($1, $2) for $3 ms with a new token (CLAIM_TOKEN), attempts unchanged (a claim is not a run). */
export const CLAIM_SET: string = `state = 'processing', next_attempt_at = NULL,
  lease_owner = $1, lease_incarnation = $2, lease_token = ${CLAIM_TOKEN}, lease_expires_at = n.now + $3::bigint,
  fence = ${CLAIM_TOKEN}, updated_at = n.now, due_at = n.now + $3::bigint`;

/**
 * The SET list of an outbox claim (claimedOutbox of rules.ts): leased to ($1, $2) for $3 ms with
 * a new token (CLAIM_TOKEN), uncalled under it, except a lost `sending` entry whose call was announced (re-leased by
 * resendAmbiguous): it stays called. A lost `sending` entry whose call was never announced (uncalled under
 * its fence) started no attempt: the new lease keeps its number.
 */
export const OUT_CLAIM_SET: string = `state = 'sending',
  attempts = CASE WHEN state = 'sending' AND uncalled_fence = fence THEN attempts ELSE attempts + 1 END,
  next_attempt_at = NULL, lease_owner = $1, lease_incarnation = $2, lease_token = ${CLAIM_TOKEN},
  lease_expires_at = n.now + $3::bigint, fence = ${CLAIM_TOKEN},
  uncalled_fence = CASE WHEN state = 'sending' AND uncalled_fence IS DISTINCT FROM fence THEN NULL ELSE ${CLAIM_TOKEN} END,
  updated_at = n.now,
  due_at = n.now + $3::bigint`;
