/**
 * What a PostgreSQL server must be configured for before a journal lives in
 * it: a commit it confirms must be on disk. `fsync = off` (the server may
 * lose or corrupt committed data on a crash) and `synchronous_commit = off`
 * (it confirms commits before they are flushed: the last moments of writes
 * are lost on a crash) are reported at open.
 *
 * @module
 */
import type { OpenWarning } from "../../src/contract.ts";
import type { PostgresClient } from "./options.ts";

async function setting(sql: PostgresClient, name: "fsync" | "synchronous_commit", prepare: boolean): Promise<string | undefined> {
  try {
    const rows = await sql.unsafe(`SHOW ${name}`, [], { prepare }) as Record<string, unknown>[];
    const value = rows[0]?.[name];
    return typeof value === "string" ? value : undefined;
  } catch {
    return undefined; // not allowed here (a restricted role, a proxy): nothing to check
  }
}

/**
 * Reads `fsync` and `synchronous_commit` as this client's sessions see them
 * (a role, database or connection setting counts) and reports either being
 * off to `warn`.
 *
 * @param sql the client
 * @param where how the warning names the backend (schema and tables)
 * @param prepare whether the client prepares statements
 * @param warn receives the warning
 */
export async function checkPostgresServer(
  sql: PostgresClient,
  where: string,
  prepare: boolean,
  warn: (warning: OpenWarning) => void,
): Promise<void> {
  const [fsync, synchronousCommit] = await Promise.all([setting(sql, "fsync", prepare), setting(sql, "synchronous_commit", prepare)]);
  if (fsync === "off") {
    warn({
      code: "journal-not-durable",
      message: `Postgres ${where}: the server runs with fsync = off: a crash of the server or its machine can lose ` +
        `or corrupt committed journal records. Turn fsync on for a journal you rely on`,
    });
  }
  if (synchronousCommit === "off") {
    warn({
      code: "journal-not-durable",
      message: `Postgres ${where}: synchronous_commit = off for this client's sessions: a commit is confirmed before ` +
        `it is on disk, so a server crash loses the journal writes of its last moments (a message answered ` +
        `"admitted" can vanish). Set synchronous_commit to on (or local) for this role or database`,
    });
  }
}
