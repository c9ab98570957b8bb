/**
 * The demo's bot process (the child that `examples/demo/main.ts` kills and
 * restarts). A bot on the file channel (`examples/file_channel.ts`) with a
 * durable backend:
 *
 *   bun examples/demo/bot.ts --backend sqlite --data ./demo-data --instance demo-bot
 *
 * Flags:
 * - `--backend sqlite|file` (default `sqlite`): `SQLiteStore#durability()` in
 *   `<data>/bot.db`, or `FileDurability` in `<data>/journal.json`.
 * - `--data <dir>` (required): where the files live.
 * - `--instance <id>` (default `demo-bot`): the instanceId; keep it across
 *   restarts so a restarted process takes back its unfinished work at once.
 * - `--inbound <file>` (default `<data>/inbound.jsonl`), `--outbound <file>`
 *   (default `<data>/outbound.jsonl`), `--offset <file>` (default
 *   `<data>/<instance>.offset`), `--events <file>` (default
 *   `<data>/ambiguous.jsonl`): the channel's files and where
 *   `durability:ambiguous` events are appended, one JSON line each.
 * - `--lease-ms <n>` (default 60000): inbox and outbox lease.
 * - `--think-ms <n>`: how long the handler "thinks" mid-message (default: 10–100
 *   ms, derived from the message id, so kills land mid-work).
 * - `--latency-ms <n>` (default 2): channel latency per send (half before the
 *   line is written, half after: a kill can land on either side).
 * - `--metrics-ms <n>`: also print the metrics every n ms.
 * - `--hang-sends <regex>`: sends whose idempotency key matches never reach
 *   the channel: the call hangs (for tests of a process killed mid-send).
 * - `--confirm yes`: the channel answers `confirm` from its outbound file (a
 *   key found there was delivered; one absent, with no call of this process
 *   under way, never arrived), so ambiguous sends settle without an operator.
 * - `--calls <file>` (default `<data>/calls.log`): the key of every channel
 *   call is appended here as the call starts (to tell an ambiguous send that
 *   was called from one that never was).
 *
 * Handlers: a message whose text contains "twice" gets two replies with a think
 * in between; any other message one reply after a think. Replies are
 * deterministic (same text on a replay), so a reprocessed message is answered
 * from the outbox.
 *
 * Output (stdout, one JSON object per line): `{"type":"ready",...}` once
 * started; `{"type":"metrics",...}` every `--metrics-ms`; on the stdin line
 * `settle`, once all inbound lines are read and all work settled,
 * `{"type":"settled",...}` with the journal's counts; on SIGTERM/SIGINT or the
 * stdin line `stop`, a graceful stop and `{"type":"stopped",...}` with the
 * final metrics.
 *
 * @module
 */
import { appendFileSync } from "node:fs";
import { stat } from "node:fs/promises";
import { createInterface } from "node:readline";
import { join } from "node:path";
import { ANY, Bot, type DurabilityBackend, type Provider, type SendInQuestion, type SessionStore } from "../../mod.ts";
import { FileDurability } from "../../backends/file/durability.ts";
import { SQLiteStore } from "../../backends/sqlite/mod.ts";
import { FileChannel, openJsonLinesAppender } from "../file_channel.ts";

const args = parseArgs(process.argv.slice(2));
const backendName = args.backend ?? "sqlite";
if (backendName !== "sqlite" && backendName !== "file") fail(`--backend must be sqlite or file, got ${backendName}`);
if (!args.data) fail("--data <dir> is required");
const data = args.data;
const instance = args.instance ?? "demo-bot";
const leaseMs = num("lease-ms", 60_000);
const thinkMs = args["think-ms"] === undefined ? undefined : num("think-ms", 0);
const latencyMs = num("latency-ms", 2);

let store: SQLiteStore | undefined;
let backend: DurabilityBackend;
if (backendName === "sqlite") {
  store = new SQLiteStore({ file: join(data, "bot.db") });
  backend = store.durability();
} else {
  backend = new FileDurability({ path: join(data, "journal.json") });
}

const inboundFile = args.inbound ?? join(data, "inbound.jsonl");
const channel = new FileChannel({
  inbound: inboundFile,
  outbound: args.outbound ?? join(data, "outbound.jsonl"),
  offsetFile: args.offset ?? join(data, `${instance.replace(/[^\w.-]/g, "_")}.offset`),
  sendLatencyMs: latencyMs,
  tag: instance,
  // One bot process writes the outbound file, and a killed one writes nothing more.
  ...(args.confirm === "yes" ? { confirmAbsent: "never-arrived" as const } : {}),
  onSkip: (reason, line) => console.error(`[bot ${instance}] skipped inbound line (${reason}): ${line.slice(0, 80)}`),
  onError: (error) => console.error(`[bot ${instance}] channel:`, error),
});
const events = await openJsonLinesAppender(args.events ?? join(data, "ambiguous.jsonl"));

const hangSends = args["hang-sends"] === undefined ? undefined : new RegExp(args["hang-sends"]);
/** Every channel call, logged (synchronously) as it starts: what the demo checks ambiguous sends against. */
const callsFile = args.calls ?? join(data, "calls.log");
/** The channel, whose calls are logged as they start; with --hang-sends, matching sends hang forever (the outbox lease stays held). */
const provider: Provider = {
  name: channel.name,
  connectionId: channel.connectionId,
  start: (sink) => channel.start(sink),
  stop: () => channel.stop(),
  ...(args.confirm === "yes" ? { confirm: (send: SendInQuestion) => channel.confirm(send) } : {}),
  send: (chatId, content, context) => {
    appendFileSync(callsFile, `${context.idempotencyKey}\n`);
    return hangSends?.test(context.idempotencyKey) ? new Promise(() => {}) : channel.send(chatId, content, context);
  },
};

const bot = new Bot({
  provider,
  store: store as SessionStore | undefined,
  durability: {
    backend,
    instanceId: instance,
    inbox: { leaseMs },
    outbox: { leaseMs, backoff: { baseMs: 50, capMs: 1000 } },
  },
});

/** A stable 0..1 value per message id, so a replay thinks just as long. */
function hash01(id: string): number {
  let h = 2166136261;
  for (let i = 0; i < id.length; i++) h = Math.imul(h ^ id.charCodeAt(i), 16777619);
  return (h >>> 0) / 2 ** 32;
}
const think = (id: string) => new Promise((r) => setTimeout(r, thinkMs ?? 10 + Math.floor(hash01(id) * 90)));

bot.when(/twice/, async (ctx) => {
  await ctx.reply(`echo: ${ctx.message.text}`);
  await think(ctx.inboundId); // an LLM call, say
  await ctx.reply(`and again: ${ctx.message.text}`);
});
bot.when(ANY, async (ctx) => {
  await think(ctx.inboundId);
  await ctx.reply(`echo: ${ctx.message.text}`);
});

bot.on("durability:ambiguous", ({ key, chatId }) => {
  void events.append({ key, chatId, by: instance, at: Date.now() });
});
bot.on("durability:dead", ({ kind, id, error }) => console.error(`[bot ${instance}] dead ${kind} ${id}: ${error}`));
bot.on("error", (error) => console.error(`[bot ${instance}] error:`, error));

function emit(type: string, extra: Record<string, unknown> = {}): void {
  process.stdout.write(JSON.stringify({ type, instance, pid: process.pid, ...extra }) + "\n");
}
const metrics = () => ({ ...bot.durability!.metrics(), channel: channel.stats });

await bot.start();
emit("ready", { backend: backendName, metrics: metrics() }); // after recovery: start() ran the first sweep
if (args["metrics-ms"] !== undefined) {
  setInterval(() => emit("metrics", { metrics: metrics() }), num("metrics-ms", 200));
}

/** Wait until the channel has read the whole inbound file, then until all work settled; report the journal. */
async function settle(): Promise<void> {
  for (;;) {
    const size = await stat(inboundFile).then((s) => s.size, () => 0);
    if (channel.stats.ackedOffset >= size) break;
    await new Promise((r) => setTimeout(r, 10));
  }
  await bot.idle();
  const d = bot.durability!;
  const all = { limit: 1_000_000 };
  const [done, inboundDead, inboundActive, sent, unknown, outboundDead, outboundActive] = await Promise.all([
    d.inbox.list({ ...all, state: "done" }),
    d.inbox.list({ ...all, state: "dead" }),
    d.inbox.list({ ...all, state: ["pending", "processing", "failed"] }),
    d.outbox.list({ ...all, state: "sent" }),
    d.outbox.list({ ...all, state: "unknown" }),
    d.outbox.list({ ...all, state: "dead" }),
    d.outbox.list({ ...all, state: ["queued", "sending", "failed"] }),
  ]);
  emit("settled", {
    journal: {
      inboundDone: done.length,
      inboundDead: inboundDead.map((r) => r.id),
      inboundActive: inboundActive.length,
      outboxSent: sent.length,
      outboxUnknown: unknown.map((e) => e.key),
      outboxDead: outboundDead.map((e) => e.key),
      outboxActive: outboundActive.length,
    },
    metrics: metrics(),
  });
}

let stopping = false;
async function stop(): Promise<void> {
  if (stopping) return;
  stopping = true;
  await bot.stop();
  await channel.close();
  await store?.close();
  await events.close();
  emit("stopped", { metrics: metrics() });
  process.exit(0);
}
process.on("SIGTERM", () => void stop());
process.on("SIGINT", () => void stop());

createInterface({ input: process.stdin }).on("line", (line) => {
  const command = line.trim();
  if (command === "settle") settle().catch((error) => console.error(`[bot ${instance}] settle:`, error));
  else if (command === "metrics") emit("metrics", { metrics: metrics() });
  else if (command === "stop") void stop();
});

function parseArgs(argv: string[]): Record<string, string | undefined> {
  const out: Record<string, string | undefined> = {};
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i]!;
    if (!arg.startsWith("--")) fail(`unexpected argument ${arg}`);
    const eq = arg.indexOf("=");
    if (eq > 0) out[arg.slice(2, eq)] = arg.slice(eq + 1);
    else out[arg.slice(2)] = argv[++i];
  }
  return out;
}

function num(name: string, fallback: number): number {
  const raw = args[name];
  if (raw === undefined) return fallback;
  const value = Number(raw);
  if (!Number.isFinite(value) || value < 0) fail(`--${name} must be a non-negative number, got ${raw}`);
  return value;
}

function fail(message: string): never {
  console.error(`examples/demo/bot.ts: ${message}`);
  process.exit(2);
}
