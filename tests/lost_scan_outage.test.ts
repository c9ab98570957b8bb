// An outbox scan that made an announced send ambiguous loses its reply, and the journal stays
// unreachable for two minutes (or the backend's clock steps forward meanwhile): the scan is asked again
// once it answers, and the send is reported, once.
import { expect, test } from "bun:test";
import { ANY, Bot, type Clock, MemoryDurability, systemClock } from "../mod.ts";
import { MockProvider } from "../testing.ts";
import type { ClaimDueOptions, DurabilityBackend, OutboxJournal } from "../src/contract.ts";
import { proxied, until } from "./support/lossy.ts";

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

for (const variant of ["an outage of two minutes", "the backend clock stepping forward 130 s"] as const) {
  test(`an ambiguous send of a lost scan is reported after ${variant}`, async () => {
    let engineOffset = 0; // both clocks of the process (time passing during an outage)
    let serverOffset = 0; // the backend's clock only
    const clock: Clock = { ...systemClock, now: () => Date.now() + engineOffset, monotonic: () => performance.now() + engineOffset };
    const inner = new MemoryDurability({ clock: () => Date.now() + engineOffset + serverOffset });
    const gone = { owner: "gone", incarnation: "x", leaseMs: 30 };
    const reserved = await inner.outbox.reserve({ key: "k", chatId: "c", content: { text: "hi" }, contentHash: "h", inboundId: null }, gone);
    expect(await inner.outbox.markCalling("k", reserved.entry.fence, 30)).toBe(true);
    await sleep(60);
    let lost = false;
    let outage = false;
    let failedRepeats = 0;
    const log: string[] = [];
    const outbox = proxied<OutboxJournal>(inner.outbox, {
      claimDue: async (o: ClaimDueOptions & { resendAmbiguous?: boolean }) => {
        if (o.repeat) {
          if (outage) {
            failedRepeats++;
            if (failedRepeats === 3) {
              if (variant === "an outage of two minutes") engineOffset += 121_000;
              else serverOffset += 130_000;
              outage = false;
            }
            throw new Error("connect ECONNREFUSED");
          }
          const r = await inner.outbox.claimDue(o);
          log.push(`repeat ${o.requestId} -> ambiguous [${r.ambiguous.map((e) => e.key)}]`);
          return r;
        }
        const r = await inner.outbox.claimDue(o);
        if (!lost && r.ambiguous.length > 0) {
          lost = true;
          outage = true;
          log.push(`scan ${o.requestId} -> ambiguous [${r.ambiguous.map((e) => `${e.key} ${e.state}`)}], reply lost`);
          throw new Error("read ECONNRESET (after the commit)");
        }
        return r;
      },
    });
    const backend: DurabilityBackend = { name: "lossy", scope: inner.scope, inbox: inner.inbox, outbox };
    const bot = new Bot({ provider: new MockProvider(), clock, durability: { backend, instanceId: "one", sweepIntervalMs: 20 } });
    bot.on("error", () => {});
    const ambiguous: string[] = [];
    bot.on("durability:ambiguous", (e) => ambiguous.push((e as { key: string }).key));
    bot.when(ANY, () => {});
    await bot.start().catch((e) => log.push(`start: ${(e as Error).message}`));
    await until(() => ambiguous.length > 0, `the ambiguous report (${log.join("; ")})`);
    await bot.sweep(); // one more sweep: a repeated answer must not report it again
    await bot.stop();
    expect(lost).toBe(true);
    expect(ambiguous).toEqual(["k"]);
  });
}
