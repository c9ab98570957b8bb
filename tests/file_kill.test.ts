/**
 * Real processes, real kills: a child writes through a FileDurability in a
 * loop and is killed with SIGKILL at random moments; after each kill the file
 * is opened as a restarted process would (breaking the dead child's lock) and
 * every operation the child reported as acknowledged must be there.
 */
import { afterAll, expect, test } from "bun:test";
import { existsSync, mkdtempSync, readdirSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { FileDurability } from "../backends/file/durability.ts";
import { childLines } from "./support/child_lines.ts";

const KILLS = 36;
const FIXTURE = join(import.meta.dir, "fixtures", "file_writer.ts");
const dir = mkdtempSync(join(tmpdir(), "botmesh-file-kill-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

/** What the children acknowledged, over all rounds. */
const acked = {
  admitted: new Set<string>(),
  claimed: new Map<string, number>(),
  completed: new Set<string>(),
  reserved: new Set<string>(),
  sent: new Map<string, string>(),
};

function record(line: string): void {
  const [op, a, b] = line.split(" ");
  switch (op) {
    case "admit":
      acked.admitted.add(a);
      break;
    case "claim":
      acked.claimed.set(a, Number(b));
      break;
    case "complete":
      acked.completed.add(a);
      break;
    case "reserve":
      acked.reserved.add(a);
      break;
    case "sent":
      acked.sent.set(a, b);
      break;
    case "ready":
      break;
    default:
      throw new Error(`unexpected line from the child: ${JSON.stringify(line)}`);
  }
}

/** The snapshot rewrites' temporary files (`bot.json.<random>.tmp`) in the directory. */
function snapshotTemps(): string[] {
  return readdirSync(dir).filter((name) => /^bot\.json\.[0-9A-Za-z_-]+\.tmp$/.test(name));
}

test(`SIGKILL at random moments (${KILLS} kills): the file stays readable and keeps every acknowledged operation`, async () => {
  const path = join(dir, "bot.json");
  let roundsWithAcks = 0;
  let leftoverLocks = 0;
  let leftoverTemps = 0;
  const bun = process.execPath;
  for (let round = 0; round < KILLS; round++) {
    const child = Bun.spawn([bun, FIXTURE, path, `r${round}`, "3"], { stdout: "pipe", stderr: "pipe" });
    const output = childLines(child.stdout, `writer ${round}`);
    const errors = new Response(child.stderr).text();
    // Kill at a random moment: every fourth round whenever (maybe before the child has opened the
    // file), the others once its first write is acknowledged (so that a loaded machine's slow start,
    // or a first write that is a whole snapshot, cannot make the kills miss the writes).
    if (round % 4 !== 0) await output.next("admit", 15_000).catch(() => {});
    await Bun.sleep(round % 4 === 0 ? 20 + Math.random() * 180 : Math.random() * 120);
    child.kill("SIGKILL");
    const code = await child.exited;
    await output.ended;
    const stderr = await errors;
    expect(child.signalCode ?? String(code), `round ${round}: the child died by SIGKILL (stderr: ${stderr})`).toBe("SIGKILL");
    // Only complete lines count (the kill may cut the last one): childLines keeps complete lines only.
    const lines = output.all();
    for (const line of lines) record(line);
    if (lines.length > 1) roundsWithAcks++;
    if (existsSync(`${path}.lock`)) leftoverLocks++;
    if (snapshotTemps().length > 0) leftoverTemps++;

    // A restarted process: opens the file (breaking the dead child's lock) and finds everything acknowledged.
    if (!existsSync(path)) continue; // killed before it ever wrote
    const backend = new FileDurability({ path });
    await backend.open();
    expect(snapshotTemps(), "a killed rewrite's temporary file is removed at open").toEqual([]);
    try {
      for (const id of acked.admitted) {
        const r = await backend.inbox.get(id);
        expect(r, `acknowledged admit of ${id} (round ${round})`).not.toBe(null);
      }
      for (const [id, token] of acked.claimed) {
        const r = await backend.inbox.get(id);
        expect(r!.fence, `acknowledged claim of ${id} with token ${token}`).toBeGreaterThanOrEqual(token);
      }
      for (const id of acked.completed) {
        expect((await backend.inbox.get(id))?.state, `acknowledged completion of ${id}`).toBe("done");
      }
      for (const key of acked.reserved) {
        expect(await backend.outbox.get(key), `acknowledged reservation of ${key}`).not.toBe(null);
      }
      for (const [key, messageId] of acked.sent) {
        const e = await backend.outbox.get(key);
        expect(e?.state, `acknowledged markSent of ${key}`).toBe("sent");
        expect(e?.messageId).toBe(messageId);
      }
    } finally {
      await backend.close();
    }
  }
  // The test must have exercised something: kills in the middle of acknowledged work, stale locks broken.
  expect(roundsWithAcks).toBeGreaterThanOrEqual(KILLS / 2);
  expect(acked.completed.size).toBeGreaterThan(KILLS);
  expect(leftoverLocks).toBeGreaterThanOrEqual(KILLS / 2);
  console.log(
    `file kill test: ${KILLS} kills, ${roundsWithAcks} with acknowledged work, ${leftoverLocks} stale locks broken, ` +
      `${leftoverTemps} leftover temp files, ${acked.admitted.size} admits / ${acked.completed.size} completions / ` +
      `${acked.sent.size} sends acknowledged`,
  );
}, 60_000);
