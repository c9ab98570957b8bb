// A 3-step form (ctx.ask) on SQLite, interrupted by SIGKILL at every step: after the admission of
// each message, inside and after each question's provider call, after each transcript write and
// after each message was marked done. A restarted process on the same file, with the channel
// redelivering every message, finishes the form with each question asked exactly once.
import { afterAll, describe, expect, test } from "bun:test";
import { mkdirSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { childLines } from "./support/child_lines.ts";

const dir = join(tmpdir(), `botmesh-conv-kill-${crypto.randomUUID()}`);
mkdirSync(dir, { recursive: true });
afterAll(() => rmSync(dir, { recursive: true, force: true }));

const MESSAGES = [["m0", "form"], ["m1", "Ann"], ["m2", "33"], ["m3", "Paris"]] as const;
const EXPECTED = new Map([
  ["m0:1", "Name?"],
  ["m1:1", "Age, Ann?"],
  ["m2:1", "City?"],
  ["m3:1", "Done: Ann, 33, Paris"],
]);
const KILL_POINTS = [
  ...MESSAGES.flatMap(([id]) => [`admit:${id}`, `send:${id}:1`, `marked:${id}:1`, `done:${id}`]),
  "saved:1",
  "saved:2",
  "saved:3",
  "saved:4",
];

function spawnBot(db: string, killAt: string) {
  const child = Bun.spawn([process.execPath, "tests/fixtures/form_bot.ts", db, killAt], {
    stdin: "pipe",
    stdout: "pipe",
    stderr: "pipe",
  });
  const lines = childLines(child.stdout, `form bot (${killAt})`, 10_000);
  const send = (command: object) => {
    child.stdin.write(JSON.stringify(command) + "\n");
    child.stdin.flush();
  };
  return { child, lines, send };
}

describe("a 3-step form on SQLite survives SIGKILL at every step", () => {
  for (const killAt of KILL_POINTS) {
    test(`killed at ${killAt}`, async () => {
      const db = join(dir, `${killAt.replaceAll(":", "_")}.db`);
      // First process: the user answers each question once it arrives; the process kills itself at the point.
      const first = spawnBot(db, killAt);
      await first.lines.next("ready");
      const exited = first.child.exited;
      let dead = false;
      exited.then(() => (dead = true));
      for (const [id, text] of MESSAGES) {
        if (dead) break;
        try {
          first.send({ op: "msg", id, chatId: "u1", text });
        } catch {
          break; // EPIPE: it died in the meantime
        }
        const question = `sent ${id}:1 `;
        await Promise.race([first.lines.next(question).catch(() => {}), exited]);
      }
      await exited;
      await first.lines.ended;
      expect(first.child.signalCode, `the first process died at ${killAt}`).toBe("SIGKILL");

      // Second process on the same file; the channel redelivers everything.
      const second = spawnBot(db, "none");
      await second.lines.next("ready");
      for (const [id, text] of MESSAGES) {
        second.send({ op: "msg", id, chatId: "u1", text });
        await second.lines.next(`ack ${id} `);
      }
      second.send({ op: "settle" });
      await second.lines.next("settled");
      second.send({ op: "stop" });
      expect(await second.child.exited).toBe(0);
      await second.lines.ended;

      const sent = [...first.lines.all(), ...second.lines.all()].filter((l) => l.startsWith("sent "));
      const counts = new Map<string, number>();
      for (const line of sent) {
        const [, key, ...rest] = line.split(" ");
        expect(JSON.parse(rest.join(" ")), `content of ${key}`).toBe(EXPECTED.get(key!));
        counts.set(key!, (counts.get(key!) ?? 0) + 1);
      }
      expect(Object.fromEntries(counts), "each question asked once, and the form finished").toEqual({
        "m0:1": 1,
        "m1:1": 1,
        "m2:1": 1,
        "m3:1": 1,
      });
      // A kill inside the provider call leaves that send unknown, reported by the restarted process.
      const ambiguous = second.lines.all().filter((l) => l.startsWith("ambiguous "));
      expect(ambiguous).toEqual(killAt.startsWith("send:") ? [`ambiguous ${killAt.slice(5)}`] : []);
    }, 30_000);
  }
});
