// prometheusMetrics: the text exposition of the counters and the journal gauges, checked with a strict parser.
import { describe, expect, test } from "bun:test";
import { Bot, ProviderError } from "../mod.ts";
import { MemoryDurability } from "../mod.ts";
import { MockProvider } from "../testing.ts";
import { escapeLabelValue, prometheusMetrics } from "../src/ops/prometheus.ts";

interface Sample {
  name: string;
  labels: Record<string, string>;
  value: number;
}
interface Parsed {
  types: Map<string, string>;
  help: Map<string, string>;
  samples: Sample[];
}

/** A strict parser of the text format 0.0.4 (the subset we write): throws on anything else. */
function parseExposition(text: string): Parsed {
  if (!text.endsWith("\n")) throw new Error("the exposition must end with a newline");
  const types = new Map<string, string>();
  const help = new Map<string, string>();
  const samples: Sample[] = [];
  const NAME = "[a-zA-Z_:][a-zA-Z0-9_:]*";
  const lines = text.slice(0, -1).split("\n");
  for (const [i, line] of lines.entries()) {
    const where = `line ${i + 1} ${JSON.stringify(line)}`;
    let m: RegExpExecArray | null;
    if ((m = new RegExp(`^# HELP (${NAME}) (.*)$`).exec(line))) {
      if (help.has(m[1]!)) throw new Error(`${where}: second HELP`);
      if (/\\[^\\n]|\\$/.test(m[2]!.replace(/\\\\/g, ""))) throw new Error(`${where}: bad escape in HELP`);
      help.set(m[1]!, m[2]!);
      continue;
    }
    if ((m = new RegExp(`^# TYPE (${NAME}) (counter|gauge|histogram|summary|untyped)$`).exec(line))) {
      if (types.has(m[1]!)) throw new Error(`${where}: second TYPE`);
      types.set(m[1]!, m[2]!);
      continue;
    }
    m = new RegExp(`^(${NAME})(?:\\{(.*)\\})? (\\S+)$`).exec(line);
    if (!m) throw new Error(`${where}: neither HELP, TYPE nor a sample`);
    const [, name, labelText, valueText] = m;
    if (!types.has(name!)) throw new Error(`${where}: sample of ${name} before (or without) its TYPE`);
    if (!/^(?:[+-]?(?:\d+(?:\.\d+)?(?:e[+-]?\d+)?)|NaN|[+-]Inf)$/i.test(valueText!)) {
      throw new Error(`${where}: value ${valueText} is not numeric`);
    }
    const labels: Record<string, string> = {};
    if (labelText !== undefined) {
      const re = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\\\|\\"|\\n)*)"(,|$)/y;
      let pos = 0;
      while (pos < labelText.length) {
        re.lastIndex = pos;
        const l = re.exec(labelText);
        if (!l) throw new Error(`${where}: bad label syntax at ${pos}`);
        if (l[1]! in labels) throw new Error(`${where}: label ${l[1]} twice`);
        labels[l[1]!] = l[2]!.replace(/\\(\\|"|n)/g, (_, c: string) => (c === "n" ? "\n" : c));
        pos = re.lastIndex;
        if (l[3] === "," && pos === labelText.length) throw new Error(`${where}: trailing comma`);
      }
    }
    samples.push({ name: name!, labels, value: Number(valueText!.replace(/Inf$/i, "Infinity")) });
  }
  for (const name of types.keys()) {
    if (!help.has(name)) throw new Error(`${name} has a TYPE but no HELP`);
    if (!samples.some((s) => s.name === name)) throw new Error(`${name} has a TYPE but no sample`);
  }
  return { types, help, samples };
}

function value(p: Parsed, name: string, labels: Record<string, string> = {}): number {
  const found = p.samples.filter((s) =>
    s.name === name && Object.entries(labels).every(([k, v]) => s.labels[k] === v)
  );
  if (found.length !== 1) throw new Error(`expected one sample ${name} ${JSON.stringify(labels)}, found ${found.length}`);
  return found[0]!.value;
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
].map((n) => `botmesh_durable_${n}_total`);

describe("prometheusMetrics", () => {
  test("the parser itself refuses what is not the format", () => {
    expect(() => parseExposition("foo 1\n")).toThrow(/without\) its TYPE/);
    expect(() => parseExposition("# TYPE foo counter\n# HELP foo x\nfoo one\n")).toThrow(/not numeric/);
    expect(() => parseExposition('# TYPE foo gauge\n# HELP foo x\nfoo{a="x"y"} 1\n')).toThrow(/label syntax/);
    expect(() => parseExposition("# TYPE foo gauge\n# HELP foo x\nfoo 1")).toThrow(/newline/);
    expect(() => parseExposition("# TYPE foo gauge\n# HELP foo x\nhello\n")).toThrow(/neither/);
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
      durability: { backend, instanceId: "prom-1", inbox: { retries: 0 } },
    });
    bot.on("error", () => {});
    bot.on("warning", () => {});
    bot.when("ping", (ctx) => ctx.reply("pong"));
    bot.when("boom", () => {
      throw new Error("handler failed");
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
      await bot.send("c3", "invoice", { idempotencyKey: "k1" });
      await bot.send("c3", "invoice", { idempotencyKey: "k1" }); // answered from the outbox
      await bot.idle();

      const text = await prometheusMetrics(bot, { labels: { bot: "support" } });
      const p = parseExposition(text);
      for (const name of COUNTER_NAMES) expect(p.types.get(name)).toBe("counter");
      expect([...p.types.keys()].filter((n) => p.types.get(n) === "counter")).toEqual(COUNTER_NAMES);
      for (const s of p.samples) expect(s.labels.bot).toBe("support");
      const counters = Object.fromEntries(COUNTER_NAMES.map((n) => [n.slice(16, -6), value(p, n)]));
      expect(counters).toEqual({
        inbound_journaled: 3,
        inbound_duplicates: 1,
        inbound_replayed: 0,
        inbound_dead: 1,
        outbox_journaled: 3,
        outbox_deduped: 1,
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
      expect(["pending", "processing", "failed", "done", "dead"].map(inbox)).toEqual([0, 0, 0, 2, 1]);
      expect(["queued", "sending", "sent", "failed", "dead", "unknown"].map(outbox)).toEqual([0, 0, 2, 0, 1, 1]);
      expect(value(p, "botmesh_durable_oldest_pending_age_seconds")).toBe(0);
      expect(value(p, "botmesh_durable_records_count_cap")).toBe(1000);
      // The same numbers through bot.durability.
      expect(await prometheusMetrics(bot.durability!, { labels: { bot: "support" } })).toBe(text);
    } finally {
      await bot.stop();
    }
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
