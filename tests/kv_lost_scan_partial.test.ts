// The generic kv's outbox scan, one compare-and-set per entry: the CAS that makes an announced send
// `unknown` commits and its reply is lost. The scan reads the entry back, so its repeat answers the send
// and the bot reports it.
import { expect, test } from "bun:test";
import { ANY, Bot } from "../mod.ts";
import { KvDurability } from "../backends/kv/durability.ts";
import { MemoryKv } from "../backends/memory/kv.ts";
import { MockProvider } from "../testing.ts";
import { proxied, until } from "./support/lossy.ts";

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

test("kv: an ambiguity transition whose CAS reply was lost is reported", async () => {
  const mem = new MemoryKv();
  let armed = false;
  let lostOnce = false;
  const kv = proxied(mem, {
    set: async (key: string, value: unknown, expect?: string | null) => {
      const r = await mem.set(key, value as never, expect);
      const state = (value as { rec?: { state?: string } } | null)?.rec?.state;
      if (armed && !lostOnce && r !== null && state === "unknown") {
        lostOnce = true;
        throw new Error("read ECONNRESET (after the commit)");
      }
      return r;
    },
  });
  const backend = new KvDurability(kv as MemoryKv);
  const gone = { owner: "gone", incarnation: "x", leaseMs: 30 };
  const reserved = await backend.outbox.reserve({ key: "k", chatId: "c", content: { text: "hi" }, contentHash: "h", inboundId: null }, gone);
  expect(await backend.outbox.markCalling("k", reserved.entry.fence, 30)).toBe(true);
  await sleep(60);
  armed = true;
  const bot = new Bot({ provider: new MockProvider(), durability: { backend, instanceId: "one", sweepIntervalMs: 20 } });
  bot.on("error", () => {});
  const ambiguous: string[] = [];
  bot.on("durability:ambiguous", (e) => ambiguous.push((e as { key: string }).key));
  bot.when(ANY, () => {});
  await bot.start().catch(() => {});
  await until(() => ambiguous.length > 0, "the ambiguous report");
  await bot.sweep(); // one more sweep: a repeated answer must not report it again
  const state = (await backend.outbox.get("k"))?.state;
  await bot.stop();
  expect(lostOnce).toBe(true);
  expect(state).toBe("unknown");
  expect(ambiguous).toEqual(["k"]);
});
