// The crash demo (examples/demo/main.ts) as a subprocess, on both backends, at a small size:
// it must exit 0 and its JSON summary must show every message handled and nothing lost or
// sent twice without a report. Also the demo's file channel: acknowledgement after admission,
// restart from the offset, torn lines.
import { afterAll, describe, expect, test } from "bun:test";
import { spawn } from "node:child_process";
import { appendFileSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { AdmitResult } from "../provider.ts";
import type { InboundMessage } from "../mod.ts";

const MAIN = join(import.meta.dir, "..", "examples", "demo", "main.ts");
const dirs: string[] = [];
afterAll(() => {
  for (const dir of dirs) rmSync(dir, { recursive: true, force: true });
});

function run(args: string[]): Promise<{ code: number | null; stdout: string; stderr: string }> {
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, [MAIN, ...args], { stdio: ["ignore", "pipe", "pipe"] });
    let stdout = "";
    let stderr = "";
    child.stdout.on("data", (chunk) => stdout += chunk);
    child.stderr.on("data", (chunk) => stderr += chunk);
    child.on("error", reject);
    child.on("exit", (code) => resolve({ code, stdout, stderr }));
  });
}

describe("npm run demo", () => {
  for (const backend of ["sqlite", "file"]) {
    test(`${backend}: messages survive SIGKILLs, replies go out once or are reported`, async () => {
      const data = mkdtempSync(join(tmpdir(), `botmesh-demo-test-${backend}-`));
      dirs.push(data);
      const messages = 80;
      const { code, stdout, stderr } = await run([
        "--backend", backend,
        "--messages", String(messages),
        "--chats", "10",
        "--kills", "3",
        "--stream-ms", "3000",
        "--seed", "42",
        "--data", data,
        "--json",
      ]);
      const lines = stdout.trim().split("\n");
      const summary = JSON.parse(lines[lines.length - 1]!);
      if (code !== 0) console.error(stdout, stderr);
      expect(code).toBe(0);
      expect(summary).toMatchObject({
        ok: true,
        backend,
        seed: 42,
        messages,
        handled: messages,
        lost: 0,
        silentDuplicates: 0,
        unexpected: 0,
        inboundDead: 0,
        outboxDead: 0,
        crashes: 3,
        runs: 4,
      });
      // Every expected reply is at the channel, or reported ambiguous and held back.
      expect(summary.repliesDelivered + summary.ambiguous - summary.ambiguousDelivered).toBe(summary.repliesExpected);
      // With the default onAmbiguous: 'hold' nothing is sent twice at all.
      expect(summary.duplicates).toBe(0);
      expect(summary.channelLines).toBe(summary.repliesDelivered);
      expect(summary.ms).toBeLessThan(15_000);
      expect(stdout).toContain("PASS");
    }, 30_000);
  }

  test("--confirm: the channel settles every ambiguous send; none is left for an operator, none sent twice", async () => {
    const data = mkdtempSync(join(tmpdir(), "botmesh-demo-test-confirm-"));
    dirs.push(data);
    const messages = 80;
    const { code, stdout, stderr } = await run([
      "--backend", "sqlite",
      "--messages", String(messages),
      "--chats", "10",
      "--kills", "3",
      "--stream-ms", "3000",
      "--seed", "43",
      "--data", data,
      "--confirm",
      "--json",
    ]);
    const lines = stdout.trim().split("\n");
    const summary = JSON.parse(lines[lines.length - 1]!);
    if (code !== 0) console.error(stdout, stderr);
    expect(code).toBe(0);
    expect(summary).toMatchObject({ ok: true, handled: messages, lost: 0, duplicates: 0, leftForOperator: 0, crashes: 3 });
    // Every reply reached the channel exactly once: the ambiguous ones were found there, or sent again.
    expect(summary.repliesDelivered).toBe(summary.repliesExpected);
    expect(summary.channelLines).toBe(summary.repliesExpected);
    expect(summary.resolved).toBe(summary.metrics.outboxAmbiguous ?? 0);
  }, 30_000);

  test("bad flags are refused with a usage line", async () => {
    const { code, stderr } = await run(["--backend", "postgres"]);
    expect(code).toBe(2);
    expect(stderr).toContain("--backend must be sqlite or file");
    expect(stderr).toContain("usage:");
  });
});

describe("the demo's file channel (examples/file_channel.ts)", () => {
  const until = async (check: () => boolean, ms = 5_000) => {
    const start = performance.now();
    while (!check()) {
      if (performance.now() - start > ms) throw new Error("timed out");
      await new Promise((resolve) => setTimeout(resolve, 5));
    }
  };
  const line = (id: string, chatId = "c1") => JSON.stringify({ id, chatId, text: `text ${id}` }) + "\n";

  test("acknowledges only what the bot took; a refused message is read again; a restart goes on from the offset", async () => {
    const { FileChannel } = await import("../examples/file_channel.ts");
    const dir = mkdtempSync(join(tmpdir(), "botmesh-channel-"));
    dirs.push(dir);
    const inbound = join(dir, "in.jsonl");
    const files = { inbound, outbound: join(dir, "out.jsonl"), offsetFile: join(dir, "in.offset"), pollMs: 5 };
    writeFileSync(inbound, line("m1") + line("m2") + "not json\n" + JSON.stringify({ text: "no id" }) + "\n" + line("m3"));
    const seen: string[] = [];
    let refuse = new Set(["m3"]);
    const sink = {
      receive: async (m: InboundMessage): Promise<AdmitResult> => {
        seen.push(m.id);
        if (refuse.has(m.id)) return { status: "rejected", id: m.id, error: new Error("journal down") };
        return { status: "admitted", id: m.id };
      },
    };
    const skipped: string[] = [];
    const first = new FileChannel({ ...files, onSkip: (reason) => skipped.push(reason) });
    await first.start(sink);
    await until(() => seen.filter((id) => id === "m3").length >= 2); // refused, and tried again
    expect(first.stats).toMatchObject({ admitted: 2, skipped: 2 });
    expect(first.stats.rejected).toBeGreaterThanOrEqual(2);
    // Acknowledged up to m3 (the two invalid lines included), not past it.
    const upToM3 = readFileSync(inbound, "utf8").indexOf(line("m3"));
    expect(first.stats.ackedOffset).toBe(upToM3);
    await first.stop();
    expect(JSON.parse(readFileSync(files.offsetFile, "utf8")).offset).toBe(upToM3);

    // A restart starts at the offset: m3 comes again (and is taken now), m1 and m2 do not;
    // a half-written line is left until it is complete.
    refuse = new Set();
    seen.length = 0;
    appendFileSync(inbound, line("m4") + '{"id":"m5","chatId":"c1"');
    const second = new FileChannel(files);
    await second.start(sink);
    await until(() => seen.includes("m4"));
    await new Promise((resolve) => setTimeout(resolve, 30));
    expect(seen).toEqual(["m3", "m4"]);
    appendFileSync(inbound, ',"text":"done"}\n');
    await until(() => seen.includes("m5"));
    await second.stop();
    expect(second.stats.ackedOffset).toBe(readFileSync(inbound).length);
  });

  test("sends are one JSON line each; a torn last line is skipped by readers and ended by the next writer", async () => {
    const { FileChannel, readJsonLines } = await import("../examples/file_channel.ts");
    const dir = mkdtempSync(join(tmpdir(), "botmesh-channel-"));
    dirs.push(dir);
    const outbound = join(dir, "out.jsonl");
    writeFileSync(outbound, JSON.stringify({ key: "k0", chatId: "c", content: "x", messageId: "1", attempt: 1, at: 0 }) + '\n{"key":"k-torn","cha');
    expect(await readJsonLines(outbound)).toMatchObject({ lines: [{ key: "k0" }], skipped: 1 });
    const channel = new FileChannel({ inbound: join(dir, "in.jsonl"), outbound, tag: "t1" });
    const signal = new AbortController().signal;
    const receipts = await Promise.all(
      Array.from({ length: 20 }, (_, i) => channel.send("c", { text: `hi ${i}`, bytes: new Uint8Array([1, 2]) }, { idempotencyKey: `k${i + 1}`, attempt: 1, signal })),
    );
    await channel.close();
    const { lines, skipped } = await readJsonLines<{ key: string; by: string; content: { bytes: unknown }; messageId: string }>(outbound);
    expect(skipped).toBe(1); // the torn line, ended by the writer, is not JSON
    expect(lines.map((l) => l.key).sort()).toEqual(["k0", ...Array.from({ length: 20 }, (_, i) => `k${i + 1}`)].sort());
    expect(lines[1]).toMatchObject({ by: "t1", content: { bytes: { $base64: "AQI=" } } });
    expect(new Set(receipts.map((r) => r.messageId)).size).toBe(20);
    expect(lines.slice(1).map((l) => l.messageId).sort()).toEqual(receipts.map((r) => r.messageId).sort());
  });
});
