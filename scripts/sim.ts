/**
 * The deterministic simulation of the durability engine, on MemoryDurability.
 *
 *   npm run sim -- --seed 42                 one seed, with its trace
 *   npm run sim -- --seeds 5000 --from 1     many seeds (2 worker processes), a summary
 *   options: --faults crash,lost-reply,...   only these fault kinds (see FAULT_KINDS)
 *            --lenient-ambiguity             an ambiguity with no provider call made or announced is counted, not a failure
 *                                            (the default fails it: a crash before the call's announcement is sent again)
 *            --lenient-timeouts              a duplicate send after a call accepted-then-timed-out is counted, not a failure
 *                                            (the default fails it: a timeout is held as ambiguous or reported)
 *            --workers N                     worker processes for --seeds (default 2)
 *            --quiet                         --seed: no trace, only the verdict
 *            --verbose                       --seed: trace heartbeats and reads too
 *            --check-determinism             run every seed twice; a different trace is a failure
 *            --max-print N                   --seeds: failing seeds listed (default 20)
 *
 * Only MemoryDurability is wired: new KvDurability(new MemoryKv()) waits real time
 * (`delay(Math.random() …)`) on compare-and-set races, which would break determinism.
 * Exit code 1 when any seed fails.
 */
import { MemoryDurability } from "../backends/memory/durability.ts";
import { FAULT_KINDS, parseFaults, runSimulation, type SimResult } from "../src/testing/sim/mod.ts";

interface Args {
  seed?: number;
  seeds?: number;
  from: number;
  stride: number;
  faults?: string;
  strict: boolean;
  strictTimeouts: boolean;
  workers: number;
  worker: boolean;
  quiet: boolean;
  verbose: boolean;
  twice: boolean;
  maxPrint: number;
}

function parseArgs(argv: string[]): Args {
  const args: Args = { from: 1, stride: 1, strict: true, strictTimeouts: true, workers: 2, worker: false, quiet: false, verbose: false, twice: false, maxPrint: 20 };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i]!;
    const value = () => {
      const v = argv[++i];
      if (v === undefined) throw new Error(`${a} needs a value`);
      return v;
    };
    const int = () => {
      const v = Number(value());
      if (!Number.isInteger(v) || v < 0) throw new Error(`${a} needs a non-negative integer`);
      return v;
    };
    switch (a) {
      case "--seed": args.seed = int(); break;
      case "--seeds": args.seeds = int(); break;
      case "--from": args.from = int(); break;
      case "--stride": args.stride = Math.max(1, int()); break;
      case "--faults": args.faults = value(); break;
      case "--strict-ambiguity": args.strict = true; break;
      case "--lenient-ambiguity": args.strict = false; break;
      case "--strict-timeouts": args.strictTimeouts = true; break;
      case "--lenient-timeouts": args.strictTimeouts = false; break;
      case "--workers": args.workers = Math.max(1, int()); break;
      case "--worker": args.worker = true; break;
      case "--quiet": args.quiet = true; break;
      case "--verbose": args.verbose = true; break;
      case "--check-determinism": args.twice = true; break;
      case "--max-print": args.maxPrint = int(); break;
      case "--help":
      case "-h":
        console.log(`usage: npm run sim -- (--seed N | --seeds N [--from S]) [--faults ${FAULT_KINDS.join(",")}] [--lenient-ambiguity] [--lenient-timeouts] [--workers N]`);
        process.exit(0);
        break;
      default:
        throw new Error(`unknown argument ${a} (try --help)`);
    }
  }
  return args;
}

const args = parseArgs(process.argv.slice(2));
const faults = args.faults === undefined ? undefined : parseFaults(args.faults);
const create = (serverNow: () => number) => new MemoryDurability({ clock: serverNow });
const flags = [
  ...(args.faults !== undefined ? [`--faults ${args.faults}`] : []),
  ...(args.strict ? [] : ["--lenient-ambiguity"]),
  ...(args.strictTimeouts ? [] : ["--lenient-timeouts"]),
].join(" ");
const replay = (seed: number) => `npm run sim -- --seed ${seed}${flags ? ` ${flags}` : ""}`;

async function run(seed: number): Promise<SimResult> {
  const options = { seed, faults, strictAmbiguity: args.strict, strictTimeouts: args.strictTimeouts, verbose: args.verbose };
  const result = await runSimulation(create, options);
  if (args.twice) {
    const again = await runSimulation(create, options);
    const i = result.trace.findIndex((line, n) => again.trace[n] !== line);
    if (i >= 0 || again.trace.length !== result.trace.length) {
      const at = i >= 0 ? i : Math.min(result.trace.length, again.trace.length);
      result.failures.push({
        invariant: "nondeterministic",
        detail: `the second run's trace differs at line ${at + 1}: ${JSON.stringify(result.trace[at])} vs ${JSON.stringify(again.trace[at])}`,
      });
      result.ok = false;
    }
  }
  return result;
}

interface Row {
  seed: number;
  failures: { invariant: string; detail: string }[];
  faults: Record<string, number>;
  ambiguity: SimResult["ambiguity"];
  timeoutDuplicates: number;
  calls: number;
  steps: SimResult["stepCalls"];
}

if (args.worker) {
  const out: string[] = [];
  for (let i = 0; i < (args.seeds ?? 0); i++) {
    const seed = args.from + i * args.stride;
    const r = await run(seed);
    const row: Row = { seed, failures: r.failures, faults: r.faults, ambiguity: r.ambiguity, timeoutDuplicates: r.timeoutDuplicates, calls: r.providerCalls, steps: r.stepCalls };
    out.push(JSON.stringify(row));
    if (out.length >= 50) {
      process.stdout.write(out.join("\n") + "\n");
      out.length = 0;
    }
  }
  if (out.length > 0) process.stdout.write(out.join("\n") + "\n");
  process.exit(0);
}

if (args.seed !== undefined) {
  const r = await run(args.seed);
  if (!args.quiet) for (const line of r.trace) console.log(line);
  console.log("");
  console.log(`seed ${r.seed}: ${r.ok ? "ok" : `FAILED (${r.failures.length})`} — ${r.scenario}`);
  console.log(`virtual ${(r.virtualMs / 1000).toFixed(1)}s, ${r.steps} timer steps, ${r.providerCalls} provider calls, ${r.stepCalls.calls} step calls (${r.stepCalls.effects} took effect, ${r.stepCalls.ambiguous} ambiguity reports)`);
  console.log(`faults: ${JSON.stringify(r.faults)}; ambiguity: ${JSON.stringify(r.ambiguity)}; duplicates after an accepted timeout: ${r.timeoutDuplicates}`);
  for (const f of r.failures) console.log(`  ${f.invariant}: ${f.detail}`);
  if (!r.ok) console.log(`replay: ${replay(r.seed)}`);
  process.exit(r.ok ? 0 : 1);
}

if (args.seeds === undefined) {
  console.error("give --seed N or --seeds N (try --help)");
  process.exit(2);
}

const started = performance.now();
const total = args.seeds;
const workers = Math.min(args.workers, Math.max(1, total));
const rows: Row[] = [];
if (workers === 1) {
  for (let i = 0; i < total; i++) {
    const seed = args.from + i;
    const r = await run(seed);
    rows.push({ seed, failures: r.failures, faults: r.faults, ambiguity: r.ambiguity, timeoutDuplicates: r.timeoutDuplicates, calls: r.providerCalls, steps: r.stepCalls });
  }
} else {
  const children = [];
  for (let w = 0; w < workers; w++) {
    const count = Math.floor(total / workers) + (w < total % workers ? 1 : 0);
    const cmd = [
      process.execPath,
      import.meta.path,
      "--worker",
      "--from",
      String(args.from + w),
      "--stride",
      String(workers),
      "--seeds",
      String(count),
      ...(args.faults !== undefined ? ["--faults", args.faults] : []),
      ...(args.strict ? [] : ["--lenient-ambiguity"]),
      ...(args.strictTimeouts ? [] : ["--lenient-timeouts"]),
      ...(args.twice ? ["--check-determinism"] : []),
    ];
    const child = Bun.spawn(cmd, { stdout: "pipe", stderr: "inherit" });
    children.push((async () => {
      const text = await new Response(child.stdout).text();
      const code = await child.exited;
      if (code !== 0) throw new Error(`worker ${w} exited with ${code}`);
      for (const line of text.split("\n")) if (line.trim() !== "") rows.push(JSON.parse(line) as Row);
    })());
  }
  await Promise.all(children);
}
rows.sort((a, b) => a.seed - b.seed);
const wallMs = performance.now() - started;

const byInvariant = new Map<string, { seeds: number; example: number; detail: string }>();
const faultTotals: Record<string, number> = {};
const ambiguity: Record<string, number> = {};
let failed = 0;
let calls = 0;
let timeoutDuplicates = 0;
const steps = { calls: 0, effects: 0, ambiguous: 0 };
for (const row of rows) {
  calls += row.calls;
  steps.calls += row.steps.calls;
  steps.effects += row.steps.effects;
  steps.ambiguous += row.steps.ambiguous;
  timeoutDuplicates += row.timeoutDuplicates;
  for (const [k, n] of Object.entries(row.faults)) faultTotals[k] = (faultTotals[k] ?? 0) + n;
  for (const [k, n] of Object.entries(row.ambiguity)) ambiguity[k] = (ambiguity[k] ?? 0) + n;
  if (row.failures.length > 0) failed++;
  const seen = new Set<string>();
  for (const f of row.failures) {
    if (seen.has(f.invariant)) continue;
    seen.add(f.invariant);
    const entry = byInvariant.get(f.invariant);
    if (entry) entry.seeds++;
    else byInvariant.set(f.invariant, { seeds: 1, example: row.seed, detail: f.detail });
  }
}

console.log(`seeds ${args.from}..${args.from + total - 1}: ${total - failed} ok, ${failed} failed`);
console.log(`wall ${(wallMs / 1000).toFixed(1)}s, ${(total / (wallMs / 1000)).toFixed(0)} seeds/s (${workers} worker(s)), ${calls} provider calls`);
console.log(`step calls at the fake service: ${steps.calls} (${steps.effects} took effect); steps reported ambiguous: ${steps.ambiguous}`);
console.log(`faults injected: ${Object.entries(faultTotals).sort().map(([k, n]) => `${k} ${n}`).join(", ") || "none"}`);
const amb = (k: string) => ambiguity[k] ?? 0;
console.log(
  `ambiguity transitions: ${amb("call")} after a real provider call, ${amb("announced")} after a journaled announcement with no call (a crash or stall between the two), ${amb("inherited-call")} re-sends of an ambiguous call lost before their own call; ${amb("announced-not-called")} announced by a live holder that never called; with no call announced: ${
    amb("crash-before-call")
  } from a crash, ${amb("stalled-before-call")} from a stall, ${amb("lost-grant")} from a lost grant, ${
    amb("held")
  } from lost heartbeats${args.strict ? " (each a failure)" : " (counted; --lenient-ambiguity)"}`,
);
console.log(
  `duplicate sends after a call the channel accepted but that timed out (the engine retried it): ${timeoutDuplicates}${
    args.strictTimeouts ? " (each is a failure; --lenient-timeouts counts them)" : " (counted, --lenient-timeouts)"
  }`,
);
if (byInvariant.size > 0) {
  console.log("failures by invariant (seeds, example):");
  for (const [inv, e] of [...byInvariant].sort((a, b) => b[1].seeds - a[1].seeds)) {
    console.log(`  ${inv}: ${e.seeds} seed(s), e.g. ${replay(e.example)}`);
    console.log(`      ${e.detail}`);
  }
  console.log("failing seeds:");
  for (const row of rows.filter((r) => r.failures.length > 0).slice(0, args.maxPrint)) {
    console.log(`  ${replay(row.seed)}   # ${[...new Set(row.failures.map((f) => f.invariant))].join(", ")}`);
  }
}
process.exit(failed > 0 ? 1 : 0);
