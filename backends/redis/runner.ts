/**
 * The script runner: `EVALSHA` of the backend's Lua scripts over one client
 * under one key prefix (loading a script again on `NOSCRIPT`), the batching
 * of the hot path's writes of one turn into one call, and the decoding of
 * script replies.
 *
 * @module
 */
import { errorMessage } from "../../src/errors.ts";
import { showValue as show } from "../../src/show.ts";
import { nextTurn } from "../../src/runtime/mod.ts";
import { BATCH, BATCHED, type BatchedName, type LuaScript, type ScriptName, SCRIPTS, withTestClock } from "./lua.ts";
import type { RedisCommands } from "./clients.ts";
import type { Resolved } from "./options.ts";

const shaCache = new WeakMap<LuaScript, Promise<string>>();

/**
 * The SHA-1 of a script's text, as `EVALSHA` names it.
 * @param text the script
 * @returns its SHA-1 in hex
 */
export async function sha1Hex(text: string): Promise<string> {
  const digest = await crypto.subtle.digest("SHA-1", new TextEncoder().encode(text));
  let out = "";
  for (const b of new Uint8Array(digest)) out += b.toString(16).padStart(2, "0");
  return out;
}

function shaOf(script: LuaScript): Promise<string> {
  let sha = shaCache.get(script);
  if (!sha) {
    sha = sha1Hex(script.text);
    shaCache.set(script, sha);
  }
  return sha;
}

/**
 * `EVALSHA` of a script; a `NOSCRIPT` answer (a restarted or flushed server, a replica promoted by a
 * failover) loads it and runs it again; a `TRYAGAIN` answer (see {@link TRYAGAIN_RETRY_MS}) sends it
 * again, for up to that long.
 * @param commands the client
 * @param text the script
 * @param sha its SHA-1 ({@link sha1Hex})
 * @param keys its keys
 * @param argv its arguments
 * @returns the script's reply
 */
export async function evalScript(commands: RedisCommands, text: string, sha: string, keys: string[], argv: string[]): Promise<unknown> {
  const started = Date.now();
  for (let attempt = 0;; attempt++) {
    try {
      return await evalLoading(commands, text, sha, keys, argv);
    } catch (error) {
      // A TRYAGAIN answer (the slot guard of the scripts, or Redis refusing a multi-key call during a
      // slot migration) comes before the script ran: running it again is safe. So does ioredis'
      // Cluster "Too many Cluster redirections" once its own retries are spent (it counts MOVED, ASK,
      // TRYAGAIN and CLUSTERDOWN answers only: a call sent on from node to node, never run).
      if (!RETRIED.test(errorMessage(error)) || Date.now() - started >= TRYAGAIN_RETRY_MS) throw error;
      await new Promise((resolve) => setTimeout(resolve, Math.min(50 * 2 ** attempt, 1_000)));
    }
  }
}

/**
 * How long (ms) a script answered `TRYAGAIN` (its hash slot being migrated between two nodes of a
 * Redis Cluster, see `slotGuard` in lua.ts) is sent again before the error is thrown.
 */
export const TRYAGAIN_RETRY_MS = 10_000;
const RETRIED = /\bTRYAGAIN\b|Too many Cluster redirections/;

async function evalLoading(commands: RedisCommands, text: string, sha: string, keys: string[], argv: string[]): Promise<unknown> {
  try {
    return await commands.evalsha(sha, keys, argv);
  } catch (error) {
    if (!/NOSCRIPT/.test(errorMessage(error))) throw error;
    await commands.scriptLoad(text);
    return await commands.evalsha(sha, keys, argv);
  }
}

const BATCHABLE: ReadonlySet<string> = new Set<string>(BATCHED);
/** Operations per batch script call (a call blocks the server while it runs). */
const BATCH_MAX = 64;
/** Batch calls in flight at once; the operations issued meanwhile wait and go together in the next one. */
const BATCH_IN_FLIGHT = 2;

interface Pending {
  name: BatchedName;
  args: readonly string[];
  resolve(value: unknown): void;
  reject(error: unknown): void;
}

/**
 * Runs the backend's scripts over one client under one key prefix.
 *
 * The writes of the hot path ({@link BATCHED}) issued in one turn of the event loop go to Redis in
 * one script call ({@link BATCH}), each answered on its own. At most {@link BATCH_IN_FLIGHT} such
 * calls are in flight: the writes issued meanwhile wait for one to return, so that under load the
 * batches grow instead of the calls.
 */
export class Runner {
  readonly commands: RedisCommands;
  readonly keyPrefix: string;
  /** The hash-tagged prefix every key starts with. */
  readonly tag: string;
  /** Accept an evicting `maxmemory-policy` (see `RedisOptions.allowEviction`). */
  readonly allowEviction: boolean;
  #queue: Pending[] = [];
  #inFlight = 0;
  #scheduled = false;
  #sha = new Map<LuaScript, string>();
  /** The test clock (option `clock`), or `undefined`: scripts use the server's. */
  readonly #clock: (() => number) | undefined;

  constructor(resolved: Resolved) {
    this.commands = resolved.commands;
    this.keyPrefix = resolved.keyPrefix;
    this.tag = `{${resolved.keyPrefix}}`;
    this.allowEviction = resolved.allowEviction;
    this.#clock = resolved.clock;
  }

  #failure(name: string, error: unknown): Error {
    return new Error(`Redis ${name} (key prefix ${JSON.stringify(this.keyPrefix)}) failed: ${errorMessage(error)}`, {
      cause: error,
    });
  }

  /** `EVALSHA` of `script`; a `NOSCRIPT` answer loads it and runs it again. */
  async #eval(script: LuaScript, keys: string[], argv: string[]): Promise<unknown> {
    if (this.#clock !== undefined) {
      // The test clock's time travels as the first key (in the prefix's slot), read by the script's variant.
      script = withTestClock(script);
      keys = [`${this.tag}clock:${Math.floor(this.#clock())}`, ...keys.slice(1)];
    }
    const sha = this.#sha.get(script) ?? await shaOf(script);
    this.#sha.set(script, sha);
    return await evalScript(this.commands, script.text, sha, keys, argv);
  }

  /**
   * Runs script `name` with `args` (after the prefix) and returns its decoded
   * reply. A `NOSCRIPT` answer loads the script and runs it again.
   * @param requestKey `KEYS[2]` (see {@link scanKey}): the request key of a script run once per
   *   request, instead of a random one, or the key the `scanAnswer` script reads; the call is then
   *   never batched
   */
  run(name: ScriptName, args: readonly string[], requestKey?: string): Promise<unknown> {
    if (requestKey !== undefined) return this.#runAlone(name, args, requestKey);
    if (BATCHABLE.has(name)) {
      return new Promise((resolve, reject) => {
        this.#queue.push({ name: name as BatchedName, args, resolve, reject });
        this.#schedule();
      });
    }
    return this.#runAlone(name, args);
  }

  /**
   * The request key of a due scan of `journal` named `requestId` (`ClaimDueOptions.requestId`): in the
   * prefix's hash slot, apart from the random request keys (a UUID never starts with `scan:`), and from
   * the other journal's scans.
   */
  scanKey(journal: "in" | "out", requestId: string): string {
    return `${this.tag}rq:scan:${journal}:${requestId}`;
  }

  async #runAlone(name: ScriptName, args: readonly string[], requestKey?: string): Promise<unknown> {
    const script = SCRIPTS[name];
    // A mutating script runs once per call: a re-sent call (after a lost reply) gets the first run's reply.
    const rq = requestKey ?? (script.once ? `${this.tag}rq:${crypto.randomUUID()}` : undefined);
    const keys = rq === undefined ? [this.tag] : [this.tag, rq];
    let reply: unknown;
    try {
      reply = await this.#eval(script, keys, [this.tag, ...args]);
    } catch (error) {
      throw this.#failure(script.name, error);
    }
    return decodeReply(reply, script.name);
  }

  #schedule(): void {
    if (this.#scheduled || this.#inFlight >= BATCH_IN_FLIGHT || this.#queue.length === 0) return;
    this.#scheduled = true;
    // With nothing in flight, the call waits for the end of the turn to take what the rest of it issues
    // (a handler's done mark with its reply's outcome); behind a call in flight, what waits goes at once.
    (this.#inFlight > 0 ? queueMicrotask : nextTurn)(() => {
      this.#scheduled = false;
      while (this.#inFlight < BATCH_IN_FLIGHT && this.#queue.length > 0) {
        void this.#flush(this.#queue.splice(0, BATCH_MAX));
      }
    });
  }

  async #flush(batch: Pending[]): Promise<void> {
    this.#inFlight++;
    try {
      const argv = [this.tag];
      let once = false;
      for (const op of batch) {
        const script = SCRIPTS[op.name];
        once ||= script.once;
        argv.push(op.name, script.once ? "1" : "0", String(op.args.length), ...op.args);
      }
      // One request key for the call, when an operation in it is run once per request.
      const keys = once ? [this.tag, `${this.tag}rq:${crypto.randomUUID()}`] : [this.tag];
      let replies: unknown[];
      try {
        const decoded = decodeReply(await this.#eval(BATCH, keys, argv), BATCH.name);
        if (!Array.isArray(decoded) || decoded.length !== batch.length) {
          throw new Error(`the batch's reply has ${Array.isArray(decoded) ? decoded.length : "no"} answers for ${batch.length} operations`);
        }
        replies = decoded;
      } catch (error) {
        for (const op of batch) op.reject(this.#failure(SCRIPTS[op.name].name, error));
        return;
      }
      batch.forEach((op, i) => {
        const r = replies[i];
        if (typeof r === "object" && r !== null && !Array.isArray(r) && typeof (r as { err?: unknown }).err === "string") {
          op.reject(this.#failure(SCRIPTS[op.name].name, new Error((r as { err: string }).err)));
        } else {
          op.resolve(r);
        }
      });
    } finally {
      this.#inFlight--;
      this.#schedule();
    }
  }

  /** The server's time (ms since epoch). */
  async now(): Promise<number> {
    const [t] = strings(await this.run("time", []));
    return Number(t);
  }
}

/**
 * A script's reply: the JSON text it returned (an Upstash client with
 * automatic deserialization has already parsed it).
 */
function decodeReply(reply: unknown, name: string): unknown {
  if (typeof reply === "string") {
    try {
      return JSON.parse(reply);
    } catch (error) {
      throw new Error(`Redis ${name}: the script's reply is not JSON: ${errorMessage(error)}`);
    }
  }
  if (reply instanceof Uint8Array) return decodeReply(new TextDecoder().decode(reply), name);
  if (typeof reply === "object" && reply !== null) return reply;
  throw new Error(`Redis ${name}: unexpected script reply ${show(reply)}`);
}

/** A decoded array (cjson encodes an empty one as `{}`). */
export function list(value: unknown): unknown[] {
  return Array.isArray(value) ? value : [];
}

export function strings(value: unknown): string[] {
  return list(value).map((v) => String(v));
}
