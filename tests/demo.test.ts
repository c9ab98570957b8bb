// The crash demo (examples/demo/main.ts) as a subprocess, on both backends, at a small size:
// it must exit 0 and its JSON summary must show every message handled and nothing lost or
// sent twice without a report.
import { afterAll, describe, expect, test } from "bun:test";
import { spawn } from "node:child_process";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

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

  test("bad flags are refused with a usage line", async () => {
    const { code, stderr } = await run(["--backend", "postgres"]);
    expect(code).toBe(2);
    expect(stderr).toContain("--backend must be sqlite or file");
    expect(stderr).toContain("usage:");
  });
});
