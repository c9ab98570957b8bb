/**
 * `@botmesh/durable/sqlite`: a SQLite session store and durability backend.
 * The bot's conversation state and its inbox/outbox journals live in one
 * SQLite file, which several processes of one host may share.
 *
 * - {@link SQLiteStore}: the bot's {@link SessionStore} (get/set/delete with
 *   TTL). `store.durability()` journals the inbox and outbox in the same file,
 *   over the same connection.
 * - {@link SQLiteDurability}: the journals alone.
 *
 * ## Driver
 * `bun:sqlite` on Bun, `node:sqlite` on Deno and Node ≥ 22.5, `better-sqlite3`
 * (an optional peer dependency: `npm install better-sqlite3`) on older Node.
 * The driver is loaded when the database is opened; the `driver` option
 * picks one explicitly.
 *
 * ## Opening
 * Drivers are loaded with a dynamic `import()`, so opening is asynchronous:
 * - A backend is opened by `open()` and closed by `close()`; `bot.start()`
 *   and `bot.stop()` call them. Both are reference-counted per instance
 *   (several bots, or a test harness, may share one backend): the connection
 *   closes when every `open()` got its `close()`. An operation on a backend
 *   that is not open rejects.
 * - A store opens itself on first use (or by `await store.open()`, which
 *   reports a bad file at once) and holds the connection until
 *   `store.close()`. Its durability backend shares that connection.
 *
 * ## Durability and concurrency
 * - WAL journal mode, `busy_timeout` (`busyTimeoutMs`, 5 s default). The
 *   drivers are synchronous: while another process holds the write lock, a
 *   write waits on this thread (up to `busyTimeoutMs`, then rejects with
 *   "database is locked"). Transactions here are short (at most 256
 *   operations or about 5 ms of work; a purge deletes 1000 rows per step), so
 *   waits are short too.
 * - Processes sharing a file must each have their own `instanceId` (set it
 *   explicitly): two live processes with one id take each other's leases.
 * - `synchronous=FULL` by default: a committed change survives a power loss
 *   or an OS crash, at the cost of one fsync of the WAL per commit (shared by
 *   the operations of a group commit, below). With
 *   `synchronous: "normal"` commits are not fsynced (the WAL is, at each
 *   checkpoint): several times faster, still safe against a crash of the
 *   process, but a power loss or OS crash may roll back the last commits —
 *   an admitted message may be lost (its channel was already acknowledged)
 *   or a `markSent` forgotten (the send goes out again).
 * - Group commit: write operations (journal changes, claims, purge steps,
 *   session `set`/`delete`) called in the same turn of the event loop are
 *   queued and run one after the other, in call order, in one
 *   `BEGIN IMMEDIATE` transaction: one commit, one fsync. A batch takes at
 *   most 256 operations (and stops taking more after about 5 ms), so another
 *   process sharing the file gets the write lock in between; what is left
 *   goes in the next batch.
 *   - Each operation runs in its own `SAVEPOINT`: when it fails (a stale
 *     lease, a constraint, a bug) only its own changes are rolled back and
 *     only its promise rejects; the others of the batch commit. An operation
 *     with a single writing statement (admit, reserve, claim, complete, fail,
 *     heartbeat of the inbox) needs none: SQLite undoes a failed statement by
 *     itself, and the driver tells whether the transaction survived (on a
 *     driver that cannot tell, node:sqlite before Node 22.16, every
 *     operation takes a savepoint).
 *   - Every promise of a batch settles only after `COMMIT` returned: a
 *     resolved write is durable.
 *   - When the batch cannot begin (`SQLITE_BUSY` after `busyTimeoutMs`) or
 *     commit, or an operation loses the transaction (SQLite rolled it back:
 *     an I/O error, disk full), every operation of it rejects with an error
 *     naming the file (the driver's error as its `cause`), and none of them
 *     took effect; operations after the one that lost it go in the next batch.
 *   - A session value whose stored JSON cannot be parsed (a damaged or
 *     hand-edited row) rejects `store.get` with an error naming the file,
 *     table, row and column. A journal row is set aside instead (see
 *     Damaged records).
 *   - Each batch checks the schema version in its transaction: when a newer
 *     version of the library upgraded the file since this process opened it
 *     (a rolling upgrade of the processes of a host), every operation of the
 *     batch rejects with an error naming the file and both versions (restart
 *     the process with the newer version) and nothing is written.
 *   - Reads (`get`, `list`) run at once, outside batches, and see what
 *     committed batches wrote (a write is visible once its promise resolved).
 *     One that meets a damaged row sets it aside in a write of the next
 *     batch and waits for it (see Damaged records).
 *   - `close()` of the last holder commits what was queued before it.
 *   - `stats` counts commits and operations.
 * - Every transaction is `BEGIN IMMEDIATE`: it takes the write lock up front,
 *   so two processes never deadlock upgrading a read lock, and the
 *   read-decide-write of a claim is atomic across processes. Claims are
 *   conditional `UPDATE`s on the fencing token and state read in the
 *   transaction; completions check the caller's token in SQL.
 * - The clock is the host's `Date.now()` (every process on one host shares it);
 *   the `clock` option replaces it for leases, due times, timestamps and
 *   session expiry (tests in simulated time), never for `busyTimeoutMs`.
 *
 * ## Schema
 * Tables `<prefix>meta`, `<prefix>inbox`, `<prefix>outbox`, `<prefix>session`
 * (`tablePrefix` defaults to `botmesh_`). Records are columns (indexed
 * fields, lease, states) plus JSON text for the payload/content. The schema
 * version is kept in `<prefix>meta`; a file is created or upgraded in place
 * on open (an ordered list of migrations, in one transaction), and a file
 * written by a newer version of the library is refused: at open, and by every
 * write batch after it (a process left running on a file that a newer one
 * upgraded stops writing; see group commit). Versions before schema 3 check
 * only at open.
 *
 * An outbox entry's call marker (`called`, set by `outbox.markCalling`) is
 * the column `uncalled_fence` (schema 4): the entry is uncalled exactly when
 * it equals the entry's `fence`. Every claim writes it (the new fence when
 * uncalled), `markCalling` sets it to NULL. A row written before schema 4 has
 * NULL and reads as called (a call may have started under its lease, so a
 * lost one stays ambiguous), without rewriting any row; so does an entry that
 * a process of an older library (one that checks the version only at open)
 * claimed: its claim raised the fence. `markCalling` is one conditional
 * `UPDATE` (no read, no savepoint).
 *
 * Due scans use partial indexes on `due_at` (set only on records a scan
 * must look at: active inbox records, `sending` outbox entries and the first
 * unsettled entry of each chat); so does the reclaim of a previous
 * incarnation's leases (every leased record is due at its lease expiry;
 * schema 8 dropped the lease-owner indexes, two fewer to maintain per write),
 * purges partial indexes of `done`/`sent` records by `updated_at`.
 * The inbox due index is ordered by receipt within a `due_at`, so an inbox
 * `claimDue` reads a pending backlog (`due_at` 0) in order, `limit` rows at a
 * time (more only when records of held chats are skipped); only records due
 * at a time (retries, lapsed leases) are read whole and sorted. It keeps each
 * chat's order: for each chat it comes to, it reads the chat's `processing`
 * records by a partial index on (chat, receipt) (schema 5; never the chat's
 * settled records), and skips the chat's records after the first one leased
 * elsewhere. Each `claimDue` is one write transaction, so scans of several
 * processes never split a chat between them. A leased `admit` keeps the
 * chat's order as well: in its write transaction, before its `INSERT`, it
 * looks for an active record of its chat received no later that comes first
 * (pending, a retry that is due, a lease lapsed or held elsewhere: see
 * `admitsLeased`), by a partial index of the active records (pending,
 * processing, failed) on (chat, receipt) (schema 7; never the chat's settled
 * records), and journals the new record `pending` when it finds one. The SQL
 * returns only such records, so the usual answer (none) is one index probe
 * that passes over the chat's own live leases and waiting retries. As every
 * write takes the write lock, two processes admitting records of one chat
 * at once are serialised: the second sees the first one's lease (held
 * elsewhere) and journals its record pending. Lists read at most `limit` rows per query, in their order: all
 * records by an index on the order, one chat's by an index on (chat, order)
 * (other states skipped), one state's by (state, order); several states run
 * one query per state and merge.
 *
 * ## Damaged file
 * Opening checks every page of the file (`PRAGMA quick_check`: it reads the
 * whole file, about 1 s for 400 MB; `checkOnOpen: false` skips it) and
 * refuses a damaged file with a `DamagedStorageError` naming the file and
 * what to do. `SQLITE_CORRUPT` or `SQLITE_NOTADB` met later, from any driver,
 * is the same error, and every later operation of the connection rejects
 * with it until the file is opened again: a bot then admits no message
 * (each is answered `rejected`), records no outcome and reports the damage
 * once. Stop every process that uses the file, then restore it from a backup,
 * or recover it (`sqlite3 bot.db ".recover" | sqlite3 bot.db.recovered`, move
 * that in its place, delete `bot.db-wal` and `bot.db-shm`).
 *
 * ## Files
 * A new database file is created with mode 0600 (SQLite gives its `-wal` and
 * `-shm` files the same mode); an existing file keeps its mode.
 *
 * ## Damaged records
 * A journal row that does not read back as a record (its payload or content
 * not JSON, a column of the wrong type, such as a BLOB or text in a number
 * column, an unknown state: a bad disk or a hand edit) is set aside by the
 * first operation that meets it: a due scan, a list, a `get`, a change of
 * that record, or a leased admit of its chat that finds it coming first. The row is kept as stored and gets the set-aside columns
 * (schema 6): `damage` (what is wrong, naming the column), `set_aside_at`,
 * `set_aside_seq` (the order rows were set aside in) and `damage_reported`;
 * its `due_at` is cleared, so that due scans no longer find it. This happens
 * once, in a write transaction: of several processes that meet the row, one
 * sets it aside. From then on the row is left out of everything else: due
 * scans neither take it nor let it hold back its chat (a damaged outbox entry
 * that headed its chat hands the chat to its next entry), lists return the
 * other rows, `get` rejects with a `DamagedRecordError` naming the record and
 * the problem, `replay`, `retry` and `discard` answer `false`, `purge` keeps
 * it, and a completion, heartbeat, `markCalling` or `markSent` under its old
 * lease is stale (a `reserve` of its key rejects with the `DamagedRecordError`).
 * `damaged()` lists the rows set aside and the bot reports each one once
 * (`reportDamaged`). A row whose id (key) itself is unreadable is named by its
 * storage key, `ord:<n>` (inbox) or `seq:<n>` (outbox). Repair or delete such
 * a row with SQL; a repaired row stays set aside until its `set_aside_seq`,
 * `damage`, `set_aside_at` and `damage_reported` are NULL again, and a due
 * scan finds it again once its `due_at` is 0 (set it only on a record still
 * to process or send: inbox `pending`, `failed`, `processing`; outbox
 * `queued`, `failed`, `sending`).
 *
 * @module
 */
export type { SqliteDriverName } from "../../src/runtime/sqlite.ts";
export type { SQLiteStats } from "./connection.ts";
export { SQLiteDurability } from "./durability.ts";
export type { SQLiteDurabilityOptions, SQLiteOptions, SQLiteStoreOptions } from "./options.ts";
export { SQLITE_SCHEMA_VERSION } from "./schema.ts";
export { SQLiteStore } from "./store.ts";
