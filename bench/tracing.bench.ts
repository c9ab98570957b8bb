/**
 * Messages per second through the bot on the memory backend, without a tracer
 * versus with an OpenTelemetry SDK tracer (every span sampled, exported to an
 * exporter that drops them), rounds interleaved, medians reported as ratios.
 *
 *   bun bench/tracing.bench.ts [messages] [rounds]
 */
import { BasicTracerProvider, type ReadableSpan, SimpleSpanProcessor, type SpanExporter } from "@opentelemetry/sdk-trace-base";
import { Bot, MemoryDurability, type TracerLike } from "../mod.ts";
import { MockProvider } from "../testing.ts";

const MESSAGES = Number(Bun.argv[2] ?? 2000);
const ROUNDS = Number(Bun.argv[3] ?? 7);
const CHATS = 100;

let exported = 0;
const dropping: SpanExporter = {
  export(spans: ReadableSpan[], done: (result: { code: number }) => void) {
    exported += spans.length;
    done({ code: 0 });
  },
  shutdown: () => Promise.resolve(),
};
const tracer = new BasicTracerProvider({ spanProcessors: [new SimpleSpanProcessor(dropping)] }).getTracer("bench");

type Variant = { name: string; tracer?: TracerLike };
const variants: Variant[] = [{ name: "no tracer" }, { name: "SDK tracer, all spans", tracer: tracer as unknown as TracerLike }];

async function measure(variant: Variant): Promise<number> {
  const provider = new MockProvider();
  const bot = new Bot({
    provider,
    durability: { backend: new MemoryDurability(), instanceId: "bench", ...(variant.tracer ? { tracer: variant.tracer } : {}) },
  });
  bot.when(() => true, (ctx) => ctx.reply(`echo ${ctx.message.text}`));
  await bot.start();
  const started = performance.now();
  const admits: Promise<unknown>[] = [];
  for (let i = 0; i < MESSAGES; i++) admits.push(provider.receive({ id: `m${i}`, chatId: `c${i % CHATS}`, text: `hello ${i}` }));
  await Promise.all(admits);
  await bot.idle();
  const ms = performance.now() - started;
  await bot.stop();
  if (provider.sent.length !== MESSAGES) throw new Error(`${variant.name}: sent ${provider.sent.length} of ${MESSAGES}`);
  return (MESSAGES / ms) * 1000;
}

const median = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]!;
const rates = new Map<string, number[]>(variants.map((v) => [v.name, []]));
for (const v of variants) await measure(v); // warm-up
exported = 0;
for (let round = 0; round < ROUNDS; round++) {
  for (const v of variants) rates.get(v.name)!.push(await measure(v));
}
const base = median(rates.get(variants[0]!.name)!);
console.log(`${MESSAGES} messages × ${ROUNDS} rounds, memory backend, one reply each`);
for (const v of variants) {
  const m = median(rates.get(v.name)!);
  console.log(`${v.name.padEnd(24)} ${m.toFixed(0).padStart(8)} msg/s   × ${(m / base).toFixed(2)} of no tracer`);
}
console.log(`spans exported per message: ${(exported / (MESSAGES * ROUNDS)).toFixed(2)}`);
