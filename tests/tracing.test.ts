// OpenTelemetry spans through `durability.tracer`: admit → handle → send, and the trace kept across a restart.
import { describe, expect, test } from "bun:test";
import { BasicTracerProvider, InMemorySpanExporter, type ReadableSpan, SimpleSpanProcessor } from "@opentelemetry/sdk-trace-base";
import { Bot, type InboundMessage, MemoryDurability } from "../mod.ts";
import { MockProvider } from "../testing.ts";
import { formatTraceparent, parseTraceparent } from "../src/tracing.ts";
import type { InboundSink } from "../provider.ts";

function tracing() {
  const exporter = new InMemorySpanExporter();
  const provider = new BasicTracerProvider({ spanProcessors: [new SimpleSpanProcessor(exporter)] });
  return { exporter, tracer: provider.getTracer("botmesh-test") };
}

function only(spans: ReadableSpan[], name: string, attribute?: [string, unknown]): ReadableSpan {
  const found = spans.filter((s) => s.name === name && (attribute === undefined || s.attributes[attribute[0]] === attribute[1]));
  if (found.length !== 1) throw new Error(`expected one ${name} span ${JSON.stringify(attribute)}, found ${found.length}`);
  return found[0]!;
}

function isChild(child: ReadableSpan, parent: ReadableSpan): boolean {
  const p = child.parentSpanContext;
  return child.spanContext().traceId === parent.spanContext().traceId && p?.spanId === parent.spanContext().spanId;
}

describe("durability.tracer", () => {
  test("admit → handle → send, with the admission's traceparent journaled in the record", async () => {
    const { exporter, tracer } = tracing();
    const backend = new MemoryDurability();
    const provider = new MockProvider();
    const bot = new Bot({ provider, durability: { backend, instanceId: "trace-1", tracer } });
    const seen: InboundMessage[] = [];
    bot.when("ping", async (ctx) => {
      seen.push(ctx.message);
      await ctx.reply("pong");
      await ctx.reply("and again");
    });
    await bot.start();
    try {
      await provider.receive({ id: "m1", chatId: "c1", text: "ping" });
      await bot.idle();
      await provider.receive({ id: "m1", chatId: "c1", text: "ping" }); // a redelivery: an admit span, nothing else
      await bot.idle();
    } finally {
      await bot.stop();
    }
    const spans = exporter.getFinishedSpans();
    const admits = spans.filter((s) => s.name === "botmesh.admit");
    expect(admits.map((s) => s.attributes["botmesh.admit.status"])).toEqual(["admitted", "duplicate"]);
    const admit = admits[0]!;
    const handle = only(spans, "botmesh.handle");
    const sends = spans.filter((s) => s.name === "botmesh.send");
    expect(sends.length).toBe(2);
    expect(isChild(handle, admit)).toBe(true);
    for (const send of sends) {
      expect(isChild(send, handle)).toBe(true);
      expect(send.attributes["botmesh.inbound_id"]).toBe("m1");
    }
    expect(handle.attributes["botmesh.attempt"]).toBe(1);
    const record = await backend.inbox.get("m1");
    expect((record!.payload as Record<string, unknown>)["$trace"]).toBe(formatTraceparent(admit.spanContext()));
    expect("$trace" in seen[0]!).toBe(false);
  });

  test("a record handled again after a restart stays in its admission's trace", async () => {
    const backend = new MemoryDurability();
    const first = tracing();
    const provider1 = new MockProvider();
    const durability = (tracer: unknown) => ({
      backend,
      instanceId: "trace-restart",
      // A short lease: a retry the first process claimed just before it stopped passes to the second soon.
      inbox: { retries: 5, backoff: { baseMs: 1, capMs: 1 }, leaseMs: 300 },
      sweepIntervalMs: 10,
      tracer: tracer as never,
    });
    const bot1 = new Bot({ provider: provider1, durability: durability(first.tracer) });
    bot1.on("warning", () => {});
    bot1.when(/.*/, () => {
      throw new Error("down for now");
    });
    await bot1.start();
    await provider1.receive({ id: "m2", chatId: "c2", text: "hello" });
    await waitFor(async () => (await backend.inbox.get("m2"))?.state === "failed");
    await bot1.stop();

    const second = tracing();
    const provider2 = new MockProvider();
    const bot2 = new Bot({ provider: provider2, durability: durability(second.tracer) });
    const seen: InboundMessage[] = [];
    bot2.when(/.*/, async (ctx) => {
      seen.push(ctx.message);
      await ctx.reply("hello again");
    });
    await bot2.start();
    try {
      await waitFor(async () => (await backend.inbox.get("m2"))?.state === "done");
      await bot2.idle();
    } finally {
      await bot2.stop();
    }
    const admit = only(first.exporter.getFinishedSpans(), "botmesh.admit");
    const failed = first.exporter.getFinishedSpans().filter((s) => s.name === "botmesh.handle");
    expect(failed.length).toBeGreaterThanOrEqual(1);
    for (const s of failed) {
      expect(isChild(s, admit)).toBe(true);
      expect(s.status.code).toBe(2);
      expect(s.events.some((e) => e.name === "exception")).toBe(true);
    }
    const spans = second.exporter.getFinishedSpans();
    const handled = spans.filter((s) => s.name === "botmesh.handle");
    expect(handled.length).toBe(1);
    const handle = handled[0]!;
    expect(isChild(handle, admit), "the second process's handle span is a child of the first's admit span").toBe(true);
    expect(handle.parentSpanContext?.isRemote).toBe(true);
    expect(handle.attributes["botmesh.attempt"]).toBeGreaterThan(failed.length);
    expect(isChild(only(spans, "botmesh.send"), handle)).toBe(true);
    expect(seen.length).toBe(1);
    expect("$trace" in seen[0]!, "the handler never sees the journaled trace field").toBe(false);
  }, 60_000);

  test("without a tracer the payload carries no trace and nothing is traced", async () => {
    const backend = new MemoryDurability();
    const provider = new MockProvider();
    const bot = new Bot({ provider, durability: { backend, instanceId: "trace-off" } });
    bot.when("ping", (ctx) => ctx.reply("pong"));
    await bot.start();
    try {
      await provider.receive({ id: "m3", chatId: "c3", text: "ping" });
      await bot.idle();
    } finally {
      await bot.stop();
    }
    const record = await backend.inbox.get("m3");
    expect(Object.keys(record!.payload as object)).not.toContain("$trace");
    expect(bot.durability!.histograms().providerCall.count).toBe(1);
  });

  test("a message's own $trace field is journaled escaped and handed back as sent", async () => {
    const { tracer } = tracing();
    const backend = new MemoryDurability();
    const provider = new MockProvider();
    let sink: InboundSink | undefined;
    const start = provider.start.bind(provider);
    provider.start = (s: InboundSink) => {
      sink = s;
      start(s);
    };
    const bot = new Bot({ provider, durability: { backend, instanceId: "trace-own", tracer } });
    const seen: unknown[] = [];
    bot.when(/.*/, (ctx) => {
      seen.push((ctx.message.extra as Record<string, unknown>)["$trace"]);
      seen.push((ctx.message as unknown as Record<string, unknown>)["$trace"]);
    });
    await bot.start();
    try {
      // A provider may put fields of its own at the top level of a message, `$trace` too.
      await sink!.receive({ id: "m4", chatId: "c4", type: "text", text: "x", extra: { $trace: "mine" }, $trace: "top" } as never);
      await bot.idle();
      expect(await bot.durability!.replayInbound("m4")).toBe(true);
      await waitFor(async () => seen.length === 4);
    } finally {
      await bot.stop();
    }
    expect(seen, "nested and top-level, on the first run and on a replay").toEqual(["mine", "top", "mine", "top"]);
  });

  test("traceparent values: formatted and parsed, invalid ones refused", () => {
    const ids = { traceId: "4bf92f3577b34da6a3ce929d0e0e4736", spanId: "00f067aa0ba902b7", traceFlags: 1 };
    const text = formatTraceparent(ids);
    expect(text).toBe("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
    expect(parseTraceparent(text)).toEqual({ ...ids, isRemote: true });
    for (const bad of [undefined, 7, "", "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", `00-${"0".repeat(32)}-00f067aa0ba902b7-01`, `00-4bf92f3577b34da6a3ce929d0e0e4736-${"0".repeat(16)}-01`, "00-XYZ-00f067aa0ba902b7-01"]) {
      expect(parseTraceparent(bad)).toBe(null);
    }
  });
});

async function waitFor(check: () => Promise<boolean>, timeoutMs = 20_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!await check()) {
    if (Date.now() > deadline) throw new Error("timed out waiting");
    await new Promise((r) => setTimeout(r, 5));
  }
}
