// Under Node (where Telegraf's multipart uploads run): a photo uploaded from a Buffer is journaled, and
// the outbox's retry of it, made from the journal, uploads the same bytes (the journal gives binary back
// as a Uint8Array, and Telegraf uploads only a Buffer).
import { afterAll, expect, test } from "bun:test";
import { mkdirSync, rmSync } from "node:fs";
import { join } from "node:path";

// Inside the repository, so that the bundle's import of telegraf finds node_modules/telegraf.
const dir = join(process.cwd(), ".tmp", `telegraf-node-${crypto.randomUUID()}`);
mkdirSync(dir, { recursive: true });
afterAll(() => rmSync(dir, { recursive: true, force: true }));

test("under Node, a Buffer upload retried from the journal uploads the same bytes", async () => {
  const out = join(dir, "upload.mjs");
  const build = Bun.spawnSync([process.execPath, "build", "tests/fixtures/telegraf_node_upload.ts", "--target=node", "--outfile", out, "--external", "telegraf"]);
  expect(build.exitCode, build.stderr.toString()).toBe(0);
  const run = Bun.spawnSync(["node", out]);
  expect(run.exitCode, run.stderr.toString()).toBe(0);
  const { calls, results } = JSON.parse(run.stdout.toString().trim().split("\n").pop()!) as {
    calls: { method: string; status: number; hasFile: boolean; size: number }[];
    results: unknown[];
  };
  const photos = calls.filter((c) => c.method === "sendPhoto");
  expect(photos.map((c) => [c.status, c.hasFile])).toEqual([[502, true], [200, true]]);
  expect(photos[1]!.size).toBe(photos[0]!.size);
  expect(results).toEqual([{ message_id: 0, chat: { id: 18 } }]); // queued for its retry: the placeholder
}, 30_000);
