/**
 * Per-write cost of the events journals as they grow: FileEventJournal
 * (whole-file rewrite per write), SharedFileEventJournal (re-read and rewrite
 * under the inter-process mutex) and SharedFileEventJournal with appendLog
 * (one appended line per write, compaction every 1000 entries or 4 MiB),
 * side by side in one run. With appendLog the cost should stay flat.
 * Each journal first takes one write that is not counted: the first
 * operation after opening loads the snapshot (a one-time cost that grows
 * with the journal, not a per-write one); its time is printed apart.
 *
 *   bun bench/events_growth.bench.ts [sizes, comma-separated] [writes per size]
 */
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { LeasedEventJournal } from "../src/events/types.ts";
import { FileEventJournal, MemoryEventJournal, SharedFileEventJournal } from "../backends/events/mod.ts";
import { serializeEventSnapshot } from "../backends/events/snapshot.ts";

const SIZES = (Bun.argv[2] ?? "1000,10000,100000").split(",").map(Number);
const WRITES = Number(Bun.argv[3] ?? 40);
const lease = { owner: "bench", incarnation: "i1", leaseMs: 60_000 };

type Variant = { name: string; open: (path: string) => Promise<LeasedEventJournal> };
const variants: Variant[] = [
  { name: "FileEventJournal", open: (p) => FileEventJournal.open(p, { lock: true }) },
  { name: "Shared", open: (p) => SharedFileEventJournal.open(p) },
  { name: "Shared+appendLog", open: (p) => SharedFileEventJournal.open(p, { appendLog: true }) },
];

/** Writes a journal file holding `n` done app events (built in memory, saved as one snapshot). */
async function seed(path: string, n: number): Promise<void> {
  const memory = new MemoryEventJournal();
  for (let i = 0; i < n; i++) {
    const id = `old-${i}`;
    const r = await memory.append({ id, eventType: "order.created", payload: { order: i, total: 12.5 } }, lease);
    await memory.complete(id, r!.lease!.token);
  }
  writeFileSync(path, serializeEventSnapshot(memory, 0));
}

/** Mean ms per write over `WRITES` events, each appended with a lease then completed, one after the other. */
async function perWrite(j: LeasedEventJournal): Promise<number> {
  const started = performance.now();
  for (let i = 0; i < WRITES; i++) {
    const r = await j.append({ id: `new-${i}`, eventType: "order.created", payload: { order: i } }, lease);
    await j.complete(`new-${i}`, r!.lease!.token);
  }
  return (performance.now() - started) / (WRITES * 2);
}

console.log(`ms per write (mean of ${WRITES * 2} sequential writes) with N done events in the journal; in brackets, ms of the first write+complete after opening (it loads the snapshot)`);
console.log(`${"events".padStart(8)}  ${variants.map((v) => v.name.padStart(18)).join("  ")}`);
for (const size of SIZES) {
  const cells: string[] = [];
  for (const v of variants) {
    const dir = mkdtempSync(join(tmpdir(), "botmesh-events-growth-"));
    try {
      const path = join(dir, "events.json");
      await seed(path, size);
      const j = await v.open(path);
      const loadStarted = performance.now();
      const first = await j.append({ id: "first", eventType: "order.created", payload: {} }, lease);
      await j.complete("first", first!.lease!.token);
      const firstMs = performance.now() - loadStarted;
      const ms = await perWrite(j);
      await j.close();
      cells.push(`${ms.toFixed(3)} (${firstMs.toFixed(0)})`.padStart(18));
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  }
  console.log(`${String(size).padStart(8)}  ${cells.join("  ")}`);
}
