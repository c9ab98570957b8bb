/**
 * `@botmesh/durable/postgres`: the inbox/outbox journals, the session store
 * and a {@link DurableKv} in PostgreSQL, shared by many replicas on many
 * hosts (`scope: "shared"`).
 *
 * - {@link PostgresDurability}: the journals.
 * - {@link PostgresStore}: the bot's {@link SessionStore} (get/set/delete
 *   with TTL); `store.durability()` journals in the same schema, over the
 *   same client.
 * - {@link PostgresKv}: a versioned key-value store for `new KvDurability(kv)` or
 *   `new EventsDurability({ journal, outbox: kv })`.
 *
 * ## The client
 * Pass a [postgres](https://github.com/porsager/postgres) (porsager) client
 * as `sql`: `postgres(url, { max: 10 })`. This module never opens, ends or
 * imports it (it relies only on `sql.unsafe(text, params, { prepare: true })`,
 * see {@link PostgresClient}); the client reconnects on its own after a lost
 * connection, and `close()` here leaves it open: `await sql.end()` when done.
 * Use it without column or value transforms (`transform`, custom `types`);
 * the backend checks for a column transform when it sets up its schema.
 * Recommended client options: `fetch_types: false` (the backend uses no
 * array types; with the default, porsager 3.4 leaves a rejection unhandled
 * when a connection is lost while it fetches types on connecting, which ends
 * a Node process), and an `application_name` per replica
 * (`connection: { application_name }`) to find its sessions on the server.
 *
 * ## Schema
 * Tables `<prefix>meta`, `<prefix>inbox`, `<prefix>outbox`,
 * `<prefix>outbox_chat`, `<prefix>session`, `<prefix>kv`,
 * `<prefix>scan_answer` and two sequences in
 * `schema` (default `public`; `tablePrefix` default `botmesh_`). They are
 * created or upgraded on first use (`open()`, or the first call) by one `DO`
 * block: one statement, one transaction, under a transaction-scoped advisory
 * lock on the schema, so replicas starting together migrate one at a time.
 * A schema written by a newer version of the library is refused. Upgrades
 * are in place: schema version 3 adds the outbox column `uncalled_fence`
 * (an entry's `called` flag: `called` is `false` exactly when it equals the
 * fence) with no table rewrite; existing rows hold NULL and read as called,
 * as every entry was treated before the flag existed, so their lost sends
 * stay ambiguous. A replica still running an older library during a rolling
 * upgrade raises the fence of what it claims without setting the column, so
 * its sends read as called too (it never announces a call). Schema version
 * 4 adds the inbox index `<prefix>inbox_chat_active` (each chat's active
 * records in arrival order, for the due scan's chat order). Building it
 * blocks writes to the inbox for one read of the table; on a large inbox,
 * build it beforehand with `CREATE INDEX CONCURRENTLY` under that name and
 * definition (see `sql.ts`): the upgrade keeps an existing one. A
 * replica still running an older library scans without the chat order
 * check until it is upgraded. Schema version 5 adds the set-aside columns of
 * both journals (see "Damaged records"; NULL on every existing row, no table
 * rewrite), a sequence `<prefix>aside_seq`, and two partial indexes per
 * journal, `<prefix>inbox_aside`, `<prefix>inbox_unreported`,
 * `<prefix>outbox_aside` and `<prefix>outbox_unreported`: each holds
 * set-aside rows only, but building it reads its table once, blocking writes
 * meanwhile, so on a large journal build them beforehand `CONCURRENTLY`
 * (the upgrade keeps existing ones). A row that an older version made `dead`
 * for its damage is set aside by the first read that meets it, and leaves
 * the dead letters. A replica still running an older library ignores the
 * set-aside columns: until it is upgraded it may still claim a set-aside row
 * by id, and makes a damaged row it claims `dead` as before. Schema version
 * 6 gives timers a state of their own, `scheduled`: the timers an older
 * version armed as `failed` records become `scheduled`, due when they were,
 * and each chat's active records are indexed again, as
 * `<prefix>inbox_chat_live` (it holds the new state; build it beforehand
 * `CONCURRENTLY` on a large inbox), replacing `<prefix>inbox_chat_active`.
 * A replica still running an older library does not know the state: stop
 * the older replicas before a bot of this version starts. Schema version 7
 * adds the table `<prefix>scan_answer` (and its index
 * `<prefix>scan_answer_at`), where named due scans keep their answers (see
 * "Due scans asked again"); nothing else changes, and a replica still running
 * an older library neither reads nor writes it. Schema version 8 adds two
 * partial indexes of the inbox by lease holder, `<prefix>inbox_lease`
 * (owner, incarnation, receipt, of the `processing` records) and
 * `<prefix>inbox_holder_chat` (chat, owner, incarnation, receipt, of the
 * active records): a due scan reads a chat's records holder by holder and a
 * restart's reclaim its previous incarnations' records in receipt order, so
 * neither ever reads the leases the caller holds (build them beforehand
 * `CONCURRENTLY` on a large inbox). A replica still running an older library
 * keeps them up to date and goes on as before. Schema version 9 drops the
 * indexes `<prefix>inbox_owner` and `<prefix>outbox_owner` (leases by owner
 * alone), which no statement reads since version 8 and which every lease
 * written (an admission, a reservation, a claim, a heartbeat) wrote an entry
 * in; a replica still running an older library goes on as before.
 *
 * ## Statements
 * Every operation is one statement (prepared by the client), with the state
 * rules, the fencing token and the clock in SQL. Journal writes (admit,
 * heartbeats, completions, failures, reserve, markCalling, markSent, markFailed)
 * are group-committed: those called in one turn of the event loop share one
 * transaction, their statements pipelined on one connection (`sql.begin`),
 * so a busy bot pays one commit (one WAL flush) per group instead of one per
 * write; a lone write is one statement as before. Groups go in lanes
 * (`groupLanes`, 2 by default), one group in flight per lane, so one group's
 * commit overlaps the next one's statements: each chat's writes go to one
 * lane (a hash of the chat id, known from the write or, for a write by id,
 * from the admit, claim or reserve that gave this process the record; lane 0
 * when unknown), and every row a write locks is its chat's, so two lanes
 * never lock the same rows and never deadlock on each other, but for a write
 * whose chat this process does not know (a record it never held, or one past
 * the 100,000 chats it remembers): that one may meet another lane's group as
 * another replica's would (below). Within a group,
 * the writes of one kind go in one multi-row statement (admits, reserves,
 * heartbeats, markCallings, markSents, inbox completions; reserves of one
 * chat never share one), chat rows locked in chat order; a write joins its
 * kind's statement only when no earlier write of the group touched its
 * record. A group of several statements that write to the outbox first locks
 * the outbox rows of their chats, in chat order (one `SELECT … FOR UPDATE`),
 * so that every group locks a chat's row before the chat's entries and chat
 * rows in chat order: two replicas' groups then never deadlock on them. Each
 * write still settles on its own (a stale token fails only its
 * own call): a group the server rolled back (a deadlock with another
 * replica's group or another lane's, on rows of a chat the group did not know: the server picks
 * one after `deadlock_timeout`, 1 s by default) runs each of its writes again
 * alone, in call order; a group whose
 * commit's fate is unknown (a lost connection) rejects each write with that
 * error, as a lone statement would. Row locks are held until a group
 * commits, so each group sets `idle_in_transaction_session_timeout` (5 s)
 * for itself: a replica frozen before its COMMIT loses its session (and its
 * group, never acknowledged) instead of blocking the others for ever.
 * Statement details:
 * - Times are bigint ms from the server clock
 *   (`extract(epoch from clock_timestamp())`), never a replica's `Date.now()`.
 * - `admit` is one `INSERT … ON CONFLICT (id) DO NOTHING … RETURNING`, lease
 *   included. With a lease it keeps the chat order at admission (see
 *   `InboxJournal.admit`) in the same statement: the lease columns are set
 *   only when a probe of the chat's active records (`inbox_chat_active`,
 *   up to the new record's `receivedAt`; set-aside rows left out) finds
 *   none that is pending, a due retry, a lapsed lease or leased to anyone
 *   but the caller's own live lease; otherwise the record is journaled
 *   `pending`. A group's multi-row `INSERT` also checks each leased row
 *   against the rows before it of its chat in the same statement (which its
 *   snapshot does not see), so a group admits as its admits would one by
 *   one. Two admissions of one chat racing on two replicas may both lease
 *   (the statements do not see each other): route each chat to one
 *   replica. Claims, heartbeats, completions, failures and every outbox
 *   transition are single `UPDATE`s whose `WHERE` checks the state and the
 *   fencing token: the database decides, atomically, whether a caller still
 *   holds its lease.
 * - Lapsed leases are claimable by anyone, the holder's own incarnation too
 *   (a claim whose reply was lost must not strand its records); a live lease
 *   only by the owner's other incarnations under `reclaimOwn`.
 * - The inbox `claimDue` merges LIMITed branches of the due index (pending in
 *   receipt order; retries and lapsed leases due by now), so a backlog of
 *   settled or pending records is never walked, and leases in arrival order
 *   (`receivedAt`, then admission order). It keeps each chat's order: a
 *   record is left while an earlier active record of its chat is leased
 *   elsewhere (see `InboxJournal.claimDue`), which it finds by the chat's
 *   active records (`inbox_chat_active`), never its settled ones. Under READ
 *   COMMITTED its snapshot may miss a concurrent scan's leases, so the earlier
 *   active records of each chat it takes from are locked (`FOR KEY SHARE SKIP
 *   LOCKED`, which reads their latest versions); the rest of a chat is left
 *   for a later scan when one of them is locked by another scan, claimable
 *   but not taken, or leased elsewhere: two scans never both take records of
 *   a chat. The lock waits for nothing and does not hold up a heartbeat or a
 *   completion of those records.
 * - `claimDue` (inbox and outbox) reads a partial index of the records a scan
 *   must look at (active records by when they are due) in a CTE with
 *   `FOR UPDATE SKIP LOCKED` that feeds an `UPDATE … RETURNING`: concurrent
 *   replicas claim disjoint sets and never wait for each other. Settled
 *   records are never scanned. Only chat heads (no earlier unsettled entry
 *   of the chat) carry an outbox due mark, so an outbox scan reads the heads
 *   (re-checking headship by the chat index) and never the entries queued
 *   behind an unsettled one; see "Per-chat order" and `outboxSql` in
 *   `sql.ts` ("Due marks: chat heads only").
 * - The outbox `claimDue` takes the abandoned `sending` entries (lapsed, or
 *   the owner's other incarnations' under `reclaimOwn`) in the same
 *   statement: one whose call was never announced (`markCalling`) is leased
 *   again as due work, its attempts unchanged, before the due heads and
 *   within `limit`; one whose call was announced is ambiguous (`unknown`, or
 *   with `resendAmbiguous` leased again as well).
 * - A due scan named by a `requestId` (`ClaimDueOptions`) runs in one
 *   transaction (`sql.begin`, with the same `idle_in_transaction_session_timeout`
 *   as a group) with the storing of its answer's references (ids or keys with
 *   their tokens or fences, as JSON text), in `<prefix>scan_answer` (keyed by
 *   the journal and the SHA-256 of the `requestId`, stamped with the server's
 *   time): the answer is there exactly when the scan committed. A `repeat` (by
 *   any replica) closes the request first (a placeholder row: a scan that had
 *   not stored its answer fails on the key and rolls back; one committing is
 *   waited for), then reads the answer and the rows it names, and answers those
 *   still as the scan left them, under the same fencing tokens (see
 *   `scan_answers.ts`). Answers older than `SCAN_ANSWER_KEEP_MS` by the
 *   server's clock count as gone: each store deletes up to 16 of them, and
 *   `purge` the rest of its journal's. A scan without a `requestId` runs as
 *   before. A client without `begin` stores the answer by a statement of its
 *   own after the scan (a reply lost between the two loses the answer).
 * - `purge` deletes in bounded batches (`purgeBatchSize`, 1000 by default),
 *   one statement each, oldest first, by a partial index of `done`/`sent`
 *   records. Retention itself is the Bot's `durability.retention` (7 days by
 *   default): the engine calls `purge`.
 * - The server keeps one plan per prepared statement, made with the table
 *   statistics of that moment. A journal table that outgrew its statistics
 *   (a burst within autovacuum's naptime: a first start under load, a
 *   restart's backlog) is analyzed by the backend, from its claim scans, at
 *   most every 5 s (see `table_stats.ts`).
 * - The multi-row `markSent` finds each entry it settles by its seq, from
 *   the list of those it may settle, and checks that its chat row was locked
 *   in an array (not by a join of two CTEs): the server estimates that list
 *   at one row, and a nested loop of two CTE scans costs the square of the
 *   group (100 sends: 10,000 rows read twice).
 *
 * ## Per-chat order across replicas
 * A `reserve` with a lease may lease only when no earlier entry of its chat
 * is `queued`, `sending` or `failed`. Under READ COMMITTED a plain
 * `NOT EXISTS` is racy: two reserves of one chat, each in its own snapshot,
 * would both see the chat clear. So every reserve also upserts the chat's
 * row in `<prefix>outbox_chat` (`INSERT … ON CONFLICT DO UPDATE`) in the same
 * statement. That row lock serializes the reserves of one chat (other chats
 * are not affected), the entry's `seq` is drawn after it (a chat's seqs follow
 * the lock order), and each upsert stamps the row with a new version from a
 * sequence and returns the version it replaced. A reserve leases only when
 * that replaced version is the one its own snapshot saw (no reserve, nor a
 * `retry`, of the chat committed since the snapshot) and its snapshot has no
 * unsettled entry of the chat; otherwise the entry is `queued` and the worker
 * sends it in order. This costs no extra round trip, unlike an advisory lock,
 * which needs a transaction (BEGIN, lock, insert, COMMIT). The statements
 * that settle an entry (`markSent`, `markFailed`, `discard`, the set-aside of
 * a damaged entry, the move of a lost send to `unknown`) and `retry` take
 * the same chat row lock and stamp a new version in the same statement, and
 * due-mark the chat's next head; a statement whose snapshot may be stale for
 * the chat (the version it replaced is not its snapshot's) sets the chat
 * row's `resync` flag instead, which a `claimDue` consumes (schema version 2).
 * A reserve that does not see a settle yet only queues where it could have
 * leased, which is safe. `purge` drops chat rows
 * with no entry that were untouched for an hour (or the retention, if longer).
 * A stamp renews the row's `touched_at` only once it is a minute old, so that
 * the stamp changes no indexed column and is a HOT update (no index entry).
 *
 * ## JSON
 * Payloads, content, session values and kv values are stored as `text`
 * holding `JSON.stringify` output, and parsed back in JS: exactly what
 * JavaScript wrote comes back (object key order, `1e21`, `\u0000` in
 * strings, lone surrogates), where `jsonb` would reorder keys and refuse
 * some strings. A session or kv value whose JSON is damaged rejects its read
 * with an error naming the table, the row and the column; a journal row is
 * set aside instead (see "Damaged records").
 *
 * ## Damaged records
 * A journal row that does not read back as a record (its payload or content
 * not JSON, an unknown state or kind, a lease half there, a fence below its
 * lease token: a hand edit, a bug elsewhere) is set aside by the first
 * operation that reads it: a due scan, `claim`, `list`, `get`, or a
 * `reserve` of its key. The row is kept (its data columns as stored; a due
 * scan or `claim` that found it leaves the lease it had just taken, which is
 * stale from then on) and gets the set-aside
 * columns (schema version 5): `damage` (what is wrong, naming the column),
 * `set_aside_at` (server clock), `set_aside_seq` (the order rows were set
 * aside in) and `damage_reported`; its `due_at` is cleared. One statement
 * does it, applying only to the row version that was read (`xmin`): of
 * several replicas that meet the row, one sets it aside, and a row that
 * changed meanwhile is read again. From then on every statement leaves it
 * out: due scans neither take it nor let it hold back its chat (a damaged
 * outbox entry that blocked its chat hands the chat to its next entry, in the
 * same statement), lists return the other rows, `get` rejects with a
 * `DamagedRecordError` naming the record and the problem (so does a
 * `reserve` of its key), `replay`, `retry` and `discard` answer `false`,
 * `purge` keeps it, and a completion, heartbeat, `markCalling`, `markSent`
 * or `markFailed` under its old lease is stale. A due scan that set a row
 * aside returns the others and scans again for what it left, so a damaged
 * row never strands a batch (the lease the scan took on the row stays in
 * it, stale); a list reads its page again. `damaged()` lists the rows set
 * aside, and the bot reports each one once (`reportDamaged`). A write that
 * does not read the row (a heartbeat, a completion) still applies to a
 * damaged row no read has set aside yet. Repair or delete such a row with
 * SQL: a repaired row stays set aside until its four set-aside columns are
 * NULL again, and is due again once its `due_at` is set (0: now).
 *
 * ## NUL
 * Postgres `text` cannot hold U+0000. Ids, keys, chat ids, provider, content
 * hash, lease owner/incarnation, list filters and `markSent`'s `messageId` are
 * refused with a `TypeError` naming the field, before anything is written.
 * A NUL in the free text `error` of `fail`/`markFailed` becomes U+FFFD, so a
 * record can always settle. JSON payloads keep it (escaped as `\u0000`).
 *
 * @module
 */
export { PostgresDurability } from "./durability.ts";
export { PostgresKv } from "./kv.ts";
export { PostgresRateLimiter, type PostgresRateLimiterOptions } from "./rate_limiter.ts";
export {
  type PostgresClient,
  type PostgresDurabilityOptions,
  type PostgresKvOptions,
  type PostgresOptions,
  type PostgresStoreOptions,
} from "./options.ts";
export { POSTGRES_SCHEMA_VERSION } from "./sql.ts";
export { PostgresStore } from "./store.ts";
