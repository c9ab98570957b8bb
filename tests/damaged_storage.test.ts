// The engine's rule for a backend whose storage is damaged (a DamagedStorageError, whoever throws it):
// reported once; from then on no admission (the channel delivers the message again, failOpen or not),
// no outcome recorded (nothing dead-lettered for it), no work taken up; idle() rejects with it.
// Backend-agnostic: a MemoryDurability whose operations are made to throw the damage.
import { describe, expect, test } from "bun:test";
import { MemoryDurability } from "../backends/memory/durability.ts";
import { DamagedStorageError } from "../backend.ts";
import { Bot } from "../mod.ts";
import { MockProvider } from "../testing.ts";

const damage = () =>
  new DamagedStorageError('Test storage "t.db" is damaged', { backend: "memory", location: "t.db", cause: new Error("malformed") });

/** Poll `check` until it holds; fail naming `what` after `ms`. */
async function waitFor(what: string, check: () => boolean, ms = 10_000): Promise<void> {
  const start = performance.now();
  while (!check()) {
    if (performance.now() - start > ms) throw new Error(`timed out waiting for ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 5));
  }
}

function setup(options: { failOpen?: boolean } = {}) {
  const backend = new MemoryDurability();
  const mock = new MockProvider();
  const bot = new Bot({
    provider: mock,
    durability: { backend, instanceId: "t", inbox: { retries: 0 }, sweepIntervalMs: 20, ...options },
  });
  const errors: Error[] = [];
  bot.on("error", (error) => errors.push(error));
  const dead: string[] = [];
  bot.on("durability:dead", ({ id }) => dead.push(id));
  return { backend, mock, bot, errors, dead };
}

describe("damaged storage", () => {
  test("a completion that meets it: the record is not dead-lettered; admissions are refused; reported once", async () => {
    const { backend, mock, bot, errors, dead } = setup();
    bot.when(/.*/, (ctx) => ctx.reply("ok"));
    await bot.start();
    const complete = backend.inbox.complete.bind(backend.inbox);
    let broken = false;
    backend.inbox.complete = async (id, token) => {
      if (broken) throw damage();
      return await complete(id, token);
    };
    expect((await mock.receive({ id: "m0", chatId: "c", text: "a" })).status).toBe("admitted");
    await bot.idle();
    broken = true;
    expect((await mock.receive({ id: "m1", chatId: "c", text: "b" })).status).toBe("admitted");
    await waitFor("the damage to be reported", () => errors.length > 0);
    expect(errors[0]).toBeInstanceOf(DamagedStorageError);
    const refused = await mock.receive({ id: "m2", chatId: "c", text: "c" });
    expect(refused.status).toBe("rejected");
    expect((refused as { error: Error }).error).toBeInstanceOf(DamagedStorageError);
    expect(await bot.idle().then(() => null, (e: unknown) => e)).toBeInstanceOf(DamagedStorageError);
    expect(await bot.sweep().then(() => null, (e: unknown) => e)).toBeInstanceOf(DamagedStorageError);
    await bot.stop();
    expect(errors.length).toBe(1);
    expect(dead).toEqual([]);
    expect((await backend.inbox.get("m1"))?.state).toBe("processing");
    expect(await backend.inbox.get("m2")).toBeNull();
  });

  test("a handler whose error is caused by it records no outcome; later messages are refused", async () => {
    const { backend, mock, bot, errors, dead } = setup();
    let runs = 0;
    bot.when(/.*/, () => {
      runs++;
      throw new Error("session read failed", { cause: damage() });
    });
    await bot.start();
    expect((await mock.receive({ id: "m1", chatId: "c", text: "a" })).status).toBe("admitted");
    await waitFor("the damage to be reported", () => errors.length > 0);
    expect(errors.map((e) => e.name)).toEqual(["DamagedStorageError"]);
    expect((await mock.receive({ id: "m2", chatId: "c", text: "b" })).status).toBe("rejected");
    await bot.stop();
    expect(runs).toBe(1);
    expect(dead).toEqual([]);
    expect((await backend.inbox.get("m1"))?.state).toBe("processing");
    expect((await backend.inbox.get("m1"))?.error).toBeNull();
  });

  test("an admission that meets it is refused even with failOpen, and is reported once", async () => {
    const { backend, mock, bot, errors } = setup({ failOpen: true });
    let handled = 0;
    bot.when(/.*/, () => void handled++);
    await bot.start();
    backend.inbox.admit = () => Promise.reject(damage());
    for (const id of ["m1", "m2", "m3"]) {
      const answer = await mock.receive({ id, chatId: "c", text: id });
      expect(answer.status).toBe("rejected");
      expect((answer as { error: Error }).error).toBeInstanceOf(DamagedStorageError);
    }
    await bot.stop();
    expect(handled).toBe(0);
    expect(errors.length).toBe(1);
  });

  test("met by the recovery sweep, start() rejects with it (not also an error event)", async () => {
    const { backend, bot, errors } = setup();
    backend.inbox.claimDue = () => Promise.reject(damage());
    expect(await bot.start().then(() => null, (e: unknown) => e)).toBeInstanceOf(DamagedStorageError);
    expect(errors).toEqual([]);
  });
});
