/**
 * Messages per second through the bot, durability off versus on with the
 * memory, file and SQLite backends (and the generic kv backend over
 * MemoryKv), measured side by side in one run, rounds interleaved, medians
 * reported as ratios. The file and SQLite backends write to a fresh file in
 * the system temp directory each round, with fsync on (their defaults).
 *
 *   bun bench/engine.bench.ts [messages] [rounds]
 */
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Bot, type DurabilityBackend, MemoryDurability } from "../mod.ts";
import { KvDurability } from "../backends/kv/mod.ts";
import { MemoryKv } from "../backends/memory/mod.ts";
import { FileDurability } from "../backends/file/durability.ts";
import { SQLiteDurability } from "../backends/sqlite/durability.ts";
import { MockProvider } from "../testing.ts";

const MESSAGES = Number(Bun.argv[2] ?? 2000);
const ROUNDS = Number(Bun.argv[3] ?? 5);
const CHATS = 100;

type Variant = { name: string; backend: (dir: string) => DurabilityBackend | undefined };
const variants: Variant[] = [
  { name: "durability off", backend: () => undefined },
  { name: "memory backend", backend: () => new MemoryDurability() },
  { name: "file backend", backend: (dir) => new FileDurability({ path: join(dir, "bot.json") }) },
  { name: "sqlite backend", backend: (dir) => new SQLiteDurability({ file: join(dir, "bot.db") }) },
  { name: "kv backend (MemoryKv)", backend: () => new KvDurability(new MemoryKv()) },
];

async function once(variant: Variant): Promise<number> {
  const dir = mkdtempSync(join(tmpdir(), "botmesh-bench-"));
  try {
    return await measure(variant, dir);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}

async function measure(variant: Variant, dir: string): Promise<number> {
  const provider = new MockProvider();
  const backend = variant.backend(dir);
  const bot = new Bot({
    provider,
    ...(backend ? { durability: { backend, instanceId: "bench" } } : {}),
  });
  bot.when(() => true, (ctx) => ctx.reply(`echo ${ctx.message.text}`));
  await bot.start();
  const started = performance.now();
  const admits: Promise<unknown>[] = [];
  for (let i = 0; i < MESSAGES; i++) {
    admits.push(provider.receive({ id: `m${i}`, chatId: `c${i % CHATS}`, text: `hello ${i}` }));
  }
  await Promise.all(admits);
  await bot.idle();
  const ms = performance.now() - started;
  await bot.stop();
  if (provider.sent.length !== MESSAGES) throw new Error(`${variant.name}: sent ${provider.sent.length} of ${MESSAGES}`);
  return MESSAGES / (ms / 1000);
}

const median = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]!;
const results = new Map<string, number[]>(variants.map((v) => [v.name, []]));
for (const v of variants) await once(v); // warm-up
for (let r = 0; r < ROUNDS; r++) {
  for (const v of variants) results.get(v.name)!.push(await once(v));
}
const base = median(results.get(variants[0]!.name)!);
console.log(`${MESSAGES} messages over ${CHATS} chats, one reply each, ${ROUNDS} interleaved rounds (median)`);
for (const v of variants) {
  const m = median(results.get(v.name)!);
  console.log(`${v.name.padEnd(24)} ${Math.round(m).toString().padStart(8)} msg/s   ratio to off: ${(m / base).toFixed(3)}`);
}
