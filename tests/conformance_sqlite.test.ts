import { describe, expect, test } from "bun:test";
import { Database } from "bun:sqlite";
import { rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { DurabilityBackend } from "../src/contract.ts";
import { SQLiteDurability, SQLiteStore } from "../backends/sqlite/mod.ts";
import { runBackendContract, runDurabilityConformance } from "../testing.ts";

/** The temp file of each backend (and of the backends reopened over it). */
const files = new WeakMap<DurabilityBackend, string>();
/** The store behind a `store.durability()` backend. */
const stores = new WeakMap<DurabilityBackend, SQLiteStore>();

function tempFile(): string {
  return join(tmpdir(), `botmesh-sqlite-${crypto.randomUUID()}.db`);
}

function removeDb(file: string): void {
  for (const suffix of ["", "-wal", "-shm", "-journal"]) rmSync(file + suffix, { force: true });
}

/** Lets go of every reference the old backend (and its store) holds, as a killed process would. */
async function letGo(backend: DurabilityBackend): Promise<void> {
  const sqlite = backend as SQLiteDurability;
  while (sqlite.isOpen) await sqlite.close();
  await stores.get(backend)?.close();
}

/**
 * Damages a record in place through a connection of its own, as a hand edit of the file would: a column
 * of its row (the inbox record `id`, the outbox entry of key `id`) is set to a value, per journal.
 */
function damageRow(set: { inbox: readonly [string, string]; outbox: readonly [string, string] }) {
  return (backend: DurabilityBackend, journal: "inbox" | "outbox", id: string): DurabilityBackend => {
    const [column, value] = set[journal];
    const raw = new Database(files.get(backend)!);
    try {
      const { changes } = raw.prepare(
        `UPDATE botmesh_${journal} SET ${column} = ? WHERE ${journal === "inbox" ? "id" : "key"} = ?`,
      ).run(value, id);
      if (changes !== 1) throw new Error(`no ${journal} row ${id} to damage`);
    } finally {
      raw.close();
    }
    return backend;
  };
}

/** Valid JSON nested far deeper than the journal writes (MAX_STORED_DEPTH): walking it recursively would overflow the stack. */
const tooDeep = "[".repeat(300_000) + "]".repeat(300_000);

runDurabilityConformance({
  name: "sqlite (SQLiteDurability)",
  create: ({ now }) => {
    const file = tempFile();
    const backend = new SQLiteDurability({ file, clock: now });
    files.set(backend, file);
    return backend;
  },
  reopen: async (old, { now }) => {
    const file = files.get(old)!;
    await letGo(old);
    const backend = new SQLiteDurability({ file, clock: now });
    files.set(backend, file);
    return backend;
  },
  cleanup: async (backend) => {
    await letGo(backend);
    removeDb(files.get(backend)!);
  },
  damage: damageRow({ inbox: ["payload", tooDeep], outbox: ["content", "{not json"] }),
  harness: { describe, test, expect },
  simulatedTime: true,
});

// The same journals through the store's connection: the journal contract is enough (the whole suite runs above).
runBackendContract({
  name: "sqlite (SQLiteStore#durability)",
  create: async ({ now }) => {
    const file = tempFile();
    const store = new SQLiteStore({ file, clock: now });
    await store.set("greeting", "hello"); // the store holds the connection too
    const backend = store.durability();
    files.set(backend, file);
    stores.set(backend, store);
    return backend;
  },
  reopen: async (old, { now }) => {
    const file = files.get(old)!;
    await letGo(old);
    const store = new SQLiteStore({ file, clock: now });
    expect(await store.get("greeting")).toBe("hello");
    const backend = store.durability();
    files.set(backend, file);
    stores.set(backend, store);
    return backend;
  },
  cleanup: async (backend) => {
    await letGo(backend);
    removeDb(files.get(backend)!);
  },
  damage: damageRow({ inbox: ["state", "archived"], outbox: ["content", tooDeep] }),
  harness: { describe, test, expect },
  simulatedTime: true,
});
