/**
 * The crash demo: `npm run demo` (or `bun examples/demo/main.ts`, or
 * `deno run -A examples/demo/main.ts`).
 *
 * Streams a few hundred messages from many chats into a file channel
 * (`examples/file_channel.ts`) at a steady pace, runs the bot
 * (`examples/demo/bot.ts`) as a child process, kills it with SIGKILL at random
 * moments and restarts it with the same instanceId, waits until all work has
 * settled, and checks the channel's output: every message handled, every
 * reply delivered once, or reported as ambiguous (the one window the library
 * cannot close: a kill between the channel call and recording its result).
 *
 * Flags: `--backend sqlite|file` (default sqlite), `--messages N` (400),
 * `--chats N` (40), `--kills N` (5), `--seed N` (random), `--data <dir>`
 * (default: a fresh temp dir), `--stream-ms N` (how long the messages take to
 * arrive, default 15000), `--json` (end with a one-line JSON summary),
 * `--quiet` (no timeline).
 *
 * Exits 1 when a message was not handled, a reply was lost or unexpected, or
 * a reply reached the channel twice without being reported as ambiguous.
 *
 * @module
 */
import { type ChildProcess, spawn } from "node:child_process";
import { mkdir, mkdtemp, readFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";
import { openJsonLinesAppender, type OutboundLine, readJsonLines } from "../file_channel.ts";

// ---- flags ------------------------------------------------------------------

const flags = parseFlags(process.argv.slice(2));
const backend = flags.string("backend", "sqlite");
if (backend !== "sqlite" && backend !== "file") usage(`--backend must be sqlite or file, got ${backend}`);
const messageCount = flags.int("messages", 400, 1);
const chatCount = flags.int("chats", 40, 1);
const kills = flags.int("kills", 5, 0);
const seed = flags.int("seed", Math.floor(Math.random() * 1_000_000), 0);
const streamMs = flags.int("stream-ms", 15_000, 0);
const json = flags.bool("json");
const quiet = flags.bool("quiet");
const confirm = flags.bool("confirm");
const data = flags.string("data", "") || await mkdtemp(join(tmpdir(), "botmesh-demo-"));
flags.done();
await mkdir(data, { recursive: true });

const BOT = fileURLToPath(new URL("./bot.ts", import.meta.url));
const INSTANCE = "demo-bot";
const INBOUND = join(data, "inbound.jsonl");
const OUTBOUND = join(data, "outbound.jsonl");
const AMBIGUOUS = join(data, "ambiguous.jsonl");
const CALLS = join(data, "calls.log");
/** The whole run must finish within this; a stuck run fails instead of hanging. */
const DEADLINE_MS = 120_000;

// ---- the script: messages and kill times, all from the seed -------------------

const random = mulberry32(seed);
interface Planned {
  id: string;
  chatId: string;
  text: string;
  /** Replies the handler makes (2 when the text says "twice"). */
  replies: number;
  /** When it arrives, ms after the start. */
  at: number;
}
const pad = (n: number, of: number) => String(n).padStart(String(of).length, "0");
const plan: Planned[] = [];
for (let i = 1; i <= messageCount; i++) {
  const twice = random() < 0.5;
  plan.push({
    id: `msg-${pad(i, messageCount)}`,
    chatId: `chat-${pad(1 + Math.floor(random() * chatCount), chatCount)}`,
    text: twice ? `hello #${i}, reply twice` : `hello #${i}`,
    replies: twice ? 2 : 1,
    at: Math.round(((i - 1) / messageCount) * streamMs),
  });
}
/** Kill moments: one in each of `kills` equal slots of the stream, at a random point of it. */
const killAt = Array.from({ length: kills }, (_, k) => Math.round(streamMs * (k + 0.15 + 0.7 * random()) / kills));
const expectedKeys = new Set(plan.flatMap((m) => Array.from({ length: m.replies }, (_, n) => `${m.id}:${n + 1}`)));

// ---- the timeline ------------------------------------------------------------

const t0 = performance.now();
const elapsed = () => performance.now() - t0;
const stamp = () => `[${(elapsed() / 1000).toFixed(1).padStart(5)}s]`;
const log = (line: string) => {
  if (!quiet) console.log(`  ${stamp()} ${line}`);
};
const deadline = setTimeout(() => {
  console.error(`demo: did not finish within ${DEADLINE_MS / 1000} s; data left in ${data}`);
  child?.process.kill("SIGKILL");
  process.exit(1);
}, DEADLINE_MS);

console.log(
  `@botmesh/durable crash demo: ${backend} backend, ${messageCount} messages from ${chatCount} chats, ` +
    `${kills} SIGKILLs, seed ${seed}`,
);
console.log(
  `  data: ${data} (inbound.jsonl, outbound.jsonl = what reached the channel, ambiguous.jsonl, ` +
    `${backend === "sqlite" ? "bot.db" : "journal.json"})`,
);

// ---- the bot child -------------------------------------------------------------

interface Child {
  process: ChildProcess;
  pid: number;
  exited: Promise<number | null>;
  /** Resolves with the next line of this type. */
  next(type: string): Promise<Record<string, any>>;
  /** When it said it was ready (ms on the demo's clock). */
  readyAt: number;
  /** Its metrics right after recovery (its first sweep). */
  recovered: Record<string, number>;
  /** The last metrics it reported. */
  lastMetrics: Record<string, number> | undefined;
}
let child: Child | undefined;
const runs: Child[] = [];
/** Children the demo itself kills or stops; any other exit is a failure. */
const expectExit = new Set<ChildProcess>();

async function startBot(): Promise<Child> {
  const proc = spawn(process.execPath, [
    ...("Deno" in globalThis ? ["run", "-A"] : []), // the bot runs on the demo's runtime (Bun, or Deno)
    BOT,
    "--backend", backend,
    "--data", data,
    "--instance", INSTANCE,
    "--latency-ms", "10",
    "--metrics-ms", "100",
    ...(confirm ? ["--confirm", "yes"] : []),
  ], { stdio: ["pipe", "pipe", "pipe"] });
  const waiting = new Map<string, (line: Record<string, any>) => void>();
  const c: Child = {
    process: proc,
    pid: proc.pid ?? -1,
    exited: new Promise((resolve) =>
      proc.on("exit", (code, signal) => {
        if (!expectExit.has(proc)) {
          console.error(`demo: the bot (pid ${proc.pid}) exited on its own (code ${code}, signal ${signal}); data left in ${data}`);
          process.exit(1);
        }
        resolve(code);
      })
    ),
    readyAt: 0,
    recovered: {},
    lastMetrics: undefined,
    next: (type) => new Promise((resolve) => waiting.set(type, resolve)),
  };
  createInterface({ input: proc.stdout! }).on("line", (text) => {
    let line: Record<string, any>;
    try {
      line = JSON.parse(text);
    } catch {
      return;
    }
    if (line.metrics) c.lastMetrics = line.metrics;
    const resolve = waiting.get(line.type);
    waiting.delete(line.type);
    resolve?.(line);
  });
  createInterface({ input: proc.stderr! }).on("line", (text) => console.error(`    bot(${c.pid}): ${text}`));
  const readyLine = await c.next("ready"); // an exit before it is a failure (see `exited`)
  c.readyAt = elapsed();
  c.recovered = readyLine.metrics ?? {};
  runs.push(c);
  return c;
}

// ---- the run ---------------------------------------------------------------------

const inbound = await openJsonLinesAppender(INBOUND);
let written = 0;
const streaming = (async () => {
  while (written < plan.length) {
    while (written < plan.length && plan[written]!.at <= elapsed()) {
      const { id, chatId, text } = plan[written++]!;
      await inbound.append({ id, chatId, text });
    }
    await sleep(5);
  }
})();

child = await startBot();
log(`bot started (pid ${child.pid})`);
let crashes = 0;
for (const at of killAt) {
  await sleep(Math.max(at - elapsed(), child.readyAt + 150 - elapsed())); // each run does some work first
  const victim = child;
  const replies = (await readJsonLines(OUTBOUND)).lines.length;
  expectExit.add(victim.process);
  victim.process.kill("SIGKILL");
  await victim.exited;
  crashes++;
  const downAt = elapsed();
  child = await startBot();
  const took = ((elapsed() - downAt) / 1000).toFixed(2);
  const back = child.recovered.inboundReplayed ?? 0;
  const unsure = child.recovered.outboxAmbiguous ?? 0;
  log(
    `kill -9 ${victim.pid} at ${written}/${messageCount} messages in, ${replies} replies out; ` +
      `restarted as ${child.pid} in ${took} s: took back ${back} message${back === 1 ? "" : "s"}` +
      (unsure ? `, ${unsure} send${unsure === 1 ? "" : "s"} ambiguous` : ""),
  );
}
await streaming;
await inbound.close();
log(`all ${messageCount} messages in; waiting for the bot to settle`);
const settledLine = child.next("settled");
child.process.stdin!.write("settle\n");
const settled = await settledLine;
const took = elapsed();
const stoppedLine = child.next("stopped");
expectExit.add(child.process);
child.process.stdin!.write("stop\n");
const stopped = await stoppedLine;
await child.exited;
clearTimeout(deadline);
log(`settled; bot stopped`);

// ---- the check ---------------------------------------------------------------------

const out = await readJsonLines<OutboundLine>(OUTBOUND);
const reportedEvents = new Set((await readJsonLines<{ key: string }>(AMBIGUOUS)).lines.map((e) => e.key));
const journal = settled.journal as {
  inboundDone: number;
  inboundDead: string[];
  inboundActive: number;
  outboxSent: number;
  outboxUnknown: string[];
  outboxDead: string[];
  outboxActive: number;
};
// Reported: an ambiguous event was written, or the journal lists the send as `unknown` (the event
// dies with a process killed right after the transition; the journal entry stays for an operator).
const reported = new Set([...reportedEvents, ...journal.outboxUnknown]);
const atChannel = new Map<string, number>();
for (const line of out.lines) atChannel.set(line.key, (atChannel.get(line.key) ?? 0) + 1);

const delivered = [...expectedKeys].filter((k) => atChannel.has(k)).length;
const duplicateKeys = [...atChannel].filter(([, n]) => n > 1).map(([k]) => k);
const duplicates = duplicateKeys.reduce((sum, k) => sum + atChannel.get(k)! - 1, 0);
const silentDuplicates = duplicateKeys.filter((k) => !reported.has(k));
const lostKeys = [...expectedKeys].filter((k) => !atChannel.has(k) && !reported.has(k));
const unexpected = [...atChannel.keys()].filter((k) => !expectedKeys.has(k));
const ambiguous = [...reported].filter((k) => expectedKeys.has(k));
const ambiguousDelivered = ambiguous.filter((k) => atChannel.has(k)).length;
// The bot logs every channel call as it starts: an ambiguous send never called was held back for nothing.
const called = new Set((await readFile(CALLS, "utf8").catch(() => "")).split("\n").filter((k) => k !== ""));
const ambiguousUncalled = ambiguous.filter((k) => !called.has(k)).length;
const handled = journal.inboundDone;

const summed: Record<string, number> = {};
for (const run of runs) {
  for (const [name, value] of Object.entries(run === child ? stopped.metrics : run.lastMetrics ?? {})) {
    if (typeof value === "number") summed[name] = (summed[name] ?? 0) + value;
  }
}
const finalMetrics = Object.fromEntries(
  Object.entries(stopped.metrics as Record<string, unknown>).filter(([, v]) => typeof v === "number"),
) as Record<string, number>;

const problems: string[] = [];
if (handled !== messageCount) problems.push(`${messageCount - handled} message(s) not handled`);
if (journal.inboundDead.length) problems.push(`inbound DLQ: ${journal.inboundDead.join(", ")}`);
if (journal.outboxDead.length) problems.push(`outbound DLQ: ${journal.outboxDead.join(", ")}`);
if (lostKeys.length) problems.push(`lost replies: ${lostKeys.slice(0, 10).join(", ")}`);
if (silentDuplicates.length) problems.push(`sent twice without a report: ${silentDuplicates.slice(0, 10).join(", ")}`);
if (unexpected.length) problems.push(`unexpected replies: ${unexpected.slice(0, 10).join(", ")}`);

const row = (label: string, value: number | string, note = "") =>
  console.log(`  ${label.padEnd(26)}${String(value).padStart(7)}${note ? `   ${note}` : ""}`);
console.log("");
console.log("Result");
row("messages in", messageCount, `from ${chatCount} chats`);
row("messages handled", handled, `done in the journal; ${summed.inboundReplayed ?? 0} taken back after a kill`);
row("replies expected", expectedKeys.size);
row("replies delivered", delivered, `${out.lines.length} lines at the channel`);
row("duplicates at the channel", duplicates, `${duplicates - silentDuplicates.length} reported ambiguous, ${silentDuplicates.length} silent`);
row("lost", lostKeys.length);
row(
  "ambiguous (reported)",
  ambiguous.length,
  !ambiguous.length
    ? ""
    : confirm
    ? "each then settled by the channel (below)"
    : `${ambiguousDelivered} reached the channel, ${ambiguous.length - ambiguousDelivered - ambiguousUncalled} were in the call but did not, ${ambiguousUncalled} never called`,
);
if (confirm) row("settled by the channel", summed.outboxResolved ?? 0, "confirm: found in the channel's file, or certainly never sent");
row(
  "left for an operator",
  journal.outboxUnknown.length,
  confirm ? "still 'unknown' at the end" : "still 'unknown' at the end (the calls in flight at the kills)",
);
row("crashes (SIGKILL)", crashes, `${runs.length} runs of the bot`);
row("time taken", `${(took / 1000).toFixed(1)} s`);
if (ambiguous.length) {
  console.log("  (ambiguous: killed after the channel call was journaled as started, before its result was");
  console.log("   recorded; the bot cannot know whether it went out, so it reports it (durability:ambiguous)");
  console.log("   instead of guessing. A kill before the call was journaled is not ambiguous: it is sent again.)");
}
console.log("");
const show = (m: Record<string, number>) =>
  Object.entries(m).filter(([, v]) => v !== 0).map(([k, v]) => `${k} ${v}`).join(", ") || "all zero";
console.log(`Bot metrics, all ${runs.length} runs (a killed run as of its last report, <= 100 ms old): ${show(summed)}`);
console.log(`Bot metrics, last run: ${show(finalMetrics)}`);
console.log("");
if (problems.length === 0) {
  console.log(
    `PASS: every message handled; every reply delivered exactly once${ambiguous.length ? " or reported ambiguous" : ""}.`,
  );
} else {
  for (const p of problems) console.log(`FAIL: ${p}`);
}
if (json) {
  console.log(JSON.stringify({
    ok: problems.length === 0,
    backend,
    seed,
    messages: messageCount,
    chats: chatCount,
    handled,
    repliesExpected: expectedKeys.size,
    repliesDelivered: delivered,
    channelLines: out.lines.length,
    duplicates,
    silentDuplicates: silentDuplicates.length,
    lost: lostKeys.length,
    unexpected: unexpected.length,
    ambiguous: ambiguous.length,
    ambiguousDelivered,
    ambiguousEvents: reportedEvents.size,
    leftForOperator: journal.outboxUnknown.length,
    resolved: summed.outboxResolved ?? 0,
    ambiguousUncalled,
    inboundDead: journal.inboundDead.length,
    outboxDead: journal.outboxDead.length,
    crashes,
    runs: runs.length,
    ms: Math.round(took),
    metrics: summed,
    lastRunMetrics: finalMetrics,
    data,
  }));
}
process.exit(problems.length === 0 ? 0 : 1);

// ---- helpers ---------------------------------------------------------------------

function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, Math.max(0, ms)));
}

/** A small seeded PRNG (mulberry32): the same seed gives the same messages and kill times. */
function mulberry32(a: number): () => number {
  return () => {
    a = (a + 0x6d2b79f5) | 0;
    let t = Math.imul(a ^ (a >>> 15), 1 | a);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 2 ** 32;
  };
}

function parseFlags(argv: string[]) {
  const values = new Map<string, string | true>();
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i]!;
    if (!arg.startsWith("--")) usage(`unexpected argument ${arg}`);
    const eq = arg.indexOf("=");
    if (eq > 0) values.set(arg.slice(2, eq), arg.slice(eq + 1));
    else if (argv[i + 1] !== undefined && !argv[i + 1]!.startsWith("--")) values.set(arg.slice(2), argv[++i]!);
    else values.set(arg.slice(2), true);
  }
  const take = (name: string) => {
    const value = values.get(name);
    values.delete(name);
    return value;
  };
  return {
    string(name: string, fallback: string): string {
      const value = take(name);
      if (value === true) usage(`--${name} needs a value`);
      return value ?? fallback;
    },
    int(name: string, fallback: number, min: number): number {
      const value = take(name);
      if (value === undefined) return fallback;
      const n = Number(value);
      if (!Number.isInteger(n) || n < min) usage(`--${name} must be an integer >= ${min}, got ${value}`);
      return n;
    },
    bool(name: string): boolean {
      const value = take(name);
      if (value !== undefined && value !== true) usage(`--${name} takes no value`);
      return value === true;
    },
    done() {
      if (values.size) usage(`unknown flag(s): ${[...values.keys()].map((k) => `--${k}`).join(", ")}`);
    },
  };
}

function usage(message: string): never {
  console.error(`demo: ${message}`);
  console.error(
    "usage: bun examples/demo/main.ts [--backend sqlite|file] [--messages N] [--chats N] [--kills N] [--seed N] [--data DIR] [--stream-ms N] [--confirm] [--json] [--quiet]",
  );
  process.exit(2);
}
