/**
 * The steps part of the conformance suite: durable steps (`ctx.step()`, `bot.step()`) journaled on the
 * backend under test, driven through a real `Bot`. A step's result is recorded once and given back to
 * every rerun (its JSON round trip); a failure is retried in the run, then journaled; a call that may have
 * had its effect is held `unknown` and reported, or run again when the step is idempotent; an operator
 * confirms (with a result), requeues or replays; misuse is refused by name; a step slower than its lease
 * keeps it, and a graceful stop lets it finish; a key shared by messages runs once; steps sit around an
 * ask (and after its timeout) across restarts. The crash matrix kills a bot at each journal step of a
 * step (and at the step's own call), before and after, and a second bot recovers: a bot of another
 * instance, the same instance restarted, a process without timers (sweeps only), and with
 * `onAmbiguous: "resend"`. Every test counts the calls of the step's function.
 *
 * @module
 */
import { uid } from "./util.ts";
import { SuiteTime } from "./suite_time.ts";
import type { DurabilityBackend, InboundRecord } from "../contract.ts";
import { Bot as CoreBot, type BotOptions } from "../bot.ts";
import type { DurabilityOptions } from "../config.ts";
import { ProviderError } from "../errors.ts";
import { AskTimeoutError } from "../conversation.ts";
import { ANY } from "../matchers.ts";
import { MemoryStore, type SessionStore } from "../store.ts";
import { STEP_NOT_RUN, STEP_SUPERSEDED, StepAmbiguousError, StepFailedError, type StepCall } from "../engine/steps.ts";
import type { BackendConformanceOptions } from "./conformance.ts";
import { collect, fastDurability } from "./conformance_bot.ts";
import { crashable, CrashableProvider, crashableStore, type CrashPoint } from "./crashable.ts";
import { MockProvider as CoreMockProvider, type MockProviderOptions } from "./mock_provider.ts";
import { caught, expectedOutcome, STEP_CRASH_POINTS, told } from "./conformance_steps_matrix.ts";

type Bot = CoreBot;

/**
 * Registers the tests of durable steps for a backend.
 *
 * @param options the same options as `runBackendContract`
 */
export function runStepConformance(options: BackendConformanceOptions): void {
  const { describe, test, expect } = options.harness;
  const scale = options.timeScale ?? 1;
  const title = `steps: ${options.name}`;
  if (options.skip) {
    describe(title, () => {
      (test.skip ?? test)(`skipped: ${options.skip}`, () => {});
    });
    return;
  }

  /** The time of the running test: every `Bot` and provider runs on its clock. */
  let time = new SuiteTime(false);
  const Bot = class extends CoreBot {
    constructor(options: BotOptions) {
      super({ clock: time.clock, ...options });
    }
  };
  const MockProvider = class extends CoreMockProvider {
    constructor(options: MockProviderOptions = {}) {
      super({ clock: time.clock, ...options });
    }
  };

  /**
   * Runs `fn` with a fresh backend and stops every bot it made. A test that restarts the "process" over
   * `options.reopen` puts the new backend in `held`: that one is closed and cleaned up.
   */
  const withBackend = (
    name: string,
    fn: (backend: DurabilityBackend, bots: Bot[], held: { backend: DurabilityBackend }) => Promise<void>,
  ) =>
    test(name, async () => {
      time = new SuiteTime(options.simulatedTime === true);
      try {
        const backend = await time.create(options);
        const held = { backend };
        const bots: Bot[] = [];
        await backend.open?.();
        try {
          await fn(backend, bots, held);
        } finally {
          for (const bot of bots) await bot.stop().catch(() => {});
          try {
            await held.backend.close?.();
          } finally {
            await time.cleanup(options, held.backend);
          }
        }
      } finally {
        time.stop();
      }
    });

  /** A bot on `backend` with the suite's fast settings (not started), its provider, and what it reported. */
  const rig = (bots: Bot[], backend: DurabilityBackend, extra: Partial<DurabilityOptions> = {}, botOptions: Partial<BotOptions> = {}) => {
    const provider = new MockProvider();
    const bot = new Bot({ provider, ...botOptions, durability: fastDurability(backend, scale, extra) });
    bots.push(bot);
    return {
      bot,
      provider,
      dead: collect(bot, "durability:dead"),
      ambiguous: collect(bot, "durability:ambiguous"),
      errors: collect(bot, "error"),
      warnings: collect(bot, "warning"),
    };
  };

  const inboxOf = async (backend: DurabilityBackend, id: string): Promise<InboundRecord> => {
    const record = await backend.inbox.get(id);
    expect(record === null, `inbound record ${id} is journaled`).toBe(false);
    return record!;
  };

  /**
   * The crash matrix's run: bot A dies at `point` during a step of its handler, bot B (another instance, on
   * the same state, reopened when the backend can be) recovers, and the outcome is checked. With `sweeps`,
   * B has no timers (a serverless process): only its `bot.sweep()` calls take the work up.
   */
  const crashAndRecover = async (
    backend: DurabilityBackend,
    bots: Bot[],
    held: { backend: DurabilityBackend },
    point: (typeof STEP_CRASH_POINTS)[number],
    when: "before" | "after",
    idempotent: boolean,
    { onAmbiguous = "hold", sweeps = false, restart = false }: { onAmbiguous?: "hold" | "resend"; sweeps?: boolean; restart?: boolean } = {},
  ): Promise<void> => {
    const instanceId = uid("crash");
    const leaseMs = Math.round(60 * scale);
    const expected = expectedOutcome(point, when, idempotent);
    const failing = point === "outbox.markFailed";
    let effects = 0;
    /** The `attempt` each call of the step's function was given. */
    const attempts: number[] = [];
    const ambiguous: string[] = [];
    const resolved: string[] = [];
    const a = crashable(backend);
    if (when === "before") a.crashBefore(point as CrashPoint);
    else a.crashAfter(point as CrashPoint);
    /** The step's function, the same in both processes; A's runs through the crash point `step.call`. */
    const pay = (id: string) => async ({ attempt }: StepCall): Promise<{ paid: string }> => {
      effects++;
      attempts.push(attempt);
      if (point === "outbox.heartbeat") await time.sleep(leaseMs * 2); // its lease is heartbeated meanwhile
      if (failing) throw new ProviderError("declined", { retryable: false });
      return { paid: id };
    };
    const make = (over: DurabilityBackend, provider: CoreMockProvider | CrashableProvider, crash: boolean) => {
      const bot = new Bot({
        provider,
        durability: fastDurability(over, scale, {
          instanceId: restart ? instanceId : uid("crash"),
          ...(sweeps && !crash ? { sweepIntervalMs: 0 } : {}),
          inbox: { leaseMs },
          outbox: { leaseMs, onAmbiguous },
        }),
      });
      bots.push(bot);
      bot.on("error", () => {});
      bot.on("warning", () => {});
      bot.on("durability:ambiguous", (e) => {
        if (e.step === "pay") ambiguous.push(e.key);
      });
      bot.on("durability:resolved", (e) => resolved.push(`${e.key} ${e.chatId} ${e.via}`));
      bot.when(ANY, async (ctx) => {
        const fn = pay(ctx.inboundId);
        const result = await ctx.step("pay", crash ? (call) => a.step("step.call", () => fn(call)) : fn, { idempotent });
        await ctx.reply(`paid ${result.paid}`);
      });
      return bot;
    };
    const providerA = new CrashableProvider(a, new MockProvider());
    const botA = make(a, providerA, true);
    const id = uid("m");
    const message = { id, chatId: "c1", text: "pay" };
    try {
      await botA.start();
      await providerA.receive(message);
      for (let i = 0; i < 400 && !a.crashed; i++) await time.sleep(Math.round(10 * scale));
    } catch (error) {
      if (!a.crashed) throw error; // only the simulated death may end the first process
    }
    expect(a.crashed, `the step reached "${point}" (hits: ${JSON.stringify(a.hits)})`).toBe(true);
    await botA.stop().catch(() => {});
    // A second process, on the same state.
    let over = backend;
    if (options.reopen) {
      over = held.backend = await time.reopen(options.reopen, backend);
      await over.open?.();
    }
    const providerB = new MockProvider();
    const botB = make(over, providerB, false);
    await botB.start();
    await providerB.receive(message); // the channel redelivers what was not acknowledged
    if (sweeps) {
      // A cron's sweeps, a lease apart, until the message is settled.
      for (let i = 0; i < 40 && !["done", "dead"].includes((await over.inbox.get(id))?.state ?? ""); i++) {
        await time.sleep(leaseMs);
        await botB.sweep();
        await botB.settled();
      }
      const settledBySweeps = (await over.inbox.get(id))?.state;
      expect(settledBySweeps === "done" || settledBySweeps === "dead", `settled by the sweeps: ${settledBySweeps}`).toBe(true);
    }
    await botB.idle();
    await botB.stop();

    const key = `${id}:step:pay`;
    const record = await over.inbox.get(id);
    const state = expected.outcome === "done" ? "done" : "dead";
    expect(record?.state, `inbound after a crash ${when} ${point}: ${record?.error}`).toBe(state);
    if (expected.outcome !== "done") {
      const error = expected.outcome === "ambiguous" ? "StepAmbiguousError" : "StepFailedError";
      expect(record?.error?.includes(error), `dead with ${error}: ${record?.error}`).toBe(true);
    }
    expect(effects, "the step's effects").toBe(expected.effects);
    expect(effects, "never more than once, twice when idempotent").toBeLessThanOrEqual(idempotent ? 2 : 1);
    expect(ambiguous, "reported ambiguous when its call was announced").toEqual(expected.reported ? [key] : []);
    const first = await over.outbox.get(key);
    // An idempotent step's cut-off attempt is superseded by the rerun that runs the step again.
    expect(first?.state, "the first attempt").toBe(expected.reported && !idempotent ? "unknown" : failing && !expected.reported ? "dead" : "sent");
    if (expected.reported && idempotent) expect(first?.messageId, "superseded by the next attempt").toBe(STEP_SUPERSEDED);
    expect(resolved, "the alert closed when the rerun superseded it").toEqual(expected.reported && idempotent ? [`${key} c1 rerun`] : []);
    // A second attempt: after one that never ran (settled by a sweep), or one held unknown of an idempotent step.
    const neverRan = (point === "outbox.reserve" && when === "after") || (point === "outbox.markCalling" && when === "before");
    if (neverRan) expect(first?.messageId, "the attempt that never ran").toBe(STEP_NOT_RUN);
    const secondRan = neverRan || (expected.reported && idempotent);
    const second = await over.outbox.get(`${key}#2`);
    expect(second?.state, "the second attempt").toBe(secondRan ? (failing ? "dead" : "sent") : undefined);
    expect(attempts, "the attempt each call was given").toEqual(
      secondRan ? [...Array(effects - 1).fill(1), 2] : Array(effects).fill(1),
    );
    const replies = [...providerA.sent, ...providerB.sent].filter((s) => s.idempotencyKey === `${id}:1`);
    expect(replies.map((s) => s.content), "the reply went out once when the message is done")
      .toEqual(state === "done" ? [`paid ${id}`] : []);
  };

  describe(title, () => {
    withBackend("a step runs once across a handler retry: the rerun gets what the first run got (its JSON round trip)", async (backend, bots) => {
      const { bot, provider, warnings } = rig(bots, backend);
      const big = "é€𝄞 step result ".repeat(6_000); // about 100 KB of UTF-8
      const makers: Record<string, () => unknown> = {
        object: () => ({ at: new Date(0), n: 1.5, list: [1, "a", null, true], nested: { gone: undefined, deep: { x: "y" } } }),
        string: () => "plain \u0000 \"quoted\" ✓",
        number: () => -0.125,
        nothing: () => undefined,
        big: () => big,
      };
      const calls: Record<string, number> = {};
      const count = (name: string) => calls[name] = (calls[name] ?? 0) + 1;
      const results: Record<string, unknown>[] = [];
      /** Code with no ctx (middleware of a framework): `bot.step` journals the same way. */
      const helper = () => bot.step("via-bot", async ({ idempotencyKey }) => (count("via-bot"), [idempotencyKey]));
      bot.when(ANY, async (ctx) => {
        const seen: Record<string, unknown> = {};
        for (const [name, make] of Object.entries(makers)) seen[name] = await ctx.step(name, () => (count(name), make()));
        seen["via-bot"] = await helper();
        results.push(seen);
        if (results.length === 1) throw new Error("fails after its steps, so the message is processed again");
        await ctx.reply(`done ${typeof seen.nothing}`);
      });
      await bot.start();
      const id = uid("m");
      await provider.receive({ id, chatId: "c1", text: "go" });
      await bot.idle();
      expect(results.length, "the handler ran twice").toBe(2);
      const names = [...Object.keys(makers), "via-bot"];
      expect(calls, "each step's function ran once").toEqual(Object.fromEntries(names.map((n) => [n, 1])));
      const expected = {
        object: { at: "1970-01-01T00:00:00.000Z", n: 1.5, list: [1, "a", null, true], nested: { deep: { x: "y" } } },
        string: "plain \u0000 \"quoted\" ✓",
        number: -0.125,
        nothing: undefined,
        big,
        "via-bot": [`${id}:step:via-bot`],
      };
      expect(results[0], "the first run got the JSON round trip of each result").toEqual(expected);
      expect(results[1], "the rerun got the same").toEqual(expected);
      expect(Object.keys(results[1]!.object as object).sort(), "no key a JSON round trip drops").toEqual(["at", "list", "n", "nested"]);
      expect((results[1]!.big as string).length).toBe(big.length);
      for (const name of names) {
        const entry = await backend.outbox.get(`${id}:step:${name}`);
        expect([entry?.state, entry?.chatId], `entry of step ${name}`).toEqual(["sent", `step:${id}:step:${name}`]);
      }
      expect(provider.sent.map((s) => [s.content, s.idempotencyKey])).toEqual([["done undefined", `${id}:1`]]);
      expect((await inboxOf(backend, id)).state).toBe("done");
      expect(warnings.filter((w) => w.code === "handler-retry").length, "one handler retry").toBe(1);
    });

    withBackend("a step slower than its lease keeps it (heartbeats): no other process's sweep reports it, one call", async (backend, bots) => {
      const { bot, provider, ambiguous } = rig(bots, backend);
      const other = rig(bots, backend); // sweeps the same journal meanwhile
      const leaseMs = Math.round(300 * scale); // the suite's lease (fastDurability)
      let calls = 0;
      bot.when(ANY, async (ctx) => {
        const answer = await ctx.step("llm", async ({ signal }) => {
          calls++;
          await time.sleep(Math.round(leaseMs * 2.5));
          return `slow answer${signal.aborted ? " (aborted)" : ""}`;
        });
        await ctx.reply(answer);
      });
      await bot.start();
      await other.bot.start();
      const id = uid("m");
      await provider.receive({ id, chatId: "c1", text: "think" });
      await bot.idle();
      await other.bot.idle();
      expect(calls).toBe(1);
      expect([...ambiguous, ...other.ambiguous], "nothing reported").toEqual([]);
      expect(provider.sent.map((s) => s.content)).toEqual(["slow answer"]);
      expect((await backend.outbox.get(`${id}:step:llm`))?.state).toBe("sent");
      expect((await inboxOf(backend, id)).state).toBe("done");
    });

    withBackend("a bot stopped during a step lets it finish: its result recorded, the message done", async (backend, bots) => {
      const { bot, provider, ambiguous } = rig(bots, backend);
      let calls = 0;
      let started!: () => void;
      const running = new Promise<void>((resolve) => started = resolve);
      bot.when(ANY, async (ctx) => {
        const answer = await ctx.step("slow", async () => {
          calls++;
          started();
          await time.sleep(Math.round(500 * scale));
          return "finished";
        });
        await ctx.reply(answer);
      });
      await bot.start();
      const id = uid("m");
      await provider.receive({ id, chatId: "c1", text: "go" });
      await running;
      await bot.stop();
      expect([calls, ambiguous.length]).toEqual([1, 0]);
      expect(provider.sent.map((s) => s.content)).toEqual(["finished"]);
      expect((await backend.outbox.get(`${id}:step:slow`))?.state).toBe("sent");
      expect((await inboxOf(backend, id)).state).toBe("done");
    });

    withBackend("a step keyed by the caller (option key) runs once for every message that uses its key", async (backend, bots) => {
      const { bot, provider } = rig(bots, backend);
      const key = `${uid("order")}:charge`;
      const calls: string[] = [];
      bot.when(ANY, async (ctx) => {
        const charge = await ctx.step("charge", ({ idempotencyKey }) => (calls.push(ctx.inboundId), { by: ctx.inboundId, idempotencyKey }), { key });
        // The same name again, under a key of its own: allowed.
        const again = await ctx.step("charge", () => "receipt", { key: `${key}:receipt` });
        await ctx.reply(`${charge.by} ${charge.idempotencyKey} ${again}`);
      });
      await bot.start();
      const ids = [uid("m"), uid("m"), uid("m")];
      for (const [i, id] of ids.entries()) await provider.receive({ id, chatId: `c${i}`, text: "pay" });
      await bot.idle();
      expect(calls.length, "one call for the key").toBe(1);
      expect(provider.sent.map((s) => s.content), "every message got the recorded result").toEqual(ids.map(() => `${calls[0]} ${key} receipt`));
      expect((await backend.outbox.get(key))?.state).toBe("sent");
      for (const id of ids) expect((await inboxOf(backend, id)).state).toBe("done");
    });

    withBackend("a step that fails for good: StepFailedError, its entry dead, the message dead at once; a replay throws it again without a call, unless the attempt is requeued", async (backend, bots) => {
      const { bot, provider, dead, warnings } = rig(bots, backend);
      let calls = 0;
      let fixed = false;
      const seen: unknown[] = [];
      bot.when(ANY, async (ctx) => {
        const charged = await caught(ctx.step("charge", ({ attempt }) => {
          calls++;
          if (fixed) return `charged on attempt ${attempt}`;
          throw new ProviderError("declined", { retryable: false });
        }));
        seen.push(charged);
        if (charged !== undefined) throw charged;
        await ctx.reply("charged");
      });
      await bot.start();
      const id = uid("m");
      const key = `${id}:step:charge`;
      await provider.receive({ id, chatId: "c1", text: "pay" });
      await bot.idle();
      expect(calls).toBe(1);
      const first = seen[0] as StepFailedError;
      expect(first instanceof StepFailedError, told(first)).toBe(true);
      expect([first.step, first.key]).toEqual(["charge", key]);
      expect(first.cause instanceof ProviderError, "the first run's error has the call's error as its cause").toBe(true);
      expect(first.message.includes("declined"), first.message).toBe(true);
      const entry = await backend.outbox.get(key);
      expect(entry?.state).toBe("dead");
      expect(entry?.error?.includes("declined"), `journaled error: ${entry?.error}`).toBe(true);
      const record = await inboxOf(backend, id);
      expect([record.state, record.attempts], "dead-lettered after one run").toEqual(["dead", 1]);
      expect(record.error?.includes("StepFailedError"), `inbound error: ${record.error}`).toBe(true);
      expect(warnings.filter((w) => w.code === "handler-retry").length, "no inbound retry").toBe(0);
      expect(dead.map((d) => [d.kind, d.id])).toEqual([["step", key], ["inbound", id]]);
      // A replay: the journaled failure again, without a call.
      expect(await bot.durability!.replayInbound(id)).toBe(true);
      await bot.idle();
      expect(calls, "not called again").toBe(1);
      expect(seen.length).toBe(2);
      const again = seen[1] as StepFailedError;
      expect([again instanceof StepFailedError, again.cause, again.message.includes("declined")]).toEqual([true, undefined, true]);
      expect((await inboxOf(backend, id)).state).toBe("dead");
      expect(provider.sent.length).toBe(0);
      // The operator had the cause fixed: the dead attempt requeued (a sweep settles it as never run), then a replay.
      fixed = true;
      expect(await bot.durability!.retrySend(key)).toBe(true);
      expect(await bot.durability!.replayInbound(id)).toBe(true);
      await bot.idle();
      expect([calls, seen.length, seen[2]], "the step ran once more").toEqual([2, 3, undefined]);
      expect([(await backend.outbox.get(key))?.messageId, (await backend.outbox.get(`${key}#2`))?.state]).toEqual([STEP_NOT_RUN, "sent"]);
      expect(provider.sent.map((s) => s.content)).toEqual(["charged"]);
      expect((await inboxOf(backend, id)).state).toBe("done");
    });

    withBackend("retryable failures are retried in the run with attempt 1, 2, 3; spent retries fail the step for good", async (backend, bots) => {
      const { bot, provider } = rig(bots, backend);
      const calls: StepCall[] = [];
      let downCalls = 0;
      const seen: unknown[] = [];
      bot.when(/^flaky$/, async (ctx) => {
        const answer = await ctx.step("llm", (call) => {
          calls.push(call);
          if (calls.length < 3) throw new ProviderError("busy", { status: 503 });
          return `answer ${call.attempt}`;
        });
        await ctx.reply(answer);
      });
      bot.when(/^down$/, async (ctx) => {
        seen.push(await caught(ctx.step("llm", () => {
          downCalls++;
          throw new Error("connection reset");
        }, { retries: 1 })));
        throw seen.at(-1);
      });
      await bot.start();
      const [flaky, down] = [uid("m"), uid("m")];
      await provider.receive({ id: flaky, chatId: "c1", text: "flaky" });
      await provider.receive({ id: down, chatId: "c2", text: "down" });
      await bot.idle();
      expect(calls.map((c) => [c.attempt, c.idempotencyKey])).toEqual([1, 2, 3].map((n) => [n, `${flaky}:step:llm`]));
      expect(provider.sent.map((s) => [s.content, s.idempotencyKey])).toEqual([["answer 3", `${flaky}:1`]]);
      // Each call is an attempt of its own: a failed one to retry is closed as superseded, the last holds the result.
      const attemptsOf = async (key: string, n: number) => {
        const entries = await Promise.all([1, 2, 3].slice(0, n).map((i) => backend.outbox.get(i === 1 ? key : `${key}#${i}`)));
        return entries.map((e) => [e?.state, e?.messageId === STEP_SUPERSEDED ? "superseded" : e?.state === "sent" ? "result" : null]);
      };
      expect(await attemptsOf(`${flaky}:step:llm`, 3)).toEqual([["sent", "superseded"], ["sent", "superseded"], ["sent", "result"]]);
      expect(await backend.outbox.get(`${flaky}:step:llm#4`)).toBe(null);
      expect((await inboxOf(backend, flaky)).state).toBe("done");
      expect(downCalls, "retries: 1 is two calls").toBe(2);
      expect(seen.length === 1 && seen[0] instanceof StepFailedError, told(seen[0])).toBe(true);
      expect((seen[0] as Error).message.includes("connection reset")).toBe(true);
      expect(await attemptsOf(`${down}:step:llm`, 2)).toEqual([["sent", "superseded"], ["dead", null]]);
      expect((await inboxOf(backend, down)).state).toBe("dead");
    });

    withBackend("a call that may have had its effect: held unknown and reported (StepAmbiguousError); an idempotent step is retried", async (backend, bots) => {
      const { bot, provider, ambiguous } = rig(bots, backend);
      const calls: Record<string, number> = {};
      const seen = new Map<string, unknown>();
      const failures: Record<string, () => Error> = {
        maybe: () => new ProviderError("timed out", { maybeDelivered: true }),
        timeout: () => new DOMException("The operation timed out.", "TimeoutError") as unknown as Error,
      };
      bot.when(/^(maybe|timeout)$/, async (ctx) => {
        const text = ctx.message.text!;
        seen.set(text, await caught(ctx.step("pay", () => {
          calls[text] = (calls[text] ?? 0) + 1;
          throw failures[text]!();
        })));
        throw seen.get(text);
      });
      bot.when(/^idem$/, async (ctx) => {
        const paid = await ctx.step("pay", ({ attempt }) => {
          calls.idem = (calls.idem ?? 0) + 1;
          if (attempt === 1) throw failures.timeout!();
          return `paid on attempt ${attempt}`;
        }, { idempotent: true });
        await ctx.reply(paid);
      });
      await bot.start();
      const ids = { maybe: uid("m"), timeout: uid("m"), idem: uid("m") };
      for (const [text, id] of Object.entries(ids)) await provider.receive({ id, chatId: `c-${text}`, text });
      await bot.idle();
      expect(calls, "nothing that may have taken effect was called again, unless idempotent").toEqual({ maybe: 1, timeout: 1, idem: 2 });
      for (const text of ["maybe", "timeout"] as const) {
        const key = `${ids[text]}:step:pay`;
        const error = seen.get(text) as StepAmbiguousError;
        expect(error instanceof StepAmbiguousError, told(error)).toBe(true);
        expect([error.step, error.key, error.attemptKey, error.cause !== undefined]).toEqual(["pay", key, key, true]);
        expect((await backend.outbox.get(key))?.state).toBe("unknown");
        const record = await inboxOf(backend, ids[text]);
        expect([record.state, record.attempts], `${text}: dead at once`).toEqual(["dead", 1]);
        expect(record.error?.includes("StepAmbiguousError"), `inbound error: ${record.error}`).toBe(true);
      }
      expect(ambiguous.map((a) => `${a.key} ${a.chatId} ${a.step}`).sort()).toEqual(
        [`${ids.maybe}:step:pay c-maybe pay`, `${ids.timeout}:step:pay c-timeout pay`].sort(),
      );
      expect(provider.sent.map((s) => s.content)).toEqual(["paid on attempt 2"]);
      expect((await backend.outbox.get(`${ids.idem}:step:pay`))?.state).toBe("sent");
      expect((await inboxOf(backend, ids.idem)).state).toBe("done");
    });

    withBackend("a step's state is its latest attempt: a discarded earlier attempt does not let a held step run again", async (backend, bots) => {
      const { bot, provider } = rig(bots, backend);
      const attempts: number[] = [];
      const seen: unknown[] = [];
      bot.when(ANY, async (ctx) => {
        seen.push(await caught(ctx.step("pay", ({ attempt }) => {
          attempts.push(attempt);
          throw attempt === 1 ? new ProviderError("busy", { status: 503 }) : new ProviderError("timed out", { maybeDelivered: true });
        })));
        throw seen.at(-1);
      });
      await bot.start();
      const id = uid("m");
      const key = `${id}:step:pay`;
      await provider.receive({ id, chatId: "c1", text: "pay" });
      await bot.idle();
      expect(attempts, "a retry, then a call that may have had its effect").toEqual([1, 2]);
      expect([(await backend.outbox.get(key))?.messageId, (await backend.outbox.get(`${key}#2`))?.state]).toEqual([STEP_SUPERSEDED, "unknown"]);
      expect(seen[0] instanceof StepAmbiguousError && (seen[0] as StepAmbiguousError).attemptKey === `${key}#2`, told(seen[0])).toBe(true);
      // The first attempt is forgotten (discarded, or purged with the sent entries): the step is still held.
      expect(await bot.durability!.outbox.discard(key)).toBe(true);
      expect(await bot.durability!.replayInbound(id)).toBe(true);
      await bot.idle();
      expect(attempts, "not called again").toEqual([1, 2]);
      expect(seen[1] instanceof StepAmbiguousError && (seen[1] as StepAmbiguousError).attemptKey === `${key}#2`, told(seen[1])).toBe(true);
      expect((await inboxOf(backend, id)).state).toBe("dead");
    });

    withBackend("an operator settles an ambiguous step: markDelivered with its result (or none), or retrySend to run it again; then a replay", async (backend, bots) => {
      const { bot, provider, ambiguous } = rig(bots, backend);
      const resolved = collect(bot, "durability:resolved");
      const calls: [string, number, string][] = [];
      let healed = false;
      const got = new Map<string, unknown>();
      bot.when(ANY, async (ctx) => {
        const result = await ctx.step("pay", ({ attempt, idempotencyKey }) => {
          calls.push([ctx.inboundId, attempt, idempotencyKey]);
          if (!healed) throw new ProviderError("timed out", { maybeDelivered: true });
          return { ok: 2 };
        });
        got.set(ctx.inboundId, result);
        await ctx.reply(String(JSON.stringify(result)));
      });
      await bot.start();
      const [confirmed, bare, retried] = [uid("m"), uid("m"), uid("m")];
      const ids = [confirmed, bare, retried];
      for (const [i, id] of ids.entries()) await provider.receive({ id, chatId: `c${i}`, text: "pay" });
      await bot.idle();
      const [keyC, keyB, keyR] = ids.map((id) => `${id}:step:pay`);
      expect(ambiguous.map((a) => a.key).sort()).toEqual([keyC!, keyB!, keyR!].sort());
      for (const id of ids) expect((await inboxOf(backend, id)).state).toBe("dead");
      healed = true;
      const d = bot.durability!;
      const refused = await caught(d.markDelivered(keyC!, "{not json"));
      expect(refused instanceof TypeError, `a result that is not JSON is refused: ${told(refused)}`).toBe(true);
      expect((await backend.outbox.get(keyC!))?.state).toBe("unknown");
      expect(await d.markDelivered(keyC!, JSON.stringify({ ok: 1 }))).toBe(true);
      expect(await d.markDelivered(keyB!), "confirmed without a result").toBe(true);
      expect(await d.markDelivered(keyC!, "{}"), "settled already").toBe(false);
      expect(resolved.map((r) => [r.key, r.chatId, r.state, r.via]), "told as the ambiguity was: in the message's chat").toEqual([
        [keyC, "c0", "sent", "operator"],
        [keyB, "c1", "sent", "operator"],
      ]);
      expect(await d.retrySend(keyR!)).toBe(true);
      for (const id of ids) expect(await d.replayInbound(id)).toBe(true);
      await bot.idle();
      expect(got.get(confirmed), "the confirmed result, without a call").toEqual({ ok: 1 });
      expect([got.has(bare), got.get(bare)], "confirmed without a result: undefined").toEqual([true, undefined]);
      expect(got.get(retried), "the step ran again").toEqual({ ok: 2 });
      expect(calls.filter(([id]) => id !== retried).length, "the confirmed steps were not called again").toBe(2);
      expect(calls.filter(([id]) => id === retried)).toEqual([[retried, 1, keyR], [retried, 2, keyR]]);
      for (const key of [keyC!, keyB!]) expect((await backend.outbox.get(key))?.state).toBe("sent");
      const abandoned = await backend.outbox.get(keyR!);
      expect([abandoned?.state, abandoned?.messageId], "the requeued attempt is settled as never run").toEqual(["sent", STEP_NOT_RUN]);
      expect((await backend.outbox.get(`${keyR}#2`))?.state, "its next attempt ran").toBe("sent");
      for (const id of ids) expect((await inboxOf(backend, id)).state).toBe("done");
      expect(provider.sent.map((s) => [s.idempotencyKey, s.content]).sort()).toEqual(
        [[`${confirmed}:1`, `{"ok":1}`], [`${bare}:1`, "undefined"], [`${retried}:1`, `{"ok":2}`]].sort(),
      );
    });

    withBackend("misuse: a name used twice, bad options, the key of a send, a result that is not JSON", async (backend, bots) => {
      const { bot, provider, dead } = rig(bots, backend);
      const seen: Record<string, unknown> = {};
      const calls: Record<string, number> = {};
      const fn = (name: string) => () => (calls[name] = (calls[name] ?? 0) + 1);
      const bigRuns: unknown[] = [];
      bot.when(/^misuse$/, async (ctx) => {
        await ctx.step("once", fn("once"));
        seen.twice = await caught(ctx.step("once", fn("once")));
        seen.unknownOption = await caught(ctx.step("a", fn("a"), { retry: 2 } as never));
        seen.negativeRetries = await caught(ctx.step("b", fn("b"), { retries: -1 }));
        seen.idempotent = await caught(ctx.step("c", fn("c"), { idempotent: "yes" } as never));
        seen.noName = await caught(ctx.step("", fn("d")));
        await ctx.reply("replied");
        seen.sendKey = await caught(ctx.step("e", fn("e"), { key: `${ctx.inboundId}:1` }));
      });
      bot.when(/^bigint$/, async (ctx) => {
        bigRuns.push(await caught(ctx.step("big", () => (calls.big = (calls.big ?? 0) + 1, 10n))));
        throw bigRuns.at(-1);
      });
      await bot.start();
      const [misuse, bigint] = [uid("m"), uid("m")];
      await provider.receive({ id: misuse, chatId: "c1", text: "misuse" });
      await provider.receive({ id: bigint, chatId: "c2", text: "bigint" });
      await bot.idle();
      const check = (what: string, type: ErrorConstructor | TypeErrorConstructor | RangeErrorConstructor, needle: string) => {
        const error = seen[what];
        expect(error instanceof type && error.message.includes(needle), `${what}: ${told(error)}`).toBe(true);
      };
      check("twice", TypeError, `"once"`);
      check("unknownOption", TypeError, `"retry"`);
      check("negativeRetries", RangeError, `"retries"`);
      check("idempotent", TypeError, `"idempotent"`);
      check("noName", TypeError, `"name"`);
      check("sendKey", TypeError, `"${misuse}:1"`);
      expect(calls.once, "the second use of a name did not run").toBe(1);
      for (const name of ["a", "b", "c", "d", "e"]) {
        expect(calls[name], `step ${name} did not run`).toBe(undefined);
        expect(await backend.outbox.get(`${misuse}:step:${name}`), `nothing journaled for step ${name}`).toBe(null);
      }
      expect((await backend.outbox.get(`${misuse}:1`))?.content, "the send keeps its key").toBe("replied");
      expect((await inboxOf(backend, misuse)).state).toBe("done");
      const outside = await caught(bot.step("outside", fn("outside")));
      expect(outside instanceof Error && outside.message.includes("outside a handler"), told(outside)).toBe(true);
      // A result that is not JSON: the step ran, so it is journaled dead; the rerun does not run it again.
      expect(calls.big, "the step with a BigInt result ran once").toBe(1);
      expect(bigRuns[0] instanceof TypeError && (bigRuns[0] as Error).message.includes("not JSON"), told(bigRuns[0])).toBe(true);
      expect(bigRuns[1] instanceof StepFailedError, `the rerun: ${told(bigRuns[1])}`).toBe(true);
      expect(bigRuns.length).toBe(2);
      expect((await backend.outbox.get(`${bigint}:step:big`))?.state).toBe("dead");
      expect((await inboxOf(backend, bigint)).state).toBe("dead");
      expect(dead.some((d) => d.kind === "step" && d.id === `${bigint}:step:big`)).toBe(true);
    });

    withBackend("steps before and after an ask: after restarts the replay gets the journaled results, each step ran once", async (backend, bots, held) => {
      const store = new MemoryStore(); // outlives the "processes", as a durable store would
      const calls = { quote: 0, charge: 0 };
      const make = (over: DurabilityBackend, provider: CoreMockProvider | CrashableProvider, sessions: SessionStore) => {
        const bot = new Bot({ provider, store: sessions, durability: fastDurability(over, scale, { instanceId: uid("conv") }) });
        bots.push(bot);
        bot.on("warning", () => {}); // the memory store is not durable: warned once
        bot.on("error", () => {});
        bot.when("order", async (ctx) => {
          const quote = await ctx.step("quote", () => (calls.quote++, { price: 7 }));
          const size = await ctx.ask(`Size? (${quote.price} each)`);
          const charge = await ctx.step("charge", ({ idempotencyKey }) => (calls.charge++, `charged ${size.text} as ${idempotencyKey}`));
          await ctx.reply(`${charge} at ${quote.price}`);
        });
        return bot;
      };
      const providerA = new MockProvider();
      const botA = make(backend, providerA, store);
      await botA.start();
      const [order, answer] = [uid("m"), uid("m")];
      await providerA.receive({ id: order, chatId: "c1", text: "order" });
      await botA.idle();
      expect(providerA.sent.map((s) => [s.idempotencyKey, s.content])).toEqual([[`${order}:1`, "Size? (7 each)"]]);
      await botA.stop();
      // The answer comes to a second process: its run replays the first step, runs the second, and the
      // process dies as soon as that step's result is recorded.
      const b = crashable(backend);
      b.crashAfter("outbox.markSent");
      const providerB = new CrashableProvider(b, new MockProvider());
      const botB = make(b, providerB, crashableStore(b, store));
      try {
        await botB.start();
        await providerB.receive({ id: answer, chatId: "c1", text: "M" });
        for (let i = 0; i < 400 && !b.crashed; i++) await time.sleep(Math.round(10 * scale));
      } catch (error) {
        if (!b.crashed) throw error;
      }
      expect(b.crashed, `the second process died (hits: ${JSON.stringify(b.hits)})`).toBe(true);
      await botB.stop().catch(() => {});
      expect(calls).toEqual({ quote: 1, charge: 1 });
      const chargeKey = `${answer}:step:charge`;
      expect((await backend.outbox.get(chargeKey))?.state, "the second step's result was recorded").toBe("sent");
      // A third process takes the answer up again: both steps replayed.
      let over = backend;
      if (options.reopen) {
        over = held.backend = await time.reopen(options.reopen, backend);
        await over.open?.();
      }
      const providerC = new MockProvider();
      const botC = make(over, providerC, store);
      await botC.start();
      await providerC.receive({ id: answer, chatId: "c1", text: "M" }); // redelivered: a duplicate
      await botC.idle();
      expect(calls, "each step ran once").toEqual({ quote: 1, charge: 1 });
      expect(providerC.sent.map((s) => [s.idempotencyKey, s.content])).toEqual([[`${answer}:1`, `charged M as ${chargeKey} at 7`]]);
      expect(providerB.sent.length, "nothing else went out").toBe(0);
      for (const key of [`${order}:step:quote`, chargeKey]) expect((await over.outbox.get(key))?.state, key).toBe("sent");
      for (const id of [order, answer]) expect((await over.inbox.get(id))?.state, id).toBe("done");
    });

    withBackend("a step that fails for good after an ask ends the conversation: the chat's next message is a new one", async (backend, bots) => {
      const store = new MemoryStore();
      const { bot, provider } = rig(bots, backend, {}, { store });
      let calls = 0;
      let kept: { step: (name: string, fn: () => unknown) => Promise<unknown> } | undefined;
      bot.when("order", async (ctx) => {
        const size = await ctx.ask("Size?");
        await ctx.step("charge", () => {
          calls++;
          throw new ProviderError(`declined for ${size.text}`, { retryable: false });
        });
      });
      bot.when(ANY, async (ctx) => {
        await ctx.reply(`new: ${ctx.message.text}`);
        kept = ctx; // its step is refused once the handler has returned
      });
      await bot.start();
      const [order, answer, next] = [uid("m"), uid("m"), uid("m")];
      await provider.receive({ id: order, chatId: "c1", text: "order" });
      await bot.idle();
      await provider.receive({ id: answer, chatId: "c1", text: "M" });
      await bot.idle();
      expect(calls).toBe(1);
      const record = await inboxOf(backend, answer);
      expect([record.state, record.attempts, record.error?.includes("StepFailedError")], "dead at once").toEqual(["dead", 1, true]);
      const transcript = await store.get(`botmesh:conversation:${bot.id}:c1`) as { state?: string } | undefined;
      expect(transcript?.state, "the conversation ended").toBe("ended");
      await provider.receive({ id: next, chatId: "c1", text: "hello" });
      await bot.idle();
      expect(provider.sent.map((s) => s.content)).toEqual(["Size?", "new: hello"]);
      const refused = await caught(kept!.step("late", () => 1));
      expect(refused instanceof Error && refused.message.includes("after the handler returned"), told(refused)).toBe(true);
      expect(await backend.outbox.get(`${next}:step:late`)).toBe(null);
    });

    withBackend("a step after an ask's timeout is keyed by the timeout and runs once across a retry", async (backend, bots) => {
      const timeoutMs = Math.round(150 * scale);
      const { bot, provider } = rig(bots, backend, {}, { store: new MemoryStore() });
      let calls = 0;
      let failOnce = true;
      bot.when("order", async (ctx) => {
        try {
          const size = await ctx.ask("Size?", { timeoutMs });
          await ctx.reply(`size ${size.text}`);
        } catch (error) {
          if (!(error instanceof AskTimeoutError)) throw error;
          const note = await ctx.step("remind", ({ idempotencyKey }) => (calls++, idempotencyKey));
          if (failOnce) {
            failOnce = false;
            throw new Error("fails after the step");
          }
          await ctx.reply(`reminded as ${note}`);
        }
      });
      await bot.start();
      const id = uid("m");
      await provider.receive({ id, chatId: "c1", text: "order" });
      for (let i = 0; i < 400 && provider.sent.length < 2; i++) await time.sleep(Math.round(10 * scale));
      await bot.idle();
      expect(calls).toBe(1);
      expect(provider.sent.map((s) => [s.idempotencyKey, s.content])).toEqual([
        [`${id}:1`, "Size?"],
        [`${id}:t1:1`, `reminded as ${id}:t1:step:remind`],
      ]);
      expect((await backend.outbox.get(`${id}:t1:step:remind`))?.state).toBe("sent");
    });

    // ---- the crash matrix of a step --------------------------------------------------------------
    for (const point of STEP_CRASH_POINTS) {
      for (const when of ["before", "after"] as const) {
        for (const idempotent of [false, true]) {
          withBackend(
            `crash ${when} ${point} in a${idempotent ? "n idempotent" : ""} step, then recover`,
            (backend, bots, held) => crashAndRecover(backend, bots, held, point, when, idempotent),
          );
        }
      }
    }
    // A step's call is never made again by a sweep, even where sends that may have been delivered are.
    for (const [point, when] of [["outbox.markCalling", "after"], ["step.call", "after"]] as const) {
      withBackend(
        `crash ${when} ${point} in a step with onAmbiguous: "resend", then recover: held all the same`,
        (backend, bots, held) => crashAndRecover(backend, bots, held, point, when, false, { onAmbiguous: "resend" }),
      );
    }
    // The same instance restarted: it takes its previous incarnation's leases up at once.
    for (const point of STEP_CRASH_POINTS) {
      for (const when of ["before", "after"] as const) {
        withBackend(
          `crash ${when} ${point} in a step, then the same instance restarted recovers`,
          (backend, bots, held) => crashAndRecover(backend, bots, held, point, when, false, { restart: true }),
        );
      }
    }
    // A serverless process recovers with its sweeps alone.
    for (const [point, when, idempotent] of [["outbox.reserve", "after", false], ["step.call", "after", false], ["step.call", "after", true]] as const) {
      withBackend(
        `crash ${when} ${point} in a${idempotent ? "n idempotent" : ""} step, then a process without timers recovers by its sweeps`,
        (backend, bots, held) => crashAndRecover(backend, bots, held, point, when, idempotent, { sweeps: true }),
      );
    }
  });
}
