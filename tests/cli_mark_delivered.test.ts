// botmesh-durable mark-delivered: an unknown send recorded as sent (with the provider's message id, if given)
// without a new call, under the entry's own fence; refused, naming the key and its state, for any other entry.
// As a process on SQLite and Postgres; in process for a retry that comes between the read and the write.
import { afterAll, describe, expect, test } from "bun:test";
import { mkdirSync, rmSync } from "node:fs";
import { join } from "node:path";
import postgres from "postgres";
import { MemoryDurability } from "../mod.ts";
import type { DurabilityBackend } from "../src/contract.ts";
import { SQLiteDurability } from "../backends/sqlite/durability.ts";
import { PostgresDurability } from "../backends/postgres/mod.ts";
import { runCli } from "../src/ops/cli.ts";
import { usageLine } from "../src/ops/cli_command.ts";
import { markDeliveredCommand } from "../src/ops/cli_commands.ts";
import { OWNER } from "./support/cli_fill.ts";
import { POSTGRES_URL, runId, serviceSkip } from "./support/services.ts";
import { type CliRun, runCliProcess } from "./support/cli_process.ts";

const root = join(import.meta.dir, "..");
const tmp = join(root, ".tmp", `cli-delivered-${runId()}`);
mkdirSync(tmp, { recursive: true });
afterAll(() => rmSync(tmp, { recursive: true, force: true }));

const cli = (args: string[]): Promise<CliRun> => runCliProcess(tmp, args);

/** Two unknown sends (`maybe-1`, `maybe-2`: the call may have arrived) and a dead one (`dead-1`). */
async function fillSends(backend: DurabilityBackend): Promise<void> {
  await backend.open?.();
  const reserve = (key: string) =>
    backend.outbox.reserve({ key, chatId: "c9", content: { text: key }, contentHash: key, inboundId: null }, OWNER);
  for (const key of ["maybe-1", "maybe-2"]) {
    const r = await reserve(key);
    await backend.outbox.markFailed(key, r.entry.lease!.token, { error: "ProviderError: timed out", ambiguous: true });
  }
  const dead = await reserve("dead-1");
  await backend.outbox.markFailed("dead-1", dead.entry.lease!.token, { error: "Invalid recipient", dead: true });
  await backend.close?.();
}

async function scenario(url: string, check: (key: string) => Promise<{ state: string; messageId: string | null; error: string | null }>) {
  const b = ["-b", url];
  let r = await cli([...b, "mark-delivered", "maybe-1", "--message-id", "wamid.42"]);
  expect(r).toEqual({
    code: 0,
    stdout: 'Outbox entry "maybe-1" is marked as delivered (sent, message id "wamid.42"): it is not sent again.\n',
    stderr: "",
  });
  // sent, with the id; the error of the lost call stays, as before it was sent
  expect(await check("maybe-1")).toEqual({ state: "sent", messageId: "wamid.42", error: "ProviderError: timed out" });

  r = await cli([...b, "mark-delivered", "maybe-2", "--json"]);
  expect([r.code, r.stderr]).toEqual([0, ""]);
  expect(JSON.parse(r.stdout)).toEqual({ command: "mark-delivered", key: "maybe-2", ok: true, state: "sent", messageId: "", error: null });
  expect((await check("maybe-2")).messageId).toBe("");

  // Any other state: exit 1 naming the key and its state, nothing changed.
  r = await cli([...b, "mark-delivered", "dead-1"]);
  expect([r.code, r.stdout]).toEqual([1, ""]);
  expect(r.stderr).toBe('botmesh-durable: Outbox entry "dead-1" is dead: only "unknown" entries can be marked as delivered\n');
  expect((await check("dead-1")).state).toBe("dead");
  r = await cli([...b, "mark-delivered", "maybe-1", "--message-id", "other", "--json"]);
  expect(r.code).toBe(1);
  expect(JSON.parse(r.stdout)).toEqual({
    command: "mark-delivered",
    key: "maybe-1",
    ok: false,
    state: "sent",
    messageId: "other",
    error: 'Outbox entry "maybe-1" is sent: only "unknown" entries can be marked as delivered',
  });
  expect((await check("maybe-1")).messageId).toBe("wamid.42");
  r = await cli([...b, "mark-delivered", "ghost"]);
  expect([r.code, r.stderr]).toEqual([1, 'botmesh-durable: Outbox entry "ghost" not found\n']);
}

test("SQLite: marks unknown sends delivered, with or without a message id; refuses other states and missing keys", async () => {
  const file = join(tmp, "sends.db");
  await fillSends(new SQLiteDurability({ file }));
  const backend = new SQLiteDurability({ file });
  await backend.open();
  try {
    await scenario(`sqlite:${file}`, async (key) => {
      const e = (await backend.outbox.get(key))!;
      return { state: e.state, messageId: e.messageId, error: e.error };
    });
  } finally {
    await backend.close();
  }
}, 60_000);

describe("Postgres", async () => {
  const skip = await serviceSkip("postgres");
  test.skipIf(skip !== false)("the same on a Postgres schema", async () => {
    const schema = `cli_delivered_${runId()}`;
    const sql = postgres(POSTGRES_URL, { max: 2, onnotice: () => {} });
    try {
      const backend = new PostgresDurability({ sql, schema });
      await fillSends(backend);
      const u = new URL(POSTGRES_URL);
      u.searchParams.set("schema", schema);
      await scenario(u.toString(), async (key) => {
        const e = (await backend.outbox.get(key))!;
        return { state: e.state, messageId: e.messageId, error: e.error };
      });
    } finally {
      await sql.unsafe(`drop schema if exists ${schema} cascade`);
      await sql.end();
    }
  }, 60_000);
});

describe("in process", () => {
  async function run(argv: string[], backend: DurabilityBackend): Promise<CliRun> {
    let stdout = "";
    let stderr = "";
    const code = await runCli(argv, { stdout: (t) => void (stdout += t), stderr: (t) => void (stderr += t) }, {
      open: () => Promise.resolve({ backend, description: "memory", close: () => Promise.resolve() }),
    });
    return { code, stdout, stderr };
  }

  test("an entry retried after it was read as unknown is left queued: the write under its old fence is refused", async () => {
    const memory = new MemoryDurability();
    await fillSends(memory);
    let retried = false;
    // Another operator retries the entry just after this command read it.
    const get = async (key: string) => {
      const entry = await memory.outbox.get(key);
      if (!retried) retried = await memory.outbox.retry(key);
      return entry;
    };
    const bound = <T extends object>(target: T, replace: Record<string, unknown>): T =>
      new Proxy(target, {
        get(t, name) {
          if (typeof name === "string" && name in replace) return replace[name];
          const value = Reflect.get(t, name);
          return typeof value === "function" ? value.bind(t) : value;
        },
      });
    const racing = bound(memory, { outbox: bound(memory.outbox, { get }) });
    const r = await run(["-b", "m", "mark-delivered", "maybe-1", "--message-id", "wamid.1"], racing);
    expect(retried).toBe(true);
    expect([r.code, r.stdout]).toEqual([1, ""]);
    expect(r.stderr).toBe('botmesh-durable: Outbox entry "maybe-1" is queued: only "unknown" entries can be marked as delivered\n');
    const entry = await memory.outbox.get("maybe-1");
    expect([entry?.state, entry?.messageId]).toEqual(["queued", null]);
  });

  test("--message-id: trimmed, at most 512 characters (a longer one is a usage error, nothing opened)", async () => {
    const memory = new MemoryDurability();
    await fillSends(memory);
    let r = await run(["-b", "m", "mark-delivered", "maybe-1", "--message-id", "  4711 "], memory);
    expect(r.code).toBe(0);
    expect((await memory.outbox.get("maybe-1"))?.messageId).toBe("4711");
    r = await run(["-b", "m", "mark-delivered", "maybe-2", "--message-id", "x".repeat(513)], memory);
    expect([r.code, r.stdout]).toEqual([2, ""]);
    expect(r.stderr).toBe(
      `botmesh-durable: Flag "--message-id" is too long: 513 characters, at most 512\nUsage: ${usageLine(markDeliveredCommand)}\n` +
        `Run "botmesh-durable mark-delivered --help" for more.\n`,
    );
    expect((await memory.outbox.get("maybe-2"))?.state).toBe("unknown");
  });
});
