// prometheusMetrics: the text exposition of the counters, histograms and journal gauges, checked with a strict parser.
import { describe, expect, test } from "bun:test";
import { Bot, ProviderError } from "../mod.ts";
import { MemoryDurability } from "../mod.ts";
import { MockProvider } from "../testing.ts";
import { escapeLabelValue, prometheusMetrics } from "../src/ops/prometheus.ts";
import { histogram, parseExposition, value } from "./support/prometheus_parser.ts";
import { zeroMetrics } from "../src/engine.ts";

/** A bot that is never started: its `durability` reads zero counters and empty histograms. */
function bot0(): Bot {
  return new Bot({ provider: new MockProvider(), durability: { backend: new MemoryDurability(), instanceId: "docs" } });
}

const COUNTER_NAMES = [
  "inbound_journaled",
  "inbound_duplicates",
  "inbound_replayed",
  "inbound_dead",
  "outbox_journaled",
  "outbox_deduped",
  "outbox_retried",
  "outbox_deferred",
  "outbox_dead",
  "outbox_ambiguous",
  "outbox_resolved",
  "outbox_bypassed",
  "stale_leases",
  "outbox_diverged",
  "conversations_replayed",
  "conversations_diverged",
  "damaged_records",
  "outbox_throttled",
  "steps_called",
  "steps_replayed",
  "steps_failed",
].map((n) => `botmesh_durable_${n}_total`);

describe("prometheusMetrics", () => {
  test("the parser itself refuses what is not the format", () => {
    expect(() => parseExposition("foo 1\n")).toThrow(/without\) its TYPE/);
    expect(() => parseExposition("# TYPE foo gauge\n# HELP foo x\nfoo one\n")).toThrow(/not numeric/);
    expect(() => parseExposition('# TYPE foo gauge\n# HELP foo x\nfoo{a="x"y"} 1\n')).toThrow(/label syntax/);
    expect(() => parseExposition("# TYPE foo gauge\n# HELP foo x\nfoo 1")).toThrow(/newline/);
    expect(() => parseExposition("# TYPE foo gauge\n# HELP foo x\nhello\n")).toThrow(/neither/);
    expect(() => parseExposition("# TYPE foo counter\n# HELP foo x\nfoo 1\n")).toThrow(/_total/);
    expect(() => parseExposition("# TYPE a gauge\n# HELP a x\n# TYPE b gauge\n# HELP b x\nb 1\na 1\n")).toThrow(/outside/);
    expect(() => parseExposition("# TYPE a gauge\n# HELP a x\na 1\na 2\n")).toThrow(/twice/);
    const h = (lines: string) => parseExposition(`# TYPE h histogram\n# HELP h x\n${lines}`);
    expect(() => h('h_bucket{le="1"} 1\nh_bucket{le="+Inf"} 2\nh_sum 3\nh_count 2\n')).not.toThrow();
    expect(() => h('h_bucket{le="1"} 3\nh_bucket{le="+Inf"} 2\nh_sum 3\nh_count 2\n')).toThrow(/decreases/);
    expect(() => h('h_bucket{le="2"} 1\nh_bucket{le="1"} 1\nh_bucket{le="+Inf"} 2\nh_sum 3\nh_count 2\n')).toThrow(/not above/);
    expect(() => h('h_bucket{le="1"} 1\nh_bucket{le="+Inf"} 2\nh_sum 3\nh_count 3\n')).toThrow(/is not _count/);
    expect(() => h('h_bucket{le="1"} 1\nh_sum 3\nh_count 1\n')).toThrow(/\+Inf/);
    expect(() => h('h_bucket{le="1"} 1\nh_bucket{le="+Inf"} 1\nh_count 1\n')).toThrow(/_sum/);
    expect(() => h("h 1\n")).toThrow(/TYPE/);
  });

  test("exact counters and gauges after a scenario with duplicates, dead letters and an ambiguous send", async () => {
    const backend = new MemoryDurability();
    // A send whose owner died mid-call: the bot's first sweep finds it ambiguous.
    const ghost = await backend.outbox.reserve(
      { key: "ghost-1", chatId: "c9", content: { text: "lost?" }, contentHash: "h", inboundId: null },
      { owner: "dead-replica", incarnation: "x", leaseMs: 20 },
    );
    await backend.outbox.markCalling("ghost-1", ghost.entry.fence, 20); // it died during the call
    await new Promise((r) => setTimeout(r, 40));

    const provider = new MockProvider();
    const bot = new Bot({
      provider,
      durability: { backend, instanceId: "prom-1", inbox: { retries: 0 }, outbox: { backoff: { baseMs: 1, capMs: 2 } } },
    });
    bot.on("error", () => {});
    bot.on("warning", () => {});
    bot.when("ping", (ctx) => ctx.reply("pong"));
    bot.when("boom", () => {
      throw new Error("handler failed");
    });
    let quoteCalls = 0;
    bot.when("quote", async (ctx) => {
      // Fails once (retried within the step), then journals 42; a replay is answered from the journal.
      const price = await ctx.step("price", () => {
        if (++quoteCalls === 1) throw new Error("quote service busy");
        return 42;
      }, { retries: 1 });
      await ctx.reply(`price ${price}`);
    });
    await bot.start();
    try {
      await provider.receive({ id: "m1", chatId: "c1", text: "ping" });
      await bot.idle();
      await provider.receive({ id: "m1", chatId: "c1", text: "ping" }); // redelivery
      await provider.receive({ id: "m2", chatId: "c1", text: "boom" }); // dead at once (retries 0)
      await bot.idle();
      provider.failNext(1, new ProviderError("Invalid recipient", { retryable: false }));
      await provider.receive({ id: "m3", chatId: "c2", text: "ping" }); // its reply is dead
      await bot.idle();
      await provider.receive({ id: "m4", chatId: "c4", text: "quote" });
      await bot.idle();
      expect(await bot.durability!.replayInbound("m4")).toBe(true);
      await bot.idle();
      expect(quoteCalls).toBe(2);
      await bot.send("c3", "invoice", { idempotencyKey: "k1" });
      await bot.send("c3", "invoice", { idempotencyKey: "k1" }); // answered from the outbox
      await bot.idle();

      const now = Date.now();
      const text = await prometheusMetrics(bot, { labels: { bot: "support" }, now: () => now });
      const p = parseExposition(text);
      for (const name of COUNTER_NAMES) expect(p.types.get(name)).toBe("counter");
      expect([...p.types.keys()].filter((n) => p.types.get(n) === "counter")).toEqual(COUNTER_NAMES);
      for (const s of p.samples) expect(s.labels.bot).toBe("support");
      const counters = Object.fromEntries(COUNTER_NAMES.map((n) => [n.slice(16, -6), value(p, n)]));
      expect(counters).toEqual({
        inbound_journaled: 4,
        inbound_duplicates: 1,
        inbound_replayed: 1,
        inbound_dead: 1,
        outbox_journaled: 4,
        outbox_deduped: 2,
        outbox_retried: 0,
        outbox_deferred: 0,
        outbox_dead: 1,
        outbox_ambiguous: 1,
        outbox_resolved: 0,
        outbox_bypassed: 0,
        stale_leases: 0,
        outbox_diverged: 0,
        conversations_replayed: 0,
        conversations_diverged: 0,
        damaged_records: 0,
        outbox_throttled: 0,
        steps_called: 2,
        steps_replayed: 1,
        steps_failed: 0,
      });
      const { outboxWaitingForLimit, ...counted } = bot.durability!.metrics();
      expect(counters).toEqual(
        Object.fromEntries(
          Object.entries(counted).map(([k, v]) => [k.replace(/[A-Z]/g, (c) => `_${c.toLowerCase()}`), v]),
        ),
      );
      expect(p.types.get("botmesh_durable_outbox_waiting_for_limit")).toBe("gauge");
      expect(value(p, "botmesh_durable_outbox_waiting_for_limit")).toBe(outboxWaitingForLimit);
      expect(p.types.get("botmesh_durable_inbox_records")).toBe("gauge");
      expect(p.types.get("botmesh_durable_outbox_records")).toBe("gauge");
      const inbox = (state: string) => value(p, "botmesh_durable_inbox_records", { state });
      const outbox = (state: string) => value(p, "botmesh_durable_outbox_records", { state });
      expect(["pending", "processing", "scheduled", "failed", "done", "dead"].map(inbox)).toEqual([0, 0, 0, 0, 3, 1]);
      expect(["queued", "sending", "sent", "failed", "dead", "unknown"].map(outbox)).toEqual([0, 0, 5, 0, 1, 1]); // sent: pong, price 42, the invoice, the step's two attempts (the failed one superseded)
      expect(value(p, "botmesh_durable_oldest_pending_age_seconds")).toBe(0);
      expect(value(p, "botmesh_durable_records_count_cap")).toBe(1000);
      // Provider calls: pong, the reply of m3 (refused), price 42, the invoice (a step is no provider call).
      // Pong and price 42 are replies recorded as sent.
      const histograms = bot.durability!.histograms();
      const providerCall = histogram(p, "botmesh_durable_provider_call_seconds");
      expect(providerCall.count).toBe(4);
      expect(histogram(p, "botmesh_durable_outbox_queued_seconds").count).toBe(4);
      expect(histogram(p, "botmesh_durable_reply_latency_seconds").count).toBe(2);
      expect(providerCall.buckets.map(([le]) => le)).toEqual([...histograms.providerCall.bounds, Infinity]);
      expect(providerCall.buckets.map(([, n]) => n)).toEqual([...histograms.providerCall.cumulative, 4]);
      expect(providerCall.sum).toBe(Math.round(histograms.providerCall.sum * 1000) / 1000);
      expect(p.types.get("botmesh_durable_reply_latency_seconds")).toBe("histogram");
      // The same numbers through bot.durability.
      expect(await prometheusMetrics(bot.durability!, { labels: { bot: "support" }, now: () => now })).toBe(text);
    } finally {
      await bot.stop();
    }
  });

  test("docs/operations.md lists every counter of metrics() and every histogram of histograms(), in order", async () => {
    const doc = await Bun.file(new URL("../docs/operations.md", import.meta.url)).text();
    const table = (header: string) => {
      const start = doc.indexOf(header);
      if (start < 0) throw new Error(`no table "${header}" in docs/operations.md`);
      const rows = doc.slice(start).split("\n").slice(2);
      return rows.slice(0, rows.findIndex((line) => !line.startsWith("|"))).map((line) => /^\| `(\w+)` \|/.exec(line)?.[1]);
    };
    expect(table("| counter | what |")).toEqual(Object.keys(zeroMetrics()));
    expect(table("| histogram | what |")).toEqual(Object.keys(bot0().durability!.histograms()));
  });

  test("a bare backend: gauges only, the age of the oldest pending record, the cap as a lower bound", async () => {
    const backend = new MemoryDurability();
    const t0 = 1_700_000_000_000;
    for (let i = 0; i < 5; i++) {
      await backend.inbox.admit({
        id: `in-${i}`,
        kind: "message",
        chatId: "c1",
        provider: "test",
        payload: { text: `${i}` },
        receivedAt: t0 + i * 1000,
      });
    }
    const claimed = await backend.inbox.claim("in-0", { owner: "o", incarnation: "i", leaseMs: 60_000 });
    await backend.inbox.fail("in-0", claimed!.lease!.token, { error: "x", retryInMs: 60_000 });
    const text = await prometheusMetrics(backend, { now: () => t0 + 90_500, countCap: 3 });
    const p = parseExposition(text);
    expect(p.samples.some((s) => s.name.endsWith("_total"))).toBe(false);
    expect(value(p, "botmesh_durable_inbox_records", { state: "pending" })).toBe(3); // 4 really: capped
    expect(value(p, "botmesh_durable_inbox_records", { state: "failed" })).toBe(1);
    expect(value(p, "botmesh_durable_oldest_pending_age_seconds")).toBe(90.5); // in-0 (failed) is the oldest
    expect(value(p, "botmesh_durable_records_count_cap")).toBe(3);
    expect(p.help.get("botmesh_durable_inbox_records")).toContain("lower bound");
    expect(text).toContain('botmesh_durable_inbox_records{state="pending"} 3\n');
  });

  test("the age of the oldest record of each state, by receivedAt and createdAt", async () => {
    const backend = new MemoryDurability();
    const t0 = 1_700_000_000_000;
    const admit = (id: string, chatId: string, receivedAt: number) =>
      backend.inbox.admit({ id, kind: "message", chatId, provider: "test", payload: {}, receivedAt });
    await admit("late", "c1", t0 + 30_000);
    await admit("early", "c2", t0 + 10_000); // admitted second, received first
    await admit("gone", "c3", t0);
    const claimed = await backend.inbox.claim("gone", { owner: "o", incarnation: "i", leaseMs: 60_000 });
    await backend.inbox.fail("gone", claimed!.lease!.token, { error: "x", dead: true });
    const first = await backend.outbox.reserve({ key: "k1", chatId: "c1", content: "a", contentHash: "h1", inboundId: null });
    await backend.outbox.reserve({ key: "k2", chatId: "c2", content: "b", contentHash: "h2", inboundId: null });
    const now = Math.max(t0 + 60_000, first.entry.createdAt + 5_000);
    const p = parseExposition(await prometheusMetrics(backend, { now: () => now }));
    const inboxAge = (state: string) => value(p, "botmesh_durable_inbox_oldest_age_seconds", { state });
    const outboxAge = (state: string) => value(p, "botmesh_durable_outbox_oldest_age_seconds", { state });
    expect(inboxAge("pending")).toBe((now - t0 - 10_000) / 1000);
    expect(inboxAge("dead")).toBe((now - t0) / 1000);
    expect([inboxAge("processing"), inboxAge("failed")]).toEqual([0, 0]);
    expect(outboxAge("queued")).toBe(Math.round(now - first.entry.createdAt) / 1000);
    expect(["sending", "failed", "dead", "unknown"].map(outboxAge)).toEqual([0, 0, 0, 0]);
    expect(p.samples.some((s) => s.name === "botmesh_durable_inbox_oldest_age_seconds" && s.labels.state === "done")).toBe(false);
    expect(p.samples.some((s) => s.name.endsWith("_bucket")), "a backend has no histograms").toBe(false);
  });

  test('label values escape ", \\ and newline', async () => {
    const backend = new MemoryDurability();
    const raw = 'a "quoted" \\path\\ and\nnewline';
    const text = await prometheusMetrics(backend, { labels: { bot: raw, region: "" } });
    expect(text).toContain('{bot="a \\"quoted\\" \\\\path\\\\ and\\nnewline",region="",state="dead"}');
    const p = parseExposition(text);
    for (const s of p.samples) expect(s.labels.bot).toBe(raw);
    expect(text.split("\n").every((line) => !line.includes("\r"))).toBe(true);
    expect(escapeLabelValue('x"\\\n')).toBe('x\\"\\\\\\n');
  });

  test("bad options and sources are refused with errors that name them", async () => {
    const backend = new MemoryDurability();
    await expect(prometheusMetrics(backend, { labels: { "bad-name": "x" } })).rejects.toThrow(
      /Option "labels" has an invalid label name "bad-name"/,
    );
    await expect(prometheusMetrics(backend, { labels: { "1x": "x" } })).rejects.toThrow(TypeError);
    await expect(prometheusMetrics(backend, { labels: { __name__: "x" } })).rejects.toThrow(/"__name__"/);
    await expect(prometheusMetrics(backend, { labels: { state: "x" } })).rejects.toThrow(/"state"/);
    await expect(prometheusMetrics(backend, { labels: { le: "x" } })).rejects.toThrow(/"le"/);
    await expect(prometheusMetrics(backend, { labels: { bot: 3 as unknown as string } })).rejects.toThrow(
      /Option "labels.bot" must be a string, got 3/,
    );
    await expect(prometheusMetrics(backend, { labels: [] as unknown as Record<string, string> })).rejects.toThrow(
      /Option "labels" must be an object/,
    );
    await expect(prometheusMetrics(backend, { countCap: 0 })).rejects.toThrow(/Option "countCap" must be a positive integer, got 0/);
    await expect(prometheusMetrics(backend, { cap: 3 } as never)).rejects.toThrow(/Unknown option "cap"/);
    const plain = new Bot({ provider: new MockProvider() });
    await expect(prometheusMetrics(plain)).rejects.toThrow(/bot without durability/);
    await expect(prometheusMetrics({} as never)).rejects.toThrow(/needs a Bot with durability/);
  });
});
