// EventsDurability with a kv outbox: the kv answers a repeat itself, with what it had confirmed when
// its scan failed.
import { expect, test } from "bun:test";
import { EventsDurability, MemoryEventJournal } from "../backends/events/mod.ts";
import { KvDurability } from "../backends/kv/durability.ts";
import { MemoryKv } from "../backends/memory/kv.ts";
import type { DurabilityBackend } from "../src/contract.ts";

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

function failingKv(): { kv: MemoryKv; arm(): void } {
  const mem = new MemoryKv();
  let armed = false;
  let unknowns = 0;
  const kv = new Proxy(mem, {
    get(target, prop, receiver) {
      if (prop === "set") {
        return async (key: string, value: unknown, expect?: string | null) => {
          const rec = (value as { rec?: { state?: string } } | null)?.rec;
          // The second ambiguity transition's CAS is refused (nothing written): the scan fails after the first.
          if (armed && rec?.state === "unknown" && ++unknowns === 2) throw new Error("connect ECONNREFUSED");
          return await target.set(key, value as never, expect);
        };
      }
      const v = Reflect.get(target, prop, receiver);
      return typeof v === "function" ? v.bind(target) : v;
    },
  });
  return { kv: kv as MemoryKv, arm: () => void (armed = true) };
}

for (const name of ["kv", "events + kv outbox"] as const) {
  test(`${name}: the repeat of a partial outbox scan answers the ambiguity it confirmed`, async () => {
    const { kv, arm } = failingKv();
    const backend: DurabilityBackend = name === "kv" ? new KvDurability(kv) : new EventsDurability({ journal: new MemoryEventJournal(), outbox: kv });
    const gone = { owner: "gone", incarnation: "x", leaseMs: 30 };
    for (const key of ["k1", "k2"]) {
      const r = await backend.outbox.reserve({ key, chatId: `c-${key}`, content: { text: "hi" }, contentHash: "h", inboundId: null }, gone);
      expect(await backend.outbox.markCalling(key, r.entry.fence, 30)).toBe(true);
    }
    await sleep(60);
    arm();
    const options = { owner: "me", incarnation: "i", leaseMs: 1000, limit: 10, requestId: "s1" };
    const error = await backend.outbox.claimDue(options).then(() => null, (e) => (e as Error).message);
    const repeat = await backend.outbox.claimDue({ ...options, repeat: true });
    const states = await Promise.all(["k1", "k2"].map(async (k) => (await backend.outbox.get(k))?.state));
    expect(error).not.toBeNull();
    expect(repeat.ambiguous.map((e) => e.key)).toEqual(states[0] === "unknown" ? ["k1"] : ["k2"]);
  });
}
