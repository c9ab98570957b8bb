// Chat order when this process loses the lease of a record it had queued: the later records of the chat
// it holds must not run before it. Here a server clock step makes an earlier record's lease look lapsed
// and another replica takes it; the later record, still leased here, waits until the other replica is
// done and then runs (taken up by a sweep in its chat's order).
import { expect, test } from "bun:test";
import { ANY, Bot, MemoryDurability } from "../mod.ts";
import { MockProvider, TestClock } from "../testing.ts";

test("a record whose earlier record of the chat was taken by another replica is not run before it", async () => {
  const clock = new TestClock({ start: 1_700_000_000_000 });
  let serverAhead = 0;
  const backend = new MemoryDurability({ clock: () => clock.now() + serverAhead });
  const provider = new MockProvider();
  const bot = new Bot({
    provider,
    clock,
    durability: { backend, instanceId: "a", sweepIntervalMs: 50, inbox: { leaseMs: 1_000 }, outbox: { leaseMs: 1_000 } },
  });
  bot.on("warning", () => {});
  let unblock!: () => void;
  const blocked = new Promise<void>((resolve) => (unblock = resolve));
  const ran: string[] = [];
  bot.when(ANY, async (ctx) => {
    ran.push(ctx.message.id);
    if (ctx.message.id === "block") await blocked;
  });
  await bot.start();
  try {
    await provider.receive({ id: "block", chatId: "c", text: "x" });
    await provider.receive({ id: "early", chatId: "c", text: "x" });
    await provider.receive({ id: "late", chatId: "c", text: "x" });
    expect((await backend.inbox.get("late"))?.state, "admitted leased behind this process's own leases").toBe("processing");
    // The server's clock jumps: every lease looks lapsed to it, and another replica takes the earlier record.
    serverAhead = 5_000;
    const other = { owner: "b", incarnation: "b1", leaseMs: 60_000 };
    const taken = await backend.inbox.claim("early", other);
    expect(taken?.lease?.owner).toBe("b");
    await clock.sleep(400); // a heartbeat round: "early" is lost here, the others renewed
    unblock();
    for (let i = 0; i < 10; i++) await clock.sleep(100);
    expect(ran, "the later record waits for the earlier one, held elsewhere").toEqual(["block"]);
    expect((await backend.inbox.get("early"))?.state).toBe("processing");
    // The other replica finishes the earlier record; the later one runs here once its lease lapsed.
    await backend.inbox.complete("early", taken!.fence);
    for (let i = 0; i < 30 && !ran.includes("late"); i++) await clock.sleep(100);
    expect(ran).toEqual(["block", "late"]);
    for (let i = 0; i < 10 && (await backend.inbox.get("late"))?.state !== "done"; i++) await clock.sleep(100);
    expect((await backend.inbox.get("late"))?.state).toBe("done");
  } finally {
    await bot.stop();
    clock.stop();
  }
});
