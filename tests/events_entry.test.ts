import { afterAll, describe, expect, test } from "bun:test";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Bot } from "../mod.ts";
import { EventsDurability, EventWorker, FileEventJournal, MemoryEventJournal } from "../backends/events/mod.ts";
import { MockProvider } from "../testing.ts";

const dir = mkdtempSync(join(tmpdir(), "botmesh-events-entry-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

describe("@botmesh/durable/events", () => {
  test("the page's example: a bot on a locked FileEventJournal next to the app's events and an EventWorker", async () => {
    const journal = await FileEventJournal.open(join(dir, "events.json"), { lock: true });
    const provider = new MockProvider();
    const bot = new Bot({ provider, durability: { backend: new EventsDurability({ journal }), instanceId: "bot-1", sweepIntervalMs: 20 } });
    bot.when(/hi/, (ctx) => ctx.reply("hello"));
    const handled: string[] = [];
    const worker = new EventWorker({ journal, instanceId: "worker-1", handler: (e) => void handled.push(e.id), pollIntervalMs: 10 });
    await journal.append({ id: "order-1", eventType: "order.created", payload: { total: 12 } });
    await bot.start();
    await worker.start();
    await provider.receive({ id: "m1", chatId: "c1", text: "hi" });
    await bot.idle();
    await worker.idle();
    expect(provider.sent.map((s) => s.content)).toEqual(["hello"]);
    expect(handled, "the worker took the app's event, never the bot's").toEqual(["order-1"]);
    const all = await journal.list();
    expect(all.map((e) => [e.id, e.channel, e.eventType, e.state])).toEqual([
      ["order-1", null, "order.created", "done"],
      ["m1", "botwa:durable", "botwa.inbound.message", "done"],
    ]);
    // A replay through the journal is picked up by the bot's sweep.
    expect(await journal.replay("m1")).toBe(true);
    const deadline = Date.now() + 5000;
    while ((await journal.get("m1"))?.state !== "done" && Date.now() < deadline) await Bun.sleep(10);
    await bot.idle();
    expect((await journal.get("m1"))?.state).toBe("done");
    expect((await journal.get("m1"))?.attempts, "processed again after the replay").toBe(1);
    expect(provider.sent.length, "its reply is answered from the outbox, not sent again").toBe(1);
    expect(bot.durability!.metrics().outboxDeduped).toBe(1);
    await worker.stop();
    await bot.stop();
    await journal.close();
  });

  test("EventsDurability refuses a FileEventJournal opened without a lock", async () => {
    const journal = await FileEventJournal.open(join(dir, "unlocked.json"), { lock: false });
    expect(() => new EventsDurability({ journal })).toThrow(/lock: true/);
    await journal.close();
    expect(() => new EventsDurability({ journal: new MemoryEventJournal() })).not.toThrow();
  });
});
