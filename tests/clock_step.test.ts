// A wall-clock step (NTP, a VM resumed) on the process whose backend shares its clock: the engine must
// renew its own leases before a sweep can take them for abandoned (memory and kv backends take a clock).
import { describe, expect, test } from "bun:test";
import { Bot, type Clock, MemoryDurability, systemClock } from "../mod.ts";
import { KvDurability } from "../backends/kv/durability.ts";
import { MemoryKv } from "../backends/memory/kv.ts";
import { MockProvider } from "../testing.ts";
import type { OutboundContent, SendContext, SendReceipt } from "../src/provider.ts";

class SlowProvider extends MockProvider {
  constructor(readonly delayMs: number, readonly onStart: () => void) {
    super();
  }
  override async send(chatId: string, content: OutboundContent, context: SendContext): Promise<SendReceipt> {
    this.onStart();
    await new Promise((resolve) => setTimeout(resolve, this.delayMs));
    return super.send(chatId, content, context);
  }
}

const backends = {
  memory: (now: () => number) => new MemoryDurability({ clock: now }),
  "kv on memory": (now: () => number) => new KvDurability(new MemoryKv({ clock: now })),
};

describe("a wall-clock step forward during a send", () => {
  for (const [name, create] of Object.entries(backends)) {
    for (const policy of ["hold", "resend"] as const) {
      test(`${name}, onAmbiguous '${policy}': the process keeps its own send, it goes out once and is sent`, async () => {
        let offset = 0;
        const clock: Clock = { ...systemClock, now: () => Date.now() + offset };
        const backend = create(clock.now);
        const provider = new SlowProvider(400, () => setTimeout(() => offset += 120_000, 100));
        const bot = new Bot({
          provider,
          clock,
          durability: {
            backend,
            instanceId: "one",
            sweepIntervalMs: 20, // sweeps run well before the next heartbeat (every 100 ms)
            inbox: { leaseMs: 300 },
            outbox: { leaseMs: 300, onAmbiguous: policy },
          },
        });
        const ambiguous: unknown[] = [];
        bot.on("durability:ambiguous", (event) => ambiguous.push(event));
        bot.on("error", () => {});
        await bot.start();
        try {
          const result = await bot.send("c", "slow upload", { idempotencyKey: "k" });
          await bot.idle();
          expect(result.state).toBe("sent");
          expect(provider.calls.map((c) => c.idempotencyKey)).toEqual(["k"]);
          expect((await backend.outbox.get("k"))?.state).toBe("sent");
          expect(ambiguous).toEqual([]);
          expect(bot.durability!.metrics().staleLeases).toBe(0);
        } finally {
          await bot.stop();
        }
      });
    }
  }
});
