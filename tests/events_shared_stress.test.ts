/**
 * SharedFileEventJournal: commits are exclusive by construction. Three processes write to one file
 * (tests/fixtures/shared_stress_worker.ts) while each stalls, at random writes, at every step of a
 * commit for longer than staleLockMs (its event loop blocked: the mutex is broken by the others), in
 * both modes. Every acknowledged write must be in the journal; every other write was rejected to its
 * caller.
 *
 * CI: 10,200 writes: snapshot rewrite 3 processes × 850 writes × 2 files, appendLog 3 × 1,700 × 1
 * file, 2 stalls per process and file (the 3 processes cover the 5 steps). A longer run:
 * SHARED_STRESS_SCALE=<factor of the rounds> SHARED_STRESS_STALLS=<stalls per process and file>.
 */
import { childLines } from "./support/child_lines.ts";
import { afterAll, describe, expect, test } from "bun:test";
import { mkdirSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { SharedFileEventJournal } from "../backends/events/shared_journal.ts";

const FIXTURE = join(import.meta.dir, "fixtures", "shared_stress_worker.ts");
const root = mkdtempSync(join(tmpdir(), "botmesh-shared-stress-"));
afterAll(() => rmSync(root, { recursive: true, force: true }));

const env = (name: string, fallback: number) => Number(process.env[name] ?? fallback);
const SCALE = env("SHARED_STRESS_SCALE", 1);
const STALLS = env("SHARED_STRESS_STALLS", 2);
const STALE = 1_000;
const PROCESSES = 3;

interface Result {
  acked: string[];
  refused: [string, string][];
  stalled: string[];
  retried: number;
}

const MODES = [
  { name: "snapshot rewrite", appendLog: false as const, writes: 850, rounds: 2 * SCALE },
  { name: "appendLog (compacting every 50)", appendLog: { compactEvery: 50 }, writes: 1_700, rounds: SCALE },
];

describe("SharedFileEventJournal: stalls past staleLockMs at every step of a commit, 3 processes", () => {
  for (const mode of MODES) {
    const { writes: WRITES, rounds: ROUNDS } = mode;
    test(`${mode.name}: ${PROCESSES} × ${WRITES} writes × ${ROUNDS}: no acknowledged write lost, every other one rejected`, async () => {
      const started = Date.now();
      const totals = { writes: 0, acked: 0, refused: 0, refusedPresent: 0, lost: 0, stalls: 0, retried: 0 };
      const steps = new Set<string>();
      for (let round = 0; round < ROUNDS; round++) {
        const dir = join(root, `${mode.appendLog ? "log" : "snap"}-${round}`);
        mkdirSync(dir);
        const file = join(dir, "events.json");
        const children = Array.from({ length: PROCESSES }, (_, n) => {
          const config = { appendLog: mode.appendLog, staleLockMs: STALE, count: WRITES, name: `p${n}`, index: n, stalls: STALLS, stallMs: STALE + 200 };
          const child = Bun.spawn([process.execPath, FIXTURE, file, JSON.stringify(config)], {
            stdin: "ignore",
            stdout: "pipe",
            stderr: "inherit",
          });
          return { child, lines: childLines(child.stdout, `p${n}`, 150_000) };
        });
        try {
          const results: Result[] = [];
          for (const { lines } of children) results.push(JSON.parse((await lines.next("RESULT ")).slice(7)));
          for (const { child } of children) expect(await child.exited).toBe(0);
          const journal = await SharedFileEventJournal.open(file, { appendLog: mode.appendLog, staleLockMs: STALE });
          const present = new Set((await journal.list({ limit: 1_000_000 })).map((e) => e.id));
          await journal.close();
          for (const r of results) {
            totals.writes += r.acked.length + r.refused.length;
            totals.acked += r.acked.length;
            totals.refused += r.refused.length;
            totals.stalls += r.stalled.length;
            totals.retried += r.retried;
            for (const step of r.stalled) steps.add(step);
            totals.lost += r.acked.filter((id) => !present.has(id)).length;
            totals.refusedPresent += r.refused.filter(([id]) => present.has(id)).length;
            // Refused writes are only the ambiguous ones (committed, but a newer generation was seen at once).
            for (const [, name] of r.refused) expect(name).toBe("FileMutexLostError");
          }
        } finally {
          for (const { child } of children) child.kill("SIGKILL");
        }
      }
      const seconds = ((Date.now() - started) / 1000).toFixed(1);
      console.log(`[stress ${mode.name}] ${JSON.stringify({ ...totals, steps: [...steps].sort(), seconds })}`);
      expect(totals.writes, "every write settled (resolved or rejected)").toBe(PROCESSES * WRITES * ROUNDS);
      expect(totals.lost, "acknowledged writes lost").toBe(0);
      expect(totals.stalls).toBeGreaterThan(0);
    }, 170_000 * SCALE);
  }
});
