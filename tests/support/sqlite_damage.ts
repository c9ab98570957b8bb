// A SQLite journal with records, and damage done to it past its header (for the damaged-file tests).
import { closeSync, openSync, writeSync } from "node:fs";
import { SQLiteDurability } from "../../backends/sqlite/durability.ts";
import { openSqlite } from "../../src/runtime/sqlite.ts";

/** Creates a journal at `file` holding `n` inbox records, and closes it (SQLite checkpoints the WAL into the file). */
export async function journalWithRecords(file: string, n = 300): Promise<void> {
  const backend = new SQLiteDurability({ file });
  await backend.open();
  await Promise.all(Array.from({ length: n }, (_, i) =>
    backend.inbox.admit({
      id: `m${i}`,
      kind: "message",
      chatId: `c${i % 7}`,
      provider: "test",
      payload: { text: `message ${i} `.repeat(20) },
      receivedAt: 1_000 + i,
    })));
  await backend.close();
}

/**
 * Overwrites the root page of `table` with garbage (the file's header and schema page are left intact, so
 * that it still opens): every statement that reads the table then fails with SQLITE_CORRUPT.
 */
export async function damageTable(file: string, table: string): Promise<void> {
  const db = await openSqlite(file);
  let root: number;
  let pageSize: number;
  try {
    // Everything into the file itself first: a page whose newer copy is in the WAL would be read from there.
    db.prepare("PRAGMA wal_checkpoint(TRUNCATE)").get();
    root = Number(db.prepare("SELECT rootpage FROM sqlite_master WHERE name = ?").get(table)?.rootpage);
    pageSize = Number(db.prepare("PRAGMA page_size").get()?.page_size);
  } finally {
    db.close();
  }
  if (!(root > 1) || !(pageSize > 0)) throw new Error(`no root page of ${table} in ${file}`);
  const fd = openSync(file, "r+");
  try {
    writeSync(fd, new Uint8Array(pageSize).fill(0xab), 0, pageSize, (root - 1) * pageSize);
  } finally {
    closeSync(fd);
  }
}
