/**
 * The harness of the kill tests of the bot library plugins: a bot in a child process, SIGKILLed at
 * random moments and started again, while updates stream in; then a last run that settles everything,
 * and the counts of what was lost, sent twice, or reported ambiguous.
 */
import type { Subprocess } from "bun";
import { afterAll, expect } from "bun:test";
import { mkdirSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { type ChildLines, childLines } from "./child_lines.ts";
import type { FakeTelegram } from "./fake_telegram.ts";

/**
 * A kill test's scratch folder, removed after the file's tests unless the environment variable `keep`
 * is set (then it is kept and named).
 *
 * @param name part of the folder's name
 * @param keep the environment variable that keeps it
 * @returns the folder
 */
export function killTestDir(name: string, keep: string): string {
  const dir = join(tmpdir(), `botmesh-${name}-${crypto.randomUUID()}`);
  mkdirSync(dir, { recursive: true });
  afterAll(() => {
    if (!process.env[keep]) rmSync(dir, { recursive: true, force: true });
    else console.log(`kept ${dir}`);
  });
  return dir;
}

/** A run of a bot in a child process: its stdout lines and its stderr. */
export interface FixtureRun {
  readonly child: Subprocess<"ignore", "pipe", "pipe">;
  readonly lines: ChildLines;
  readonly stderr: Promise<string>;
}

/**
 * Start a fixture bot with Bun.
 *
 * @param args the script and its arguments
 * @param name names the child in timeout errors
 * @returns the run
 */
export function spawnFixture(args: string[], name: string): FixtureRun {
  const child = Bun.spawn([process.execPath, ...args], { stdout: "pipe", stderr: "pipe" });
  return { child, lines: childLines(child.stdout, name, 20_000), stderr: new Response(child.stderr).text() };
}

/** The runs of one kill test: killed ones, then the last, left to settle everything. */
export class KillRuns {
  readonly #spawn: () => FixtureRun;
  readonly #runs: FixtureRun[] = [];

  /**
   * @param spawn starts a run
   */
  constructor(spawn: () => FixtureRun) {
    this.#spawn = spawn;
  }

  /**
   * Start runs and SIGKILL each at a random moment after it is ready, until `kills` of them died by SIGKILL.
   *
   * @param kills how many
   * @param hooks `ready`: once a run printed its ready line; `killed`: right after a run is sent SIGKILL
   */
  async killRepeatedly(kills: number, hooks: { ready?: (line: string) => void; killed?: () => void } = {}): Promise<void> {
    let killed = 0;
    while (killed < kills) {
      const run = this.#spawn();
      this.#runs.push(run);
      const ready = await run.lines.next("ready").catch(async (error) => {
        throw new Error(`${error.message}\nstderr: ${await run.stderr}`);
      });
      hooks.ready?.(ready);
      await Bun.sleep(50 + Math.random() * 400);
      run.child.kill("SIGKILL");
      hooks.killed?.();
      await run.child.exited;
      await run.lines.ended;
      if (run.child.signalCode === "SIGKILL") killed++;
    }
  }

  /**
   * Start the last run.
   *
   * @returns its ready line
   */
  startLast(): Promise<string> {
    this.#runs.push(this.#spawn());
    return this.last.lines.next("ready");
  }

  /** The run started last. */
  get last(): FixtureRun {
    return this.#runs[this.#runs.length - 1]!;
  }

  /**
   * The end of the last run's stderr, for an error message.
   *
   * @returns it, empty when unreadable
   */
  async lastStderr(): Promise<string> {
    return (await this.last.stderr.catch(() => "")).slice(-2000);
  }

  /**
   * Wait for `work`; when it fails, SIGKILL the last run and add its stderr to the error.
   *
   * @param work what the last run must bring about
   * @returns what `work` resolves with
   */
  async orKillLast<T>(work: Promise<T>): Promise<T> {
    try {
      return await work;
    } catch (error) {
      this.last.child.kill("SIGKILL");
      throw new Error(`${(error as Error).message}; stderr of the last run: ${await this.lastStderr()}`);
    }
  }

  /** SIGTERM the last run: it must exit 0. */
  async stopLast(): Promise<void> {
    const last = this.last;
    last.child.kill("SIGTERM");
    expect(await last.child.exited, await last.stderr).toBe(0);
    await last.lines.ended;
  }

  /**
   * Every line every run printed.
   *
   * @returns them
   */
  lines(): string[] {
    return this.#runs.flatMap((r) => r.lines.all());
  }

  /**
   * The `dead <key>` lines (dead-lettered sends) of every run.
   *
   * @returns them
   */
  deadLines(): string[] {
    return this.lines().filter((l) => l.startsWith("dead "));
  }

  /**
   * The outbox keys some run reported ambiguous (`ambiguous <key>` lines).
   *
   * @returns them
   */
  ambiguousKeys(): Set<string> {
    return new Set(this.lines().filter((l) => l.startsWith("ambiguous ")).map((l) => l.slice("ambiguous ".length)));
  }

  /** SIGKILL every run (the end of a test, passed or not). */
  killAll(): void {
    for (const run of this.#runs) run.child.kill("SIGKILL");
  }
}

/**
 * Send updates one after another, a random pause apart, until stopped.
 *
 * @param send sends the `i`-th update
 * @param maxPauseMs the longest pause above 5 ms
 * @returns stops it; resolves once the last update is sent
 */
export function streamUpdates(send: (i: number) => void, maxPauseMs: number): () => Promise<void> {
  let streaming = true;
  const stream = (async () => {
    for (let i = 0; streaming; i++) {
      send(i);
      await Bun.sleep(5 + Math.random() * maxPauseMs);
    }
  })();
  return () => {
    streaming = false;
    return stream;
  };
}

/**
 * How many times the fake Bot API got each message text.
 *
 * @param fake the fake
 * @returns text → count
 */
export function sentCounts(fake: FakeTelegram): Map<string, number> {
  const counts = new Map<string, number>();
  for (const sent of fake.sent) counts.set(String(sent.params.text), (counts.get(String(sent.params.text)) ?? 0) + 1);
  return counts;
}
