// The generic kv's inbox scan: the compare-and-set that leases m1 to this process commits and its reply
// is lost. The scan reads m1 back, so its repeat answers m1, and m2 of the same chat runs after it.
import { expect, test } from "bun:test";
import { ANY, Bot } from "../mod.ts";
import { KvDurability } from "../backends/kv/durability.ts";
import { MemoryKv } from "../backends/memory/kv.ts";
import { MockProvider } from "../testing.ts";
import { proxied, until } from "./support/lossy.ts";


test("kv: chat order after an inbox claim CAS whose reply was lost", async () => {
  const mem = new MemoryKv();
  let armed = false;
  let lostOnce = false;
  const kv = proxied(mem, {
    set: async (key: string, value: unknown, expect?: string | null) => {
      const r = await mem.set(key, value as never, expect);
      const rec = (value as { rec?: { id?: string; state?: string } } | null)?.rec;
      if (armed && !lostOnce && r !== null && rec?.id === "m1" && rec.state === "processing") {
        lostOnce = true;
        throw new Error("read ECONNRESET (after the commit)");
      }
      return r;
    },
  });
  const backend = new KvDurability(kv as MemoryKv);
  const provider = new MockProvider();
  const bot = new Bot({
    provider,
    durability: { backend, instanceId: "one", sweepIntervalMs: 20, inbox: { leaseMs: 3_000 }, outbox: { leaseMs: 3_000 } },
  });
  bot.on("error", () => {});
  const starts: string[] = [];
  bot.when(ANY, (ctx) => {
    starts.push(ctx.message.id);
  });
  await bot.start();
  try {
    armed = true;
    await backend.inbox.admit({ id: "m1", kind: "message", chatId: "c", provider: "mock", payload: { id: "m1", chatId: "c", type: "text", text: "one" }, receivedAt: Date.now() - 1000 });
    await until(() => lostOnce, "the lost compare-and-set");
    await until(() => starts.includes("m1"), "m1 taken up from the repeat");
    const answer = await provider.receive({ id: "m2", chatId: "c", text: "two" });
    expect(answer.status).toBe("admitted");
    await until(() => starts.length === 2, "both handlers");
    expect(starts).toEqual(["m1", "m2"]);
  } finally {
    await bot.stop();
  }
});
