/**
 * How the cost of one journal write grows with the number of records kept:
 * the file backend rewrites its whole snapshot on every change, SQLite
 * updates rows in place. For each size, the journal is filled with `done`
 * records (what retention keeps for a week), then one message's journal
 * writes (admit with a lease, reserve a reply, mark it sent, complete) are
 * timed one after the other, with no concurrency to share a rewrite.
 *
 *   bun bench/file_growth.bench.ts [sizes, comma-separated] [writes per size]
 */
import { mkdtempSync, rmSync, statSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { DurabilityBackend } from "../src/contract.ts";
import { FileDurability } from "../backends/file/durability.ts";
import { SQLiteDurability } from "../backends/sqlite/durability.ts";

const SIZES = (Bun.argv[2] ?? "1000,10000,100000").split(",").map(Number);
const WRITES = Number(Bun.argv[3] ?? 40);
const lease = { owner: "bench", incarnation: "i1", leaseMs: 60_000 };

async function fill(b: DurabilityBackend, n: number): Promise<void> {
  const batch = 1000;
  for (let i = 0; i < n; i += batch) {
    await Promise.all(Array.from({ length: Math.min(batch, n - i) }, async (_, j) => {
      const id = `old-${i + j}`;
      const r = await b.inbox.admit({ id, kind: "message", chatId: `c${(i + j) % 500}`, provider: "bench", payload: { text: `hello ${i + j}` }, receivedAt: Date.now() }, lease);
      await b.inbox.complete(id, r!.lease!.token);
    }));
  }
}

/** Mean ms of one journal write, over the four writes of one message, `WRITES` messages in a row. */
async function perWrite(b: DurabilityBackend): Promise<number> {
  const started = performance.now();
  for (let i = 0; i < WRITES; i++) {
    const id = `new-${i}`;
    const r = await b.inbox.admit({ id, kind: "message", chatId: "c-new", provider: "bench", payload: { text: "hi" }, receivedAt: Date.now() }, lease);
    const e = await b.outbox.reserve({ key: `${id}:1`, chatId: "c-new", content: { text: "hello" }, contentHash: "h", inboundId: id }, lease);
    await b.outbox.markSent(e.entry.key, e.entry.lease!.token, `mid-${i}`);
    await b.inbox.complete(id, r!.lease!.token);
  }
  return (performance.now() - started) / (WRITES * 4);
}

const variants = [
  { name: "file", file: "bot.json", create: (path: string) => new FileDurability({ path }) },
  { name: "sqlite", file: "bot.db", create: (file: string) => new SQLiteDurability({ file }) },
];

console.log(`ms per journal write (mean of ${WRITES * 4} sequential writes) with N done records retained`);
console.log(`${"records".padStart(8)}  ${variants.map((v) => `${v.name.padStart(10)} ms  ${"size".padStart(9)}`).join("  ")}  file/sqlite`);
for (const size of SIZES) {
  const cells: string[] = [];
  const ms: number[] = [];
  for (const v of variants) {
    const dir = mkdtempSync(join(tmpdir(), "botmesh-growth-"));
    try {
      const path = join(dir, v.file);
      const b = v.create(path);
      await b.open?.();
      await fill(b, size);
      const mean = await perWrite(b);
      await b.close?.();
      ms.push(mean);
      cells.push(`${mean.toFixed(3).padStart(13)}  ${(statSync(path).size / 1e6).toFixed(1).padStart(6)} MB`);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  }
  console.log(`${String(size).padStart(8)}  ${cells.join("  ")}  ${(ms[0]! / ms[1]!).toFixed(1).padStart(10)}x`);
}
