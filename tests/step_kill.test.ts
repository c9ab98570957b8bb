// Durable steps under real SIGKILLs: a bot process (tests/fixtures/step_llm_bot.ts, on SQLite with the
// default durability settings) asks a fake LLM over HTTP inside `ctx.step("llm", …)`, passing the step's
// idempotencyKey as a header, and replies with the answer. The test streams messages from several chats
// into it while killing it with SIGKILL at seeded random moments (some aimed inside an LLM call, some
// before the restarted process is even ready) and starting it again on the same file; the last run
// drains everything (`bot.idle()`). Then, per message, from the fake servers' counts and the journal:
//   - the LLM was called once for it and its reply (that answer) went out once, or
//   - its step was cut off during the call: the attempt is `unknown`, reported `durability:ambiguous`
//     with `step: "llm"` (or, when the run that made it unknown was killed before it told, by the
//     message's dead letter naming the attempt), the message dead with StepAmbiguousError, no second
//     call, no reply;
// nothing else (nothing lost, nothing dead for another reason, no reply twice). The variant with
// `idempotent: true` must end every message done, the LLM (which deduplicates by key, as a provider
// honouring an Idempotency-Key does) called again only for an attempt cut off by a kill.
//
// The channel is the same fake server: a reply is a POST with its outbox key (the channel keeps each
// request), and the provider's `confirm` asks it whether a reply cut off by a kill arrived. The main
// test keeps every durability default (`onAmbiguous: "hold"`): a reply cut off during its call is then
// settled by `confirm` (sent again if it never arrived), or, when the run that found it was killed
// before `confirm` answered, held `unknown` for an operator, never sent twice. The idempotent variant
// runs with `onAmbiguous: "resend"` (as the plugins' kill tests do), under which every reply must arrive.
// A reply requested twice is allowed only where a run reported that send ambiguous (a killed run's
// request still on its way when the next one asked).
// STEP_KILL_SEED=<n> replays a kill schedule (the timings on a loaded machine vary).
import type { Subprocess } from "bun";
import { expect, test } from "bun:test";
import { join } from "node:path";
import { openBackend } from "../ops.ts";
import type { OutboxEntry } from "../backend.ts";
import { type ChildLines, childLines } from "./support/child_lines.ts";
import { killTestDir } from "./support/kill_harness.ts";

const FIXTURE = join(import.meta.dir, "fixtures", "step_llm_bot.ts");
const dir = killTestDir("step-kill", "STEP_KILL_KEEP");
const SEED = Number(process.env.STEP_KILL_SEED ?? Math.floor(Math.random() * 2 ** 31));

/** A seeded PRNG (mulberry32): values in [0, 1). */
function prng(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

/** One call the fake LLM got. */
interface LlmCall {
  key: string;
  /** The run (process) that made it. */
  incarnation: number;
  /** Its answer (fixed when it arrives; the same for every call of a key when the LLM deduplicates). */
  answer: string;
  /** How long the LLM takes to answer it. */
  delayMs: number;
  /** Whether the response was handed back (before that, the caller cannot have its result). */
  answered: boolean;
}

/** One send the fake channel got. */
interface ChannelSend {
  key: string;
  incarnation: number;
  chatId: string;
  content: unknown;
}

/** The fake LLM (`POST /llm`, 20–80 ms a call) and the fake channel (`POST /send`, `GET /confirm`) on loopback. */
class FakeWorld {
  /** LLM calls by idempotency key, in arrival order. */
  readonly calls = new Map<string, LlmCall[]>();
  /** Channel sends by outbox key, in arrival order. */
  readonly sends = new Map<string, ChannelSend[]>();
  readonly #random: () => number;
  readonly #dedupe: boolean;
  #wake: (() => void)[] = [];
  readonly #server: ReturnType<typeof Bun.serve>;

  /**
   * @param seed seeds the LLM's delays
   * @param dedupe the LLM answers every call of a key with its first answer
   */
  constructor(seed: number, dedupe: boolean) {
    this.#random = prng(seed);
    this.#dedupe = dedupe;
    this.#server = Bun.serve({ port: 0, hostname: "127.0.0.1", fetch: (request) => this.#handle(request) });
  }

  get url(): string {
    return `http://127.0.0.1:${this.#server.port}`;
  }

  stop(): Promise<void> {
    return this.#server.stop(true);
  }

  /** Every LLM call, in no particular order. */
  allCalls(): LlmCall[] {
    return [...this.calls.values()].flat();
  }

  /**
   * Resolves with what `find` finds once it finds something (re-checked at each request and every 25 ms),
   * `undefined` after `timeoutMs`.
   */
  async waitFor<T>(find: () => T | undefined, timeoutMs: number): Promise<T | undefined> {
    const end = Date.now() + timeoutMs;
    for (;;) {
      const found = find();
      if (found !== undefined || Date.now() > end) return found;
      await new Promise<void>((resolve) => {
        const timer = setTimeout(resolve, 25);
        this.#wake.push(() => (clearTimeout(timer), resolve()));
      });
    }
  }

  #notify(): void {
    const wake = this.#wake;
    this.#wake = [];
    for (const w of wake) w();
  }

  async #handle(request: Request): Promise<Response> {
    const url = new URL(request.url);
    const key = request.headers.get("idempotency-key") ?? "";
    const incarnation = Number(request.headers.get("x-incarnation"));
    if (url.pathname === "/confirm") {
      const sent = this.sends.get(url.searchParams.get("key") ?? "");
      return Response.json(sent ? { delivered: true, messageId: `msg-${sent[0]!.key}` } : { delivered: false });
    }
    let body: Record<string, unknown>;
    try {
      body = await request.json() as Record<string, unknown>;
    } catch {
      return new Response("cut off", { status: 400 }); // a killed caller's half request
    }
    if (url.pathname === "/send") {
      const list = this.sends.get(key) ?? [];
      this.sends.set(key, list);
      list.push({ key, incarnation, chatId: String(body.chatId), content: body.content }); // a repeat is not delivered again
      this.#notify();
      return Response.json({ messageId: `msg-${key}` });
    }
    if (url.pathname !== "/llm") return new Response("not found", { status: 404 });
    const list = this.calls.get(key) ?? [];
    this.calls.set(key, list);
    const answer = this.#dedupe && list.length > 0
      ? list[0]!.answer
      : `answer to ${JSON.stringify(body.prompt)} (${key}, call ${list.length + 1}, ${crypto.randomUUID().slice(0, 8)})`;
    const call: LlmCall = { key, incarnation, answer, delayMs: 20 + Math.floor(this.#random() * 61), answered: false };
    list.push(call);
    this.#notify();
    await Bun.sleep(call.delayMs);
    call.answered = true;
    return Response.json({ answer });
  }
}

/** One run of the bot. */
interface Run {
  readonly round: number;
  readonly child: Subprocess<"pipe", "pipe", "pipe">;
  readonly lines: ChildLines;
  readonly stderr: Promise<string>;
  /** Write a command to its stdin; `false` once it is gone. */
  command(command: object): boolean;
}

function spawnBot(db: string, url: string, round: number, idempotent: boolean, onAmbiguous: OnAmbiguous): Run {
  const child = Bun.spawn([process.execPath, FIXTURE, db, url, String(round), idempotent ? "1" : "0", onAmbiguous], {
    stdin: "pipe",
    stdout: "pipe",
    stderr: "pipe",
  });
  return {
    round,
    child,
    lines: childLines(child.stdout, `step bot, run ${round}`, 20_000),
    stderr: new Response(child.stderr).text(),
    command(command) {
      try {
        child.stdin.write(JSON.stringify(command) + "\n");
        void Promise.resolve(child.stdin.flush()).catch(() => {});
        return true;
      } catch {
        return false; // EPIPE: it died in the meantime
      }
    },
  };
}

type OnAmbiguous = "hold" | "resend";

interface Message {
  id: string;
  chatId: string;
  text: string;
}

/** How a run is killed: at a random moment after it is ready, inside an LLM call, or at a random moment after its spawn. */
type KillKind = "random" | "in-call" | "early";
const CYCLE: readonly KillKind[] = ["random", "in-call", "random", "early", "in-call", "random"];

/**
 * Runs begun (journaled) by a message's handler from which the kills spare it: once it has that many, a
 * kill waits until it is settled. The bot's crash-loop guard (default `inbox.retries`, kept) dead-letters
 * a message whose handler began 7 runs without an outcome, and kills at random moments with a backlog
 * would now and then cut the head of a chat's queue that often.
 */
const SPARE_AFTER = 4;

/** A kill, as it landed. */
interface Kill {
  round: number;
  kind: KillKind;
  /** The keys of the LLM calls of the killed run still unanswered at the kill. */
  inCall: string[];
  /** Whether the run had printed `ready`. */
  ready: boolean;
  /** Whether it waited for a message cut off {@link SPARE_AFTER} times to settle first. */
  spared: boolean;
}

/** What a kill run leaves for the checks. */
interface KillRunResult {
  messages: Message[];
  kills: Kill[];
  lines: string[];
  world: FakeWorld;
  db: string;
  ms: number;
}

/**
 * Run the bot `kills` times, each killed with SIGKILL, then once more to drain, while `count` messages
 * in `chats` chats reach it (each delivered again to each run until a run acknowledged it).
 */
async function killRun(
  name: string,
  options: { count: number; chats: number; kills: number; idempotent: boolean; onAmbiguous: OnAmbiguous; seed: number },
): Promise<KillRunResult> {
  const started = performance.now();
  const random = prng(options.seed);
  const world = new FakeWorld(options.seed ^ 0x5eed, options.idempotent);
  const db = join(dir, `${name}.db`);
  const messages: Message[] = Array.from({ length: options.count }, (_, i) => ({
    id: `m${String(i).padStart(3, "0")}`,
    chatId: `chat-${i % options.chats}`,
    text: `question ${i}`,
  }));
  // The schedule, drawn up front from the seed: each run's kind of kill, its moment, and the new
  // messages it is given (only runs killed after `ready` get new ones), each after a short pause.
  const kinds = Array.from({ length: options.kills }, (_, r) => CYCLE[r % CYCLE.length]!);
  const feeding = kinds.map((k, r) => (k === "early" ? -1 : r)).filter((r) => r >= 0);
  const batches = new Map<number, Message[]>();
  feeding.forEach((round, i) => {
    const from = Math.floor((i * options.count) / feeding.length);
    const to = Math.floor(((i + 1) * options.count) / feeding.length);
    batches.set(round, messages.slice(from, to));
  });
  const plan = kinds.map((kind) => ({
    kind,
    /** random: ms after ready; early: ms after the spawn; in-call: the fraction of the call's delay. */
    moment: kind === "random" ? random() * 400 : kind === "early" ? 10 + random() * 140 : random(),
    pauses: Array.from({ length: 8 }, () => random() * 60),
  }));

  const runs: Run[] = [];
  const kills: Kill[] = [];
  const introduced: Message[] = [];
  const aimedAt = new Set<string>();
  const allLines = () => runs.flatMap((r) => r.lines.all());
  const acked = () => {
    const ids = new Set<string>();
    for (const line of allLines()) {
      const [word, id, status] = line.split(" ");
      if (word === "ack" && status !== "rejected") ids.add(id!);
    }
    return ids;
  };
  /** Deliver what is not acknowledged yet, then this run's new messages a short pause apart. */
  const feed = async (run: Run, fresh: readonly Message[], pauses: readonly number[], stopped: () => boolean) => {
    const done = acked();
    for (const m of introduced) {
      if (!done.has(m.id) && !run.command({ op: "msg", ...m })) return;
    }
    for (const [i, m] of fresh.entries()) {
      await Bun.sleep(pauses[i % pauses.length]!);
      if (stopped()) return;
      introduced.push(m);
      if (!run.command({ op: "msg", ...m })) return;
    }
  };
  let journal: Awaited<ReturnType<typeof openBackend>> | null = null;
  /** Wait until no unsettled message has begun {@link SPARE_AFTER} runs (at most 15 s); whether it had to. */
  const spare = async (run: Run): Promise<boolean> => {
    if (journal === null) return false;
    const until = Date.now() + 15_000;
    for (let waited = false;; waited = true) {
      const records = await journal.backend.inbox.list({ limit: 10_000 });
      const often = records.some((r) => r.state !== "done" && r.state !== "dead" && r.attempts >= SPARE_AFTER);
      if (!often || run.child.exitCode !== null || Date.now() > until) return waited;
      await world.waitFor(() => undefined, 25); // a poll of the journal
    }
  };
  const failWith = async (run: Run, error: unknown): Promise<never> => {
    run.child.kill("SIGKILL");
    throw new Error(`${(error as Error).message}\nstderr of run ${run.round}: ${(await run.stderr).slice(-3000)}`);
  };

  try {
    for (const [round, { kind, moment, pauses }] of plan.entries()) {
      const run = spawnBot(db, world.url, round, options.idempotent, options.onAmbiguous);
      runs.push(run);
      let killed = false;
      let feeding: Promise<void> = Promise.resolve();
      if (kind === "early") {
        await Bun.sleep(moment); // a random moment of its start (maybe its recovery), ready or not
      } else {
        await run.lines.next("ready").catch((error) => failWith(run, error));
        feeding = feed(run, batches.get(round) ?? [], pauses, () => killed);
        if (kind === "random") {
          await Bun.sleep(moment);
        } else {
          // Inside a call: once the LLM got one from this run (for a key not aimed at before), a random
          // part of the way into the LLM's delay, before it answers.
          const call = await world.waitFor(
            () => world.allCalls().find((c) => c.incarnation === round && !c.answered && !aimedAt.has(c.key)),
            5_000,
          );
          if (call !== undefined) {
            aimedAt.add(call.key);
            await Bun.sleep(moment * Math.max(0, call.delayMs - 8));
          }
        }
      }
      const spared = await spare(run);
      killed = true;
      run.child.kill("SIGKILL");
      const inCall = world.allCalls().filter((c) => c.incarnation === round && !c.answered).map((c) => c.key);
      for (const key of inCall) aimedAt.add(key); // an aimed kill picks a step no kill cut off before
      await run.child.exited;
      await run.lines.ended;
      await feeding;
      if (run.child.signalCode !== "SIGKILL") await failWith(run, new Error(`run ${round} ended by itself (${run.child.exitCode})`));
      kills.push({ round, kind, inCall, ready: run.lines.all().includes("ready"), spared });
      journal ??= await openBackend(`sqlite:${db}`); // (its tables exist once a run was ready)
    }

    // The last run: everything still unacknowledged (and anything never given) is delivered, then it drains.
    const last = spawnBot(db, world.url, plan.length, options.idempotent, options.onAmbiguous);
    runs.push(last);
    await last.lines.next("ready").catch((error) => failWith(last, error));
    for (const m of messages) if (!introduced.includes(m)) introduced.push(m);
    await feed(last, [], [], () => false);
    await world.waitFor(() => (acked().size === messages.length ? true : undefined), 30_000);
    if (acked().size !== messages.length) {
      await failWith(last, new Error(`only ${acked().size} of ${messages.length} messages acknowledged`));
    }
    last.command({ op: "settle" });
    await last.lines.next("settled", 45_000).catch((error) => failWith(last, error));
    last.command({ op: "stop" });
    const code = await last.child.exited;
    await last.lines.ended;
    if (code !== 0) await failWith(last, new Error(`the last run exited ${code}`));
    return { messages, kills, lines: allLines(), world, db, ms: performance.now() - started };
  } finally {
    for (const run of runs) run.child.kill("SIGKILL");
    await world.stop();
    await journal?.close();
    // What each run printed and how it was killed, next to its file (kept with STEP_KILL_KEEP=1).
    const log = runs.map((run) => [`--- run ${run.round}: ${JSON.stringify(kills.find((k) => k.round === run.round) ?? "last")}`, ...run.lines.all()].join("\n"));
    await Bun.write(`${db}.log`, `${log.join("\n")}\n--- LLM calls\n${world.allCalls().map((c) => JSON.stringify(c)).join("\n")}\n`);
  }
}

/** A step's attempts in the journal: `<key>`, `<key>#2`, … */
async function attemptsOf(outbox: { get(key: string): Promise<OutboxEntry | null> }, key: string): Promise<OutboxEntry[]> {
  const attempts: OutboxEntry[] = [];
  for (let n = 1;; n++) {
    const entry = await outbox.get(n === 1 ? key : `${key}#${n}`);
    if (entry === null) return attempts;
    attempts.push(entry);
  }
}

/** The journaled result of a step attempt (`{"v": …}`), `undefined` for none. */
function resultOf(entry: OutboxEntry): unknown {
  try {
    return (JSON.parse(entry.messageId ?? "") as { v?: unknown }).v;
  } catch {
    return undefined; // "botmesh:step-not-run": an attempt that never called
  }
}

/** The `durability:dead` events of every run. */
function deadReports(lines: readonly string[]): { kind: string; id: string; error: string }[] {
  return lines.filter((l) => l.startsWith("dead ")).map((l) => JSON.parse(l.slice("dead ".length)));
}

/** The `durability:ambiguous` reports of every run. */
function ambiguousReports(lines: readonly string[]): { key: string; chatId: string; step?: string }[] {
  return lines.filter((l) => l.startsWith("ambiguous ")).map((l) => JSON.parse(l.slice("ambiguous ".length)));
}

/**
 * The reply of a message that is done: at the channel once, with the recorded answer, in its chat
 * (requested twice only where the send was reported ambiguous); under `hold`, possibly held `unknown`
 * instead (cut off during its call, the channel's answer to `confirm` lost with the run that asked).
 * @returns whether it was held
 */
function checkReply(
  where: string,
  m: Message,
  replies: readonly ChannelSend[],
  answer: string,
  reports: ReturnType<typeof ambiguousReports>,
  entry: OutboxEntry | null,
  onAmbiguous: OnAmbiguous,
): boolean {
  expect(entry, `${where}: its reply is journaled`).not.toBe(null);
  for (const reply of replies) {
    expect(reply.content, `${where}: the reply is the recorded answer`).toBe(answer);
    expect(reply.chatId).toBe(m.chatId);
  }
  if (replies.length > 1) {
    expect(replies.length, `${where}: a reply requested again once at most`).toBe(2);
    expect(reports.some((r) => r.key === replies[0]!.key && r.step === undefined), `${where}: a reply requested twice was reported ambiguous`).toBe(true);
  }
  if (replies.length > 0) return false;
  expect(onAmbiguous, `${where}: its reply went out`).toBe("hold");
  expect(entry!.state, `${where}: a reply that did not go out is held as unknown`).toBe("unknown");
  return true;
}

test(`a step calling an LLM, SIGKILLed 26 times while 60 messages of 4 chats stream in: each LLM call once or reported ambiguous, each reply once (seed ${SEED})`, async () => {
  const { messages, kills, lines, world, db, ms } = await killRun("steps", { count: 60, chats: 4, kills: 26, idempotent: false, onAmbiguous: "hold", seed: SEED });
  const reports = ambiguousReports(lines);
  const reportedSteps = new Set(reports.filter((r) => r.step !== undefined).map((r) => r.key));
  const opened = await openBackend(`sqlite:${db}`);
  let done = 0;
  let ambiguous = 0;
  const deadIds = new Set<string>();
  let notRun = 0;
  let held = 0;
  /** Step attempts whose ambiguity the message's dead letter names. */
  const deadLetteredAttempts = new Set<string>();
  try {
    for (const m of messages) {
      const where = `message ${m.id} (seed ${SEED})`;
      const record = await opened.backend.inbox.get(m.id);
      const key = `${m.id}:step:llm`;
      const attempts = await attemptsOf(opened.backend.outbox, key);
      const calls = world.calls.get(key) ?? [];
      const replies = world.sends.get(`${m.id}:1`) ?? [];
      expect(record?.state, `${where}: done or dead, nothing lost`).toBeOneOf(["done", "dead"]);
      expect(attempts.length, `${where}: its step is journaled`).toBeGreaterThan(0);
      const final = attempts.at(-1)!;
      // Earlier attempts were cut off before their call (settled as never run): the next one called.
      for (const early of attempts.slice(0, -1)) expect(early.messageId, `${where}: an earlier attempt never ran`).toBe("botmesh:step-not-run");
      if (attempts.length > 1) notRun++;
      expect(calls.length, `${where}: the LLM is never called twice for a step that is not idempotent`).toBeLessThanOrEqual(1);
      if (record!.state === "done") {
        done++;
        expect(final.state, `${where}: its step's result is recorded`).toBe("sent");
        expect(calls.length, `${where}: the LLM was called once`).toBe(1);
        expect(resultOf(final), `${where}: the recorded result is the LLM's answer`).toBe(calls[0]!.answer);
        if (checkReply(where, m, replies, calls[0]!.answer, reports, await opened.backend.outbox.get(`${m.id}:1`), "hold")) held++;
      } else {
        ambiguous++;
        deadIds.add(m.id);
        expect(record!.error ?? "", `${where}: dead only for an ambiguous step`).toStartWith(`StepAmbiguousError: Step "llm" may have run`);
        expect(final.state, `${where}: the step's attempt is held as unknown`).toBe("unknown");
        // Reported: by durability:ambiguous (step "llm"), or, when the process that made it unknown was killed
        // before it told, by the message's own dead letter, which names the attempt.
        const deadLetter = deadReports(lines).some((d) => d.kind === "inbound" && d.id === m.id && d.error.includes(`"${final.key}"`));
        if (deadLetter) deadLetteredAttempts.add(final.key);
        expect(reportedSteps.has(final.key) || deadLetter, `${where}: the ambiguity was reported (durability:ambiguous, or the dead letter)`).toBe(true);
        expect(replies, `${where}: no reply for a message whose step is in question`).toEqual([]);
      }
    }
  } finally {
    await opened.close();
  }
  // Every ambiguous step report is about one of these steps, named; every send at the channel is one of the replies.
  for (const r of reports.filter((r) => r.step !== undefined)) {
    expect(r.step).toBe("llm");
    expect(messages.some((m) => r.key.startsWith(`${m.id}:step:llm`))).toBe(true);
  }
  expect([...world.sends.keys()].every((k) => messages.some((m) => k === `${m.id}:1`))).toBe(true);
  // A kill that landed while an LLM call was unanswered: that step must be the ambiguous one, reported
  // as above (durability:ambiguous, or the dead letter when the run that made it unknown died first).
  // (The LLM sees the step's key; a report names the attempt: `<key>`, or `<key>#<n>` after attempts that never ran.)
  const landed = kills.flatMap((k) => k.inCall);
  const reportedStepKeys = new Set([...reportedSteps, ...deadLetteredAttempts].map((attempt) => attempt.replace(/#\d+$/, "")));
  for (const key of landed) {
    expect(deadIds.has(key.slice(0, key.indexOf(":"))), `the message of step ${key}, killed inside its LLM call, is dead`).toBe(true);
    expect(reportedStepKeys.has(key), `step ${key}, killed inside its LLM call, is reported`).toBe(true);
  }
  const calls = world.allCalls().length;
  const replySendsAmbiguous = reports.filter((r) => r.step === undefined).length;
  console.log(
    `step kill (seed ${SEED}): ${kills.length} SIGKILLs (${kills.filter((k) => k.kind === "in-call").length} aimed inside an LLM call, ` +
      `${kills.filter((k) => k.inCall.length > 0).length} landed inside one, ${kills.filter((k) => !k.ready).length} before ready, ${kills.filter((k) => k.spared).length} put off for a message cut off ${SPARE_AFTER} times), ` +
      `${messages.length} messages: ${done} done, ${ambiguous} dead as ambiguous steps (${reportedSteps.size} step reports), ${notRun} steps run by a later attempt (one cut off before its call); ` +
      `${calls} LLM calls, ${world.sends.size} replies delivered (${[...world.sends.values()].flat().length} requests; ${replySendsAmbiguous} reply sends reported ambiguous, ${held} held unknown); ` +
      `${(ms / 1000).toFixed(1)} s`,
  );
  // The aimed kills wait for a call of the run to reach the LLM and kill it before the LLM answers, so
  // the ambiguous path is exercised in every run of this test (an aimed run whose backlog made no call
  // within 5 s is killed anyway, hence "at least one").
  expect(landed.length).toBeGreaterThanOrEqual(1);
  expect(ambiguous).toBeGreaterThanOrEqual(1);
  expect(done).toBeGreaterThanOrEqual(1);
}, 120_000);

test(`an idempotent step SIGKILLed 12 times while 30 messages stream in: every message done, its reply once, the LLM called again only after a cut-off call (seed ${SEED})`, async () => {
  const { messages, kills, lines, world, db, ms } = await killRun("idempotent", { count: 30, chats: 3, kills: 12, idempotent: true, onAmbiguous: "resend", seed: SEED + 1 });
  const reports = ambiguousReports(lines);
  const opened = await openBackend(`sqlite:${db}`);
  let again = 0;
  let maxCalls = 0;
  try {
    for (const m of messages) {
      const where = `message ${m.id} (seed ${SEED + 1})`;
      const record = await opened.backend.inbox.get(m.id);
      const key = `${m.id}:step:llm`;
      const attempts = await attemptsOf(opened.backend.outbox, key);
      const calls = world.calls.get(key) ?? [];
      const replies = world.sends.get(`${m.id}:1`) ?? [];
      expect(record?.state, `${where}: done`).toBe("done");
      const final = attempts.at(-1)!;
      expect(final.state, `${where}: its step's result is recorded`).toBe("sent");
      expect(calls.length, `${where}: the LLM was called`).toBeGreaterThanOrEqual(1);
      expect(new Set(calls.map((c) => c.answer)).size, `${where}: the LLM deduplicated by key`).toBe(1);
      expect(resultOf(final), `${where}: the recorded result is the LLM's answer`).toBe(calls[0]!.answer);
      checkReply(where, m, replies, calls[0]!.answer, reports, await opened.backend.outbox.get(`${m.id}:1`), "resend");
      // A call beyond the first only after an attempt whose call was cut off (journaled unknown and
      // reported, then settled as superseded when the step ran again), each made by a run then killed.
      const cutOff = attempts.slice(0, -1).filter((a) => a.state === "sent" && a.messageId === "botmesh:step-superseded");
      for (const a of attempts.slice(0, -1)) {
        expect(a.messageId, `${where}: an earlier attempt never ran, or was cut off and superseded`).toBeOneOf(["botmesh:step-not-run", "botmesh:step-superseded"]);
      }
      expect(calls.length - 1, `${where}: calls beyond the first, each after a cut-off attempt`).toBeLessThanOrEqual(cutOff.length);
      for (const call of calls.slice(0, -1)) expect(kills.some((k) => k.round === call.incarnation), `${where}: the run of an earlier call was killed`).toBe(true);
      expect(new Set(calls.map((c) => c.incarnation)).size, `${where}: no run called the LLM twice for it`).toBe(calls.length);
      for (const a of cutOff) expect(reports.some((r) => r.key === a.key && r.step === "llm"), `${where}: attempt ${a.key} reported`).toBe(true);
      if (calls.length > 1) again++;
      maxCalls = Math.max(maxCalls, calls.length);
    }
  } finally {
    await opened.close();
  }
  expect([...world.sends.keys()].every((k) => messages.some((m) => k === `${m.id}:1`))).toBe(true);
  // A kill that landed while the LLM had not answered: the step ran again (same key, same answer).
  const landed = kills.flatMap((k) => k.inCall);
  for (const key of landed) expect((world.calls.get(key) ?? []).length, `step ${key} killed inside its call ran again`).toBeGreaterThanOrEqual(2);
  console.log(
    `idempotent step kill (seed ${SEED + 1}): ${kills.length} SIGKILLs (${kills.filter((k) => k.inCall.length > 0).length} inside an LLM call, ${kills.filter((k) => k.spared).length} put off for a message cut off ${SPARE_AFTER} times), ` +
      `${messages.length} messages all done, ${world.allCalls().length} LLM calls, ${again} steps called again (at most ${maxCalls} calls for one key), ` +
      `${reports.length} ambiguous reports; ${(ms / 1000).toFixed(1)} s`,
  );
  expect(landed.length).toBeGreaterThanOrEqual(1);
}, 90_000);
