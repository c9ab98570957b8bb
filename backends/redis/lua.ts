/**
 * The Lua scripts of the Redis backend (`backends/redis/`): every
 * transition that touches more than one key is one script, run atomically by
 * the server. They restate the rules of `src/rules.ts` in Lua; the
 * conformance suite keeps both equal.
 *
 * Conventions shared by every script:
 * - `ARGV[1]` is the hash-tagged key prefix (`{botmesh:}`); every key a script
 *   touches starts with it, so all of them live in one slot of a Redis Cluster.
 *   `KEYS[1]` is one such key, so that a cluster client routes the call.
 * - Time is `redis.call('TIME')` (the server's clock), in ms.
 * - A record is a hash whose fields are strings; a `null` field is absent.
 *   Scripts read it with one `HMGET` of its journal's field list (`IN_FIELDS`,
 *   `OUT_FIELDS`, rendered from `INBOX_FIELDS` and `OUTBOX_FIELDS` below):
 *   a field of neither list is neither read nor returned. Payloads and
 *   contents are JSON text whose syntax the reads that hand a record out check
 *   (`json_ok`), with every other field the reader checks, so that a record
 *   the reader cannot read is set aside, never claimed; the lease holder's own
 *   writes read all but the payload or content (`IN_FIELDS_HELD`,
 *   `OUT_FIELDS_HELD`) and check those.
 * - Every script returns ONE string, `cjson.encode` of a table of strings (a
 *   record is its field-value array, as `HGETALL` answers). Lua numbers are
 *   formatted by `n2s` first, so nothing numeric goes through cjson. An empty
 *   table encodes as `{}`: the caller reads it as an empty array.
 *
 * @module
 */
import {
  INBOX as INBOX_TABLE,
  INBOX_STATES,
  luaSet,
  OUTBOX as OUTBOX_TABLE,
  OUTBOX_STATES,
  type StateFlag,
  type StateTable,
  statesWhere,
  theState,
} from "../../src/machine.ts";
import { SCAN_ANSWER_KEEP_MS } from "../../src/contract.ts";
import { ACTIVE_INBOX_STATES, BLOCKING_OUTBOX_STATES, TIMER_STATE, WRITER_TOKEN } from "../../src/rules.ts";
import { LUA_FILES } from "./lua_files.ts";

/**
 * A journal's state table as a Lua table, so that the scripts follow it: `leased` the leased state,
 * `due[state]` when a state is due ('always', 'nextAttemptAt', 'leaseExpiry'; nil: never), and the sets
 * `retryable`, `purgeable`, `discardable`, `late` (accepts a late outcome).
 */
function luaMachine<S extends string>(table: StateTable<S>): string {
  const set = (flag: StateFlag) => `{${luaSet(statesWhere(table, flag))}}`;
  const due = statesWhere(table, (t) => t.due !== "never").map((s) => `${s} = '${table[s].due}'`).join(", ");
  return `{leased = '${theState(table, "leased")}', due = {${due}}, retryable = ${set("retryable")}, purgeable = ${
    set("purgeable")
  }, discardable = ${set("discardable")}, late = ${set("acceptsLateOutcome")}}`;
}

/**
 * The first statement of every script (after `P`): in a Redis Cluster, while this node migrates or
 * imports the key prefix's slot (a resharding), some of the prefix's keys are on the other node. A
 * script run there would read a key that is not here as missing (on the importing node, which an
 * `ASK` sends the call to: a record, a lease, an index silently absent), or fail at such a key after
 * its first writes (on the migrating node: "Script attempted to access a non local key", and Lua does
 * not roll back); a key it writes on the importing node makes the operator's MIGRATE of that key fail
 * (BUSYKEY). A two-key EXISTS of keys that never exist fails exactly then (inside a script, Redis
 * refuses it on both nodes) and answers 0 everywhere else (a single server too). So the script answers
 * TRYAGAIN before it reads or writes anything: the client retries (ioredis' Cluster does, after
 * `retryDelayOnTryAgain`; the runner too, see {@link TRYAGAIN_RETRY_MS}), and once the slot is settled
 * on one node the call runs there, on every key.
 */
export function slotGuard(tag: string): string {
  return `do
  local guard = redis.pcall('EXISTS', ${tag} .. 'slot-guard:1', ${tag} .. 'slot-guard:2')
  if type(guard) == 'table' and guard.err then
    return redis.error_reply('TRYAGAIN botmesh: the hash slot of the key prefix ' .. ${tag} ..
      ' is being migrated to or from this node (' .. tostring(guard.err) .. '): the script did nothing; retry')
  end
end
`;
}

/** One script: its name (for errors) and full text. */
export interface LuaScript {
  readonly name: string;
  readonly text: string;
  /**
   * Whether the script is run once per request id: the caller passes `KEYS[2]`
   * (`<prefix>rq:<random id>`), and a second run with the same key returns the
   * first run's reply instead of running again. See {@link REQUEST_TTL_MS}.
   */
  readonly once: boolean;
  /** The script's own part (without the shared functions), for {@link BATCH}. */
  readonly body: string;
}

/**
 * How long (ms) a mutating script's reply is kept under its request key.
 *
 * A reply can be lost after the server ran the script (a dropped connection),
 * and clients send the same call again: ioredis re-sends unfulfilled commands
 * after a reconnect by default, `@upstash/redis` retries a failed fetch. Run
 * twice, a script would answer differently (an admit `null`, a `markSent`
 * stale although it is sent, a `claimDue` whose records are leased but never
 * returned). So every mutating script is idempotent per call: the caller
 * passes a random request id in `KEYS[2]`; the script returns the reply stored
 * there when there is one, else runs and stores its reply with `SET … PX`.
 *
 * Memory: one key per mutating call (one per batch call of the hot-path
 * writes, see {@link BATCH}), kept this long. Most replies are a few bytes (an
 * admission or a reservation answers its state and times, not the record;
 * an existing entry that `reserve` finds is the exception); a `claimDue` reply holds the claimed records (up to `limit`, with
 * their payloads), so a busy bot keeps about two minutes of claimed records a
 * second time. The reads (get, list, damaged, time; a get or list that
 * meets a damaged record sets it aside, which a second run finds done) and
 * the naturally idempotent session-store writes store nothing.
 *
 * A due scan named by the caller (`ClaimDueOptions.requestId`) gets the request key
 * `<prefix>rq:scan:<in|out>:<requestId>` instead of a random one, so that its reply can be read again
 * by a repeat (`scanAnswer`); that key is kept for `SCAN_ANSWER_KEEP_MS` instead. A repeat closes
 * the request: it sets the key to the journal's empty answer unless it is there (`SET NX`), so that a
 * late run of the scan answers that without running.
 */
export const REQUEST_TTL_MS = 120_000;

/** The Lua sources: a header of comment lines (up to a line `--`), then the body. */
function source(name: string): { header: string[]; body: string } {
  const text = LUA_FILES[name];
  if (text === undefined) throw new Error(`no Lua source backends/redis/lua/${name}.lua`);
  const end = text.indexOf("\n--\n");
  if (end < 0) throw new Error(`backends/redis/lua/${name}.lua has no header (comment lines, then a line "--")`);
  return { header: text.slice(0, end).split("\n"), body: text.slice(end + 4) };
}

/** The value of a header line `-- <key>: <value>`. */
function headerValue(name: string, header: string[], key: string): string {
  const line = header.find((l) => l.startsWith(`-- ${key}: `));
  if (line === undefined) throw new Error(`backends/redis/lua/${name}.lua: no "-- ${key}:" line in its header`);
  return line.slice(key.length + 5);
}

/** An inbox record's fields, the order a script reads them in (one `HMGET`). */
const INBOX_FIELDS = [
  "id", "kind", "chatId", "provider", "payload", "receivedAt", "state", "attempts", "nextAttemptAt",
  "leaseOwner", "leaseInc", "leaseToken", "leaseExp", "fence", "error", "updatedAt", "om",
] as const;
/** An outbox entry's fields, the order a script reads them in. */
const OUTBOX_FIELDS = [
  "key", "chatId", "content", "contentHash", "inboundId", "state", "attempts", "nextAttemptAt",
  "leaseOwner", "leaseInc", "leaseToken", "leaseExp", "fence", "called", "messageId", "error", "seq", "createdAt", "updatedAt",
] as const;

/**
 * A journal's field lists as Lua locals: `<name>` every field, `<name>_HELD` all but `held` (the
 * payload or content, which the holder's own writes do not read), and for each a function that makes
 * the record's table from the `HMGET` reply in one constructor: its size is known at once, where a
 * table filled field by field is resized five times on the way to 17 fields.
 */
function luaFields(name: string, fields: readonly string[], held: string): string {
  const list = (fs: readonly string[]) => `{${fs.map((f) => `'${f}'`).join(", ")}}`;
  const make = (list: string, fs: readonly string[]) =>
    `function(r) return {_key = false, _o = r, _fields = ${list}, ${fs.map((f, i) => `${f} = r[${i + 1}]`).join(", ")}} end`;
  const heldFields = fields.filter((f) => f !== held);
  return [
    `local ${name} = ${list(fields)}`,
    `local ${name}_HELD = ${list(heldFields)}`,
    `local ${name}_MAKE = ${make(name, fields)}`,
    `local ${name}_HELD_MAKE = ${make(`${name}_HELD`, heldFields)}`,
  ].join("\n");
}

/** What the sources name as `{{NAME}}`: the state table rendered for Lua, and the constants. */
const VALUES: { readonly [name: string]: string } = {
  INBOX_FIELDS: luaFields("IN_FIELDS", INBOX_FIELDS, "payload"),
  OUTBOX_FIELDS: luaFields("OUT_FIELDS", OUTBOX_FIELDS, "content"),
  SLOT_GUARD: slotGuard("P"),
  INBOX_STATES_SET: luaSet(INBOX_STATES),
  INBOX_MACHINE: luaMachine(INBOX_TABLE),
  ACTIVE_INBOX_STATES_SET: luaSet(ACTIVE_INBOX_STATES),
  ACTIVE_INBOX_STATES_LIST: ACTIVE_INBOX_STATES.map((s) => `'${s}'`).join(", "),
  BLOCKING_OUTBOX_STATES_SET: luaSet(BLOCKING_OUTBOX_STATES),
  OUTBOX_MACHINE: luaMachine(OUTBOX_TABLE),
  OUTBOX_STATES_SET: luaSet(OUTBOX_STATES),
  TIMER_STATE,
  WRITER_TOKEN: String(WRITER_TOKEN),
  REQUEST_TTL_MS: String(REQUEST_TTL_MS),
  SCAN_ANSWER_KEEP_MS: String(SCAN_ANSWER_KEEP_MS),
};

/** `text` with each `{{NAME}}` replaced by its value (one pass: a value is not scanned again). */
function fill(name: string, text: string, values: { readonly [name: string]: string } = VALUES): string {
  return text.replace(/\{\{([A-Z_]+)\}\}/g, (_, key: string) => {
    const value = values[key];
    if (value === undefined) throw new Error(`backends/redis/lua/${name}.lua: unknown placeholder {{${key}}}`);
    return value;
  });
}

/** An include's text (its body, filled). */
const include = (name: string): string => fill(name, source(name).body);

/** A script from its source: the prelude and its includes, its body; run once per request when its header says so. */
function script(file: string): LuaScript {
  const { header, body: raw } = source(file);
  const name = headerValue(file, header, "botmesh redis script");
  const parts = headerValue(file, header, "include").split(" ").filter((p) => p !== "-");
  const once = headerValue(file, header, "once").startsWith("yes");
  const body = fill(file, raw);
  const head = `-- botmesh redis backend: ${name}\n${include("prelude")}${parts.map(include).join("")}\n`;
  if (!once) return { name, text: `${head}${body}`, once, body };
  return { name, once, body, text: fill("once", source("once").body, { ...VALUES, HEAD: head, BODY: body }) };
}

/** The scripts, by operation name; each is `backends/redis/lua/<name in snake case>.lua`. */
const SCRIPT_NAMES = [
  "inAdmit",
  "inClaim",
  "inClaimDue",
  "inHeartbeat",
  "inStart",
  "inFinish",
  "inReplay",
  "inPurge",
  "inGet",
  "inSetAside",
  "inList",
  "inDamaged",
  "inReportDamaged",
  "outReserve",
  "outClaimDue",
  "outHeartbeat",
  "outMarkCalling",
  "outFinish",
  "outRetry",
  "outDiscard",
  "outPurge",
  "outGet",
  "outSetAside",
  "outList",
  "outDamaged",
  "outReportDamaged",
  "storeGet",
  "storeSet",
  "storeDelete",
  "kvGet",
  "kvSet",
  "kvDelete",
  "kvList",
  "time",
  "scanAnswer",
] as const;

/** The name of a script of {@link SCRIPTS}. */
export type ScriptName = typeof SCRIPT_NAMES[number];

/** The scripts, by operation. */
export const SCRIPTS: { readonly [K in ScriptName]: LuaScript } = Object.fromEntries(
  SCRIPT_NAMES.map((name) => [name, script(name.replace(/[A-Z]/g, (c) => `_${c.toLowerCase()}`))]),
) as { readonly [K in ScriptName]: LuaScript };

/**
 * The operations {@link BATCH} runs: the writes of the hot path (admission, reply, send, completion,
 * heartbeats). Their scripts need only the inbox and outbox functions, and their replies are small.
 */
export const BATCHED: readonly BatchedName[] = [
  "inAdmit",
  "inStart",
  "inHeartbeat",
  "inFinish",
  "outReserve",
  "outHeartbeat",
  "outMarkCalling",
  "outFinish",
];

/** The name of an operation {@link BATCH} runs. */
export type BatchedName =
  | "inAdmit"
  | "inStart"
  | "inHeartbeat"
  | "inFinish"
  | "outReserve"
  | "outHeartbeat"
  | "outMarkCalling"
  | "outFinish";

/**
 * Several operations in one script call: the writes issued in one turn of the event loop go to Redis
 * together. ARGV: P, then per operation its name, once (0|1: whether it is run once per request, see
 * {@link LuaScript.once}), the number of its arguments, and its arguments (after P). Each operation runs
 * as its own script would, in order, each under `pcall`: one that fails (a script error) answers
 * `{"err": message}` and the others go on, as if each had been its own call. The reply is the JSON array
 * of their replies.
 *
 * Run once per request: with `KEYS[2]` the replies of the `once` operations are stored there (joined by
 * newlines: cjson never writes a raw one), and a second run answers those from it and runs the others
 * (`outbox.markCalling`) again, as a re-sent call of its own script would.
 */
export const BATCH: LuaScript = {
  name: "batch",
  once: true,
  body: "",
  text: fill("batch", source("batch").body, {
    ...VALUES,
    INCLUDES: include("prelude") + include("inbox") + include("outbox"),
    OPS: BATCHED.map((name, i) => `      ${i === 0 ? "if" : "elseif"} name == '${name}' then f = function()\n${SCRIPTS[name].body}\n      end`).join("\n") + "\n      end",
  }),
};

/** The prelude's reading of the server's clock, which {@link withTestClock} replaces. */
const SERVER_TIME = `    local t = redis.call('TIME')
    NOW = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)`;
const testClockVariants = new WeakMap<LuaScript, LuaScript>();

/**
 * `script` reading the time from its first key (`<prefix>clock:<ms>`) instead of the server's clock:
 * the variant a backend with a test clock (option `clock`) runs.
 * @param script a script of {@link SCRIPTS}, or {@link BATCH}
 * @returns its variant (one per script)
 */
export function withTestClock(script: LuaScript): LuaScript {
  let variant = testClockVariants.get(script);
  if (variant === undefined) {
    if (script.text.split(SERVER_TIME).length !== 2) throw new Error(`the script ${script.name} does not read the server's clock once`);
    // A replacer function: the text holds "$'", which a replacement string would expand.
    variant = { ...script, text: script.text.replace(SERVER_TIME, () => "    NOW = tonumber(string.match(KEYS[1], 'clock:(%d+)$'))") };
    testClockVariants.set(script, variant);
  }
  return variant;
}
