/**
 * PostgresDurability: the inbox and outbox journals (see `mod.ts` for the
 * user documentation; the SQL text is in `sql.ts`).
 *
 * @module
 */
import type { DurabilityBackend, InboxJournal, OpenWarning, OutboxJournal } from "../../src/contract.ts";
import { Context } from "./connection.ts";
import { PgInbox } from "./inbox.ts";
import { type PostgresDurabilityOptions, resolveOptions } from "./options.ts";
import { PgOutbox } from "./outbox.ts";
import { checkPostgresServer } from "./server_checks.ts";

/**
 * A durability backend in PostgreSQL: the inbox and outbox journals, shared
 * by any number of replicas on any number of hosts (`scope: "shared"`).
 * Every operation is one statement; fencing, claims and clocks are decided
 * by the server (see the module documentation). Retention is the Bot's
 * `durability.retention` (the engine calls `purge`). A row that does not
 * read back as a record (damaged by a hand edit or a bug elsewhere) is set
 * aside, kept as stored, by the first read that meets it: everything else
 * leaves it out, `get` rejects with a `DamagedRecordError`, and each
 * journal's `damaged()` lists it (see "Damaged records" in the module
 * documentation).
 *
 * The schema is created or upgraded by `open()` (the bot calls it in
 * `start()`), or by the first operation. `close()` leaves the client open:
 * it is the caller's, end it with `await sql.end()`.
 *
 * @example Journals only
 * ```ts ignore
 * import postgres from "postgres";
 * import { PostgresDurability } from "@botmesh/durable/postgres";
 *
 * const sql = postgres("postgres://postgres@127.0.0.1:5432/test", { max: 10, fetch_types: false });
 * const backend = new PostgresDurability({ sql, schema: "bots" });
 * await backend.open();
 * const id = crypto.randomUUID(); // the provider's message id
 * await backend.inbox.admit({
 *   id,
 *   kind: "message",
 *   chatId: "c1",
 *   provider: "test",
 *   payload: { text: "hi" },
 *   receivedAt: Date.now(),
 * });
 * const record = await backend.inbox.claim(id, { owner: "host/bot/1", incarnation: "a", leaseMs: 60_000 });
 * await backend.inbox.complete(id, record!.lease!.token);
 * console.log((await backend.inbox.get(id))?.state); // "done"
 * await sql.end();
 * ```
 */
export class PostgresDurability implements DurabilityBackend {
  /** Always `'postgres'`. */
  readonly name: string = "postgres";
  /** Shared by replicas on many hosts. */
  readonly scope: "shared" = "shared";
  /** The inbound journal. */
  readonly inbox: InboxJournal;
  /** The outbound journal. */
  readonly outbox: OutboxJournal;
  /** The schema of the tables. */
  readonly schema: string;
  /** The prefix of the table names. */
  readonly tablePrefix: string;
  readonly #c: Context;

  /**
   * @param options `sql` (required), `schema`, `tablePrefix`, `purgeBatchSize`, `groupLanes`
   * @throws {TypeError|RangeError} naming the option when one is invalid
   */
  constructor(options: PostgresDurabilityOptions) {
    this.#c = new Context(resolveOptions(options));
    this.schema = this.#c.t.schema;
    this.tablePrefix = this.#c.t.prefix;
    this.inbox = new PgInbox(this.#c);
    this.outbox = new PgOutbox(this.#c);
  }

  /**
   * Creates or upgrades the schema (once per client, schema and prefix; later calls resolve at once),
   * then reports a server configured to lose committed writes (`fsync` or `synchronous_commit` off).
   * @param warn receives what the bot reports as a `warning` (`journal-not-durable`)
   * @throws {Error} naming the schema when it cannot be set up or was written by a newer version of the library
   */
  async open(warn?: (warning: OpenWarning) => void): Promise<void> {
    await this.#c.ready();
    if (warn) await checkPostgresServer(this.#c.sql, this.#c.where, this.#c.prepare, warn);
  }

  /** Nothing to release: the client stays open (it is the caller's). */
  close(): Promise<void> {
    return Promise.resolve();
  }
}
