// What the conformance suite does not cover on Redis: options and client validation, the NOSCRIPT
// fallback, the server's clock, O(due) scans, the store's TTL, the kv's CAS/versions/byte order,
// an events outbox on the kv, damaged records set aside, and the chat index of records written before it.
import { afterAll, describe, expect, test } from "bun:test";
import IORedis from "ioredis";
import { Redis as Upstash } from "@upstash/redis";
import { createClient } from "redis";
import { RedisClient } from "bun";
import {
  DamagedRecordError,
  type InboundRecord,
  type InboundState,
  type Lease,
  type OutboxEntry,
  type OutboxState,
  SCAN_ANSWER_KEEP_MS,
  StaleLeaseError,
} from "../src/contract.ts";
import { INBOX as INBOX_TABLE, OUTBOX as OUTBOX_TABLE } from "../src/machine.ts";
import { ACTIVE_INBOX_STATES } from "../src/rules.ts";
import { Prng } from "../src/testing/sim/prng.ts";
import { MAX_STORED_DEPTH } from "../src/content.ts";
import {
  fromBunRedis,
  fromIoredis,
  fromNodeRedis,
  fromUpstash,
  type RedisCommands,
  RedisDurability,
  RedisKv,
  RedisStore,
} from "../backends/redis/mod.ts";
import { EventsDurability, MemoryEventJournal } from "../backends/events/mod.ts";
import { REQUEST_TTL_MS } from "../backends/redis/lua.ts";
import { LUA_FILES } from "../backends/redis/lua_files.ts";
import { runBackendContract } from "../testing.ts";
import { REDIS_URL, runId, serviceSkip } from "./support/services.ts";
import { startUpstashBridge, type UpstashBridge } from "./support/upstash_bridge.ts";

const skip = await serviceSkip("redis");
const admin = skip ? null : new IORedis(REDIS_URL);
const prefixes: string[] = [];
const clients: IORedis[] = [];

function prefix(): string {
  const p = `bm-test:${runId()}:`;
  prefixes.push(p);
  return p;
}

function client(): IORedis {
  const c = new IORedis(REDIS_URL);
  clients.push(c);
  return c;
}

async function dropPrefix(keyPrefix: string): Promise<void> {
  let cursor = "0";
  do {
    const [next, keys] = await admin!.scan(cursor, "MATCH", `{${keyPrefix}}*`, "COUNT", 10_000);
    cursor = next;
    if (keys.length > 0) await admin!.del(...keys);
  } while (cursor !== "0");
}

/** A script of the prelude's functions (without its slot guard) and then `body`. */
function withPrelude(body: string): string {
  const prelude = LUA_FILES.prelude!;
  return `${prelude.slice(prelude.indexOf("\n--\n") + 4).replace("{{SLOT_GUARD}}", "")}\n${body}\n`;
}

// Scans the whole keyspace once per prefix (the O(due) test also leaves ~80k request keys, expiring on their own).
afterAll(async () => {
  for (const p of prefixes) await dropPrefix(p);
  for (const c of clients) c.disconnect();
  admin?.disconnect();
}, 120_000);

const claimer = (owner = "owner-a", leaseMs = 60_000) => ({ owner, incarnation: `inc-${owner}`, leaseMs });
const inbound = (id: string, chatId = "c1", receivedAt = 1_700_000_000_000) => ({
  id,
  kind: "message" as const,
  chatId,
  provider: "test",
  payload: { text: "hi" },
  receivedAt,
});

function errorOf(run: () => unknown): Error {
  try {
    run();
  } catch (error) {
    return error as Error;
  }
  throw new Error("expected an error");
}

async function rejection(run: () => Promise<unknown>): Promise<Error> {
  try {
    await run();
  } catch (error) {
    return error as Error;
  }
  throw new Error("expected a rejection");
}

/** INFO commandstats calls of one command. */
async function calls(command: string): Promise<number> {
  const info = await admin!.info("commandstats");
  const m = new RegExp(`cmdstat_${command}:calls=(\\d+)`).exec(info);
  return m ? Number(m[1]) : 0;
}

describe("options and clients", () => {
  test("bad options are refused with an error naming the option and quoting the value", () => {
    const cases: [unknown, new (...args: never[]) => Error, RegExp][] = [
      [undefined, TypeError, /must be an object with a "client", got undefined/],
      [{ client: { get: () => 1 } }, TypeError, /Redis option "client" must be an @upstash\/redis client.*got \{\}/],
      [{ client: "redis://localhost" }, TypeError, /Redis option "client" .*got "redis:\/\/localhost"/],
      [{ client: null }, TypeError, /Redis option "client" .*got null/],
      [{ client: fromIoredis({} as never), keyPrefix: "" }, RangeError, /Redis option "keyPrefix" must be 1 to 128 .*got ""/],
      [{ client: fromIoredis({} as never), keyPrefix: "a{b}" }, RangeError, /"keyPrefix" .*got "a\{b\}"/],
      [{ client: fromIoredis({} as never), keyPrefix: 7 }, TypeError, /Redis option "keyPrefix" must be a string, got 7/],
      [{ client: fromIoredis({} as never), prefix: "x" }, TypeError, /Unknown Redis option "prefix"; known options are "client", "keyPrefix"/],
    ];
    for (const Ctor of [RedisDurability, RedisStore, RedisKv]) {
      for (const [options, type, message] of cases) {
        const error = errorOf(() => new Ctor(options as never));
        expect(error).toBeInstanceOf(type);
        expect(error.message).toMatch(message);
      }
    }
  });

  test.skipIf(Boolean(skip))("every supported client is recognised when passed directly, and its adapter works", async () => {
    const bridge: UpstashBridge = await startUpstashBridge();
    const io = client();
    const nodeRedis = await createClient({ url: REDIS_URL }).connect();
    const bun = new RedisClient(REDIS_URL);
    const upstash = new Upstash({ url: bridge.url, token: bridge.token, retry: false });
    try {
      const keyPrefix = prefix();
      const direct = [io, nodeRedis, bun, upstash];
      const adapted = [fromIoredis(io), fromNodeRedis(nodeRedis as never), fromBunRedis(bun), fromUpstash(upstash)];
      for (const [i, c] of [...direct, ...adapted].entries()) {
        const backend = new RedisDurability({ client: c, keyPrefix });
        await backend.open();
        const id = `m-${i}`;
        expect((await backend.inbox.admit(inbound(id), claimer()))?.state).toBe("processing");
        // All of them see the same journal.
        expect((await backend.inbox.list({ limit: 100 })).length).toBe(i + 1);
        expect(Math.abs((await backend.now()) - Date.now())).toBeLessThan(5_000);
      }
    } finally {
      bun.close();
      await nodeRedis.destroy();
      await bridge.stop();
    }
  });
});

describe.skipIf(Boolean(skip))("redis backend", () => {
  test("NOSCRIPT after SCRIPT FLUSH: the script is loaded again and the call succeeds", async () => {
    const io = client();
    let loads = 0;
    let noscripts = 0;
    const counting: RedisCommands = {
      async evalsha(sha, keys, args) {
        try {
          return await io.evalsha(sha, keys.length, ...keys, ...args);
        } catch (error) {
          if (/NOSCRIPT/.test(String(error))) noscripts++;
          throw error;
        }
      },
      scriptLoad(script) {
        loads++;
        return io.script("LOAD", script);
      },
    };
    const backend = new RedisDurability({ client: counting, keyPrefix: prefix() });
    await admin!.script("FLUSH");
    await backend.inbox.admit(inbound("a"));
    expect(loads).toBe(1);
    await backend.inbox.admit(inbound("b"));
    expect(loads, "loaded once").toBe(1);
    await admin!.script("FLUSH");
    const again = await backend.inbox.admit(inbound("c"));
    expect(again?.state).toBe("pending");
    expect(noscripts).toBe(2);
    expect(loads).toBe(2);
    expect((await backend.inbox.list()).map((r) => r.id)).toEqual(["a", "b", "c"]);
  });

  test("NOSCRIPT over @upstash/redis (its error is an UpstashError): reloaded too", async () => {
    const bridge = await startUpstashBridge();
    try {
      const backend = new RedisDurability({
        client: new Upstash({ url: bridge.url, token: bridge.token, retry: false }),
        keyPrefix: prefix(),
      });
      await backend.outbox.reserve({ key: "k1", chatId: "c", content: { a: [] }, contentHash: "h", inboundId: null });
      await admin!.script("FLUSH");
      const before = bridge.requests;
      const e = await backend.outbox.reserve({ key: "k2", chatId: "c", content: "x", contentHash: "h", inboundId: null });
      expect(e.status).toBe("queued");
      expect(bridge.requests - before, "EVALSHA (NOSCRIPT), SCRIPT LOAD, EVALSHA").toBe(3);
      expect((await backend.outbox.list()).map((x) => [x.key, x.content])).toEqual([["k1", { a: [] }], ["k2", "x"]]);
    } finally {
      await bridge.stop();
    }
  });

  test("a script error that is not NOSCRIPT rejects with the script and key prefix named", async () => {
    const keyPrefix = prefix();
    const backend = new RedisDurability({ client: client(), keyPrefix });
    await backend.inbox.admit(inbound("x"));
    await admin!.set(`{${keyPrefix}}in:st:pending`, "not a zset");
    const error = await rejection(() => backend.inbox.claimDue({ ...claimer(), limit: 10 }));
    expect(error.message).toContain(`Redis inbox.claimDue (key prefix "${keyPrefix}") failed`);
    expect(error.message).toMatch(/WRONGTYPE/);
  });

  test("times come from the Redis server, not the replica's clock", async () => {
    const backend = new RedisDurability({ client: client(), keyPrefix: prefix() });
    const realNow = Date.now;
    Date.now = () => realNow() + 3_600_000; // this replica's clock is an hour ahead
    try {
      const r = await backend.inbox.admit(inbound("t1"), claimer("o", 5_000));
      const [sec, usec] = await admin!.time();
      const serverNow = Number(sec) * 1000 + Math.floor(Number(usec) / 1000);
      expect(Math.abs(r!.updatedAt - serverNow)).toBeLessThan(1_000);
      expect(r!.lease!.expiresAt - r!.updatedAt).toBe(5_000);
      // An hour-ahead replica does not see the lease as lapsed.
      expect(await backend.inbox.claim("t1", claimer("other"))).toBe(null);
      const e = await backend.outbox.reserve({ key: "k1", chatId: "c", content: 1, contentHash: "h", inboundId: null }, claimer("o", 5_000));
      expect(Math.abs(e.entry.createdAt - serverNow)).toBeLessThan(1_000);
      expect((await backend.outbox.claimDue({ ...claimer("other"), limit: 10 })).ambiguous).toEqual([]);
    } finally {
      Date.now = realNow;
    }
  });

  test("option clock: every script's time is the clock's (leases, due times), batched writes too; a bad one is refused naming it", async () => {
    let now = 1_900_000_000_000;
    const backend = new RedisDurability({ client: client(), keyPrefix: prefix(), clock: () => now });
    const [a, b] = await Promise.all([backend.inbox.admit(inbound("c1"), claimer("o", 1_000)), backend.inbox.admit(inbound("c2", "c2"), claimer("o", 1_000))]);
    expect([a!.updatedAt, a!.lease!.expiresAt, b!.updatedAt]).toEqual([now, now + 1_000, now]);
    expect(await backend.inbox.claim("c1", claimer("other")), "a live lease on the clock").toBe(null);
    now += 1_001;
    expect((await backend.inbox.claim("c1", claimer("other")))?.lease?.owner, "lapsed on the clock, not the server's").toBe("other");
    expect(() => new RedisDurability({ client: client(), keyPrefix: prefix(), clock: "now" as never })).toThrow(/Redis option "clock" must be a function/);
  });

  test("claimDue is O(due): 20k settled records and 3 due ones, only the due are read", async () => {
    const keyPrefix = prefix();
    const io = client();
    const backend = new RedisDurability({ client: io, keyPrefix });
    const N = 20_000;
    const batch = 2_000;
    for (let start = 0; start < N; start += batch) {
      await Promise.all(Array.from({ length: batch }, async (_, j) => {
        const i = start + j;
        const r = await backend.inbox.admit(inbound(`done-${i}`, `chat-${i % 500}`), claimer());
        await backend.inbox.complete(r!.id, 1);
        const e = await backend.outbox.reserve(
          { key: `sent-${i}`, chatId: `chat-${i}`, content: { i }, contentHash: "h", inboundId: null },
          claimer(),
        );
        await backend.outbox.markSent(e.entry.key, 1, `m-${i}`);
      }));
    }
    for (let i = 0; i < 3; i++) {
      await backend.inbox.admit(inbound(`due-${i}`, `chat-due-${i}`));
      await backend.outbox.reserve({ key: `queued-${i}`, chatId: `chat-due-${i}`, content: i, contentHash: "h", inboundId: null });
    }
    expect(await admin!.zcard(`{${keyPrefix}}in:st:done`)).toBe(N);
    expect(await admin!.zcard(`{${keyPrefix}}out:st:sent`)).toBe(N);

    const reads = ["hgetall", "hmget", "zrange", "hget"] as const;
    const count = async () => Object.fromEntries(await Promise.all(reads.map(async (c) => [c, await calls(c)] as const)));
    const before = await count();
    const inDue = await backend.inbox.claimDue({ ...claimer("b"), limit: 100 });
    const outDue = await backend.outbox.claimDue({ ...claimer("b"), limit: 100 });
    const after = await count();
    expect(inDue.map((r) => r.id).sort()).toEqual(["due-0", "due-1", "due-2"]);
    expect(outDue.due.map((e) => e.key).sort()).toEqual(["queued-0", "queued-1", "queued-2"]);
    // Each due record is read a handful of times (load, claim, return); 20k settled ones are never read.
    for (const c of reads) expect(after[c]! - before[c]!, c).toBeLessThan(50);
    expect(after.hmget! - before.hmget!, "the due records were read").toBeGreaterThan(0);

    // Retention purges in bounded batches, and only what is old enough.
    expect(await backend.inbox.purge(3_600_000)).toBe(0);
    expect(await backend.inbox.purge(0)).toBe(N);
    expect(await backend.outbox.purge(0)).toBe(N);
    expect(await admin!.zcard(`{${keyPrefix}}in:done`)).toBe(0);
    expect(await admin!.zcard(`{${keyPrefix}}in:st:done`)).toBe(0);
    expect(await admin!.zcard(`{${keyPrefix}}in:st:processing`)).toBe(3);
    expect(await admin!.zcard(`{${keyPrefix}}out:st:sent`)).toBe(0);
    expect(await admin!.zcard(`{${keyPrefix}}out:st:sending`)).toBe(3);
    expect(await admin!.exists(`{${keyPrefix}}in:r:done-0`, `{${keyPrefix}}out:r:sent-0`)).toBe(0);
  }, 120_000);

  test("keys all carry the {prefix} hash tag", async () => {
    const keyPrefix = prefix();
    const backend = new RedisDurability({ client: client(), keyPrefix });
    await backend.inbox.admit(inbound("h1", "chat {x}"), claimer());
    await backend.outbox.reserve({ key: "o{1}", chatId: "chat {x}", content: 1, contentHash: "h", inboundId: null }, claimer());
    const keys = await admin!.keys(`{${keyPrefix}}*`);
    expect(keys.length).toBeGreaterThan(5);
    // Redis Cluster hashes only the part between the first "{" and the next "}": the prefix, for every key.
    const hashTag = (k: string) => {
      const open = k.indexOf("{");
      const close = k.indexOf("}", open + 1);
      return open >= 0 && close > open + 1 ? k.slice(open + 1, close) : k;
    };
    expect(new Set(keys.map(hashTag))).toEqual(new Set([keyPrefix]));
    for (const k of keys) expect(k.startsWith(`{${keyPrefix}}`)).toBe(true);
  });

  test("a damaged record is set aside by the first call that meets it: get rejects naming key and field, nothing else changes it", async () => {
    const keyPrefix = prefix();
    const backend = new RedisDurability({ client: client(), keyPrefix });
    await backend.inbox.admit(inbound("good"));
    await backend.inbox.admit(inbound("bad-fence"));
    await backend.inbox.admit(inbound("bad-payload"));
    await backend.outbox.reserve({ key: "bad-content", chatId: "c", content: { a: 1 }, contentHash: "h", inboundId: null });
    await backend.outbox.reserve({ key: "bad-state", chatId: "c2", content: 1, contentHash: "h", inboundId: null });
    await admin!.hset(`{${keyPrefix}}in:r:bad-fence`, "fence", "abc");
    await admin!.hset(`{${keyPrefix}}in:r:bad-payload`, "payload", "{not json");
    await admin!.hset(`{${keyPrefix}}out:r:bad-content`, "content", "[1,");
    await admin!.hset(`{${keyPrefix}}out:r:bad-state`, "state", "flying");
    const raw = async (key: string) => await admin!.hgetall(`{${keyPrefix}}${key}`);
    const before = await raw("in:r:bad-payload");

    const payload = await rejection(() => backend.inbox.get("bad-payload"));
    expect(payload).toBeInstanceOf(DamagedRecordError);
    expect(payload.message).toBe(
      `Inbox record "bad-payload" in backend "redis" is damaged and set aside: the record at key "{${keyPrefix}}in:r:bad-payload" has a bad field "payload": not JSON: {not json`,
    );
    // Any call that meets one sets it aside: a claim answers null, a replay false; the hash stays as it was.
    expect(await backend.inbox.claim("bad-fence", claimer())).toBe(null);
    expect(await backend.inbox.replay("bad-fence")).toBe(false);
    const fence = await rejection(() => backend.inbox.get("bad-fence"));
    expect((fence as DamagedRecordError).problem).toBe(`the record at key "{${keyPrefix}}in:r:bad-fence" has a bad field "fence": not a number: abc`);
    const state = await rejection(() => backend.outbox.retry("bad-state").then(() => backend.outbox.get("bad-state")));
    expect((state as DamagedRecordError).problem).toBe(`the record at key "{${keyPrefix}}out:r:bad-state" has a bad field "state": flying`);
    const content = await rejection(() => backend.outbox.reserve({ key: "bad-content", chatId: "c", content: { a: 1 }, contentHash: "h", inboundId: null }));
    expect(content).toBeInstanceOf(DamagedRecordError);
    expect((content as DamagedRecordError).problem).toContain(`has a bad field "content": not JSON: [1,`);
    expect(await raw("in:r:bad-payload"), "kept as stored").toEqual(before);
    expect(await raw("in:r:bad-fence")).toMatchObject({ fence: "abc", state: "pending" });

    expect((await backend.inbox.damaged()).map((d) => [d.id, d.reported])).toEqual([["bad-payload", false], ["bad-fence", false]]);
    expect((await backend.outbox.damaged()).map((d) => d.id)).toEqual(["bad-state", "bad-content"]);
    expect((await backend.inbox.list()).map((r) => r.id)).toEqual(["good"]);
    expect((await backend.inbox.get("good"))?.state).toBe("pending");
    expect((await backend.inbox.claim("good", claimer()))?.lease?.token).toBe(2);
    await backend.inbox.complete("good", 2);
    expect((await backend.inbox.get("good"))?.state).toBe("done");
    const bad = await rejection(() => backend.inbox.damaged({ limit: -1 }));
    expect(bad).toBeInstanceOf(RangeError);
    expect(bad.message).toBe(`inbox.damaged: option "limit" must be a non-negative integer, got -1`);
  });

  test("payload syntax is checked as JSON.parse reads it: lone surrogates and nesting up to MAX_STORED_DEPTH are JSON, near misses and deeper nesting are not", async () => {
    const keyPrefix = prefix();
    const backend = new RedisDurability({ client: client(), keyPrefix });
    const deep = "[".repeat(MAX_STORED_DEPTH) + "]".repeat(MAX_STORED_DEPTH);
    const tooDeep = "[".repeat(3_000) + "]".repeat(3_000);
    const samples = [
      `"\\ud800"`, `"\\udc00x\\ud83d\\ude00"`, deep, `{"a":[1,-2.5e-3,{"b":null}],"c":"q\\"\\\\\\/\\b\\f\\n\\r\\t"}`,
      ` \t\r\n1 `, `-0`, `0.0E+00`, `1e999`, `""`, `{}`, `[]`, `true`, `false`, `null`, `"é \u{1F600} \x7f"`,
      `{bad`, ``, ` `, `01`, `1.`, `.5`, `+1`, `-`, `1e`, `1e+`, `NaN`, `Infinity`, `0x10`, `[1,]`, `{"a":1,}`, `{"a" 1}`,
      `{a:1}`, `'a'`, `"\\x"`, `"\\u12"`, `"\\u12g4"`, `"a`, `"a\tb"`, `"a\u0000b"`, `tru`, `nul`, `[1 2]`, `1 2`,
      `{"a":1}}`, `[`, `]`, `[[]`, `{"a":[}`, `\u00a01`, `\ufeff1`, `"\\`, `{"a":1 "b":2}`, `[,1]`, `{,}`, `truex`, tooDeep,
    ];
    // JSON as JSON.parse reads it, nested no deeper than a stored value may be.
    const parses = (text: string) => {
      try {
        JSON.parse(text);
        return text !== tooDeep;
      } catch {
        return false;
      }
    };
    for (const [i, text] of samples.entries()) {
      await backend.inbox.admit(inbound(`m${i}`, "c", 1_000 + i));
      await admin!.hset(`{${keyPrefix}}in:r:m${i}`, "payload", text);
    }
    const good = samples.flatMap((text, i) => parses(text) ? [`m${i}`] : []);
    const bad = samples.flatMap((text, i) => parses(text) ? [] : [`m${i}`]);
    expect(good.length).toBe(15);
    expect((await backend.inbox.list({ limit: 1_000 })).map((r) => r.id), "read by list").toEqual(good);
    expect((await backend.inbox.damaged({ limit: 1_000 })).map((d) => d.id), "set aside by list").toEqual(bad);
    expect((await backend.inbox.get("m0"))?.payload).toBe("\ud800");
    expect(((await backend.inbox.get("m2"))?.payload as unknown[]).length).toBe(1);
    expect((await backend.inbox.claimDue({ ...claimer(), limit: 1_000 })).map((r) => r.id)).toEqual(good);
  });

  test("the numeric field check: what the journal writes passes at once, anything else is read by tonumber as before", async () => {
    // need_num's verdict (1: a problem) for each value, with no kind (any finite number), 'count' (a safe
    // integer >= 0) and 'pos' (a safe integer > 0).
    const script = withPrelude(`local out = {}
for i = 2, #ARGV do
  for _, kind in ipairs({false, 'count', 'pos'}) do
    out[#out + 1] = need_num({_key = 'k', f = ARGV[i]}, 'f', false, kind or nil) and 1 or 0
  end
end
return out`);
    const cases: [string, [number, number, number]][] = [
      ["0", [0, 0, 1]], ["1", [0, 0, 0]], ["1733567890123", [0, 0, 0]], ["999999999999999", [0, 0, 0]],
      ["9007199254740991", [0, 0, 0]], ["9007199254740992", [0, 1, 1]], ["007", [0, 0, 0]], ["00", [0, 0, 1]],
      ["1.5", [0, 1, 1]], ["1e3", [0, 0, 0]], ["-3", [0, 1, 1]], ["-0", [0, 0, 1]], ["0x10", [0, 0, 0]], [" 5", [0, 0, 0]],
      ["5 ", [0, 0, 0]], ["", [1, 1, 1]], ["abc", [1, 1, 1]], ["1a", [1, 1, 1]], ["inf", [1, 1, 1]], ["nan", [1, 1, 1]],
      ["1e400", [1, 1, 1]], ["123456789012345678901", [0, 1, 1]],
    ];
    const got = await admin!.eval(script, 0, "{p}", ...cases.map(([v]) => v)) as number[];
    expect(cases.map(([v], i) => [v, got.slice(3 * i, 3 * i + 3)])).toEqual(cases);
  });

  test("a save of a field outside the record's field list is an error, never a loop", async () => {
    const script = withPrelude(`local h = {_key = P .. 'k', _o = {'1', false}, _fields = {'a', 'b'}, a = '2', b = '3', c = '4'}
save(h, {'b'})
local first = redis.call('HGET', P .. 'k', 'b')
local ok, err = pcall(save, h, {'c'})
redis.call('DEL', P .. 'k')
return {first, tostring(ok), type(err) == 'table' and err.err or tostring(err)}`);
    const keyPrefix = prefix();
    expect(await admin!.eval(script, 1, `{${keyPrefix}}k`, `{${keyPrefix}}`)).toEqual([
      "3",
      "false",
      `ERR botmesh: the field "c" is not one of the record at key "{${keyPrefix}}k"`,
    ]);
  });

  test("the scripts' JSON check agrees with JSON.parse on thousands of near-JSON texts (seeded)", async () => {
    // The prelude's json_ok run on its own (cjson first), and json_reduce (what decides the texts cjson
    // refuses, or holding control bytes) on every text too: one call checks every text.
    const check = withPrelude(
      "local out = {}\nfor i = 2, #ARGV do out[#out + 1] = (json_ok(ARGV[i]) and 1 or 0) + (json_reduce(ARGV[i]) and 2 or 0) end\nreturn out",
    );
    let seed = 20261207;
    const rand = (n: number) => {
      // mulberry32
      seed = (seed + 0x6d2b79f5) | 0;
      let t = Math.imul(seed ^ (seed >>> 15), 1 | seed);
      t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
      return Math.floor((((t ^ (t >>> 14)) >>> 0) / 4294967296) * n);
    };
    const pick = <T>(xs: readonly T[]): T => xs[rand(xs.length)]!;
    const STRINGS = ["", "a", "é \u{1F600}", "q\"\\/\b\f\n\r\t", "\ud800", "x\udc00y", "1e5", "true", "[{}]", "\u007f\u0001"];
    const NUMBERS = ["0", "-0", "7", "-12", "3.25", "0.5e-3", "1E+9", "-1.0e10", "1e999", "123456789012345678"];
    const ws = () => pick(["", "", "", " ", "\n", "\t ", "\r\n"]);
    // A JSON value as tokens (whitespace its own tokens), so that an edit can be a token's.
    const value = (depth: number): string[] => {
      const kind = depth > 3 ? rand(4) : rand(7);
      if (kind === 0) return [JSON.stringify(pick(STRINGS))];
      if (kind === 1) return [pick(NUMBERS)];
      if (kind === 2) return [pick(["true", "false", "null"])];
      if (kind === 3) return [`"${pick(["\\u12ab", "\\/", "\\\\", "a\\\"b", "\\ud83d\\ude00"])}"`];
      const items = Array.from({ length: rand(4) }, () =>
        kind === 4 ? value(depth + 1) : [JSON.stringify(pick(STRINGS)), ws(), ":", ws(), ...value(depth + 1)]
      );
      const [open, close] = kind === 4 ? ["[", "]"] : ["{", "}"];
      return [open, ws(), ...items.flatMap((item, i) => i === 0 ? item : [ws(), ",", ws(), ...item]), ws(), close];
    };
    // near misses of every part of the grammar, and the characters the check itself gives a meaning
    const EDITS = [
      "[", "]", "{", "}", ",", ":", '"', "\\", " ", '"a"', "1", "01", "1.", ".5", "-", "+1", "1e", "e5", "E", "tru", "truex", "nul",
      "\\/", "\\n", "\\u0041", "\\u00g1", "1\\/5", "\\n1", '"\\x"', "\x01", "\x02", "\x7f", "\t", "é", "#", "m", "NaN",
    ];
    const edit = () => rand(2) === 0 ? pick(["[", "]", "{", "}", ",", ":", '"'] as const) : pick(EDITS);
    const mutate = (tokens: string[]): string[] => {
      const at = rand(tokens.length + 1);
      const out = [...tokens];
      const op = rand(5);
      if (op === 0) out.splice(at, 1);
      else if (op === 1) out.splice(at, 0, edit());
      else if (op === 2) out.splice(at, 1, edit());
      else if (op === 3) out.splice(at, 0, ...tokens.slice(rand(tokens.length), rand(tokens.length + 1)));
      else {
        // a character's edit inside a token
        const t = out[at] ?? "";
        const i = rand(t.length + 1);
        out[at] = rand(2) === 0 ? t.slice(0, i) + t.slice(i + 1) : t.slice(0, i) + edit() + t.slice(i);
      }
      return out;
    };
    const texts: string[] = [];
    for (let i = 0; i < 20_000; i++) {
      let tokens = value(0);
      for (let m = 1 + rand(3); m > 0 && i % 3 !== 0; m--) tokens = mutate(tokens);
      texts.push(tokens.join(""));
    }
    // Nested as deep as the reductions go (32) and deeper (the walker reads those), valid and not, with the
    // error innermost and outermost; and bytes the generator never makes.
    const nest = (depth: number, inner: string, outer = "") => "[".repeat(depth) + inner + "]".repeat(depth) + outer;
    for (const depth of [31, 32, 33, 40]) {
      texts.push(nest(depth, "1"), nest(depth, "1,"), nest(depth, "{}", ","), `[1 ${nest(depth - 1, '"x"')}]`, nest(depth, "[]]"));
      texts.push(`${'{"a":'.repeat(depth)}0${"}".repeat(depth)}`, `${'{"a":'.repeat(depth)}0${"}".repeat(depth - 1)}`);
      texts.push(`${'{"a":'.repeat(depth)}0${"}".repeat(depth - 1)},1}`, `${'{"a":'.repeat(depth)}01${"}".repeat(depth)}`);
    }
    texts.push(
      '"a\\u00"', '"\\uABCD"', '"\\uAbC"', "\\", '"\\"', '["a\\"]', '"a"\\', "1\\", "\ufeff1", "\u00a01", "1\u00a0", "[1,\f2]", "[1,\v2]",
      '"\x00"', '"\x1f"', "1\x00", "[\x00]", '"\x7f"', "\x7f", '"\u2028"', "[1]\n", "\r\n[1]", "{\"\":0}",
      // what cjson (strtod) reads as numbers and JSON does not, and the NUL it stops at
      "+1", "01", "-01", "00", "0x1F", "0X1f", "[0x10]", "inf", "-inf", "Infinity", "-Infinity", "[inf]", "nan", "NaN", "-nan", "nan(1)",
      "[nan(1)]", "1.", "-1.", "1.e5", "[1.]", '{"a":+1}', '{"a":01}', "[1e5,0.5,-0]", "1]\x00", "[1]\x00x", '"a"\x00', '{"a":1}\x00}',
      // escapes at a string's end, and strings that hold what would be a number outside
      '"\\\\"', '["\\\\", 1]', '"\\"1"', '["\\"", 01]', '{"01":"+1"}', '["1.", "0x1"]', '"\\u0030x"',
      // deeper than cjson's stack allows
      nest(20_000, "1"), nest(20_000, "1,"),
    );
    const parses = (text: string) => {
      try {
        JSON.parse(text);
        return 1;
      } catch {
        return 0;
      }
    };
    const walked = texts.filter((t) => t.startsWith("[".repeat(33)) || t.startsWith('{"a":'.repeat(33)));
    expect(walked.filter((t) => parses(t) === 0).length, "invalid texts the walker reads").toBeGreaterThan(5);
    const got = await admin!.eval(check, 0, "{p}", ...texts) as number[];
    const disagree = texts.flatMap((text, i) => got[i]! % 2 === parses(text) ? [] : [JSON.stringify(text).slice(0, 200)]);
    expect(disagree.slice(0, 10), "json_ok").toEqual([]);
    const reduced = texts.flatMap((text, i) => (got[i]! >> 1) === parses(text) ? [] : [JSON.stringify(text).slice(0, 200)]);
    expect(reduced.slice(0, 10), "json_reduce").toEqual([]);
    const valid = texts.filter((t) => parses(t) === 1).length;
    expect(valid).toBeGreaterThan(5_000);
    expect(texts.length - valid).toBeGreaterThan(5_000);
  });

  test("a key of another type, and a record an older version quarantined (dead, the problem in its error), are set aside", async () => {
    const keyPrefix = prefix();
    const backend = new RedisDurability({ client: client(), keyPrefix });
    for (const id of ["str", "old", "dead"]) await backend.inbox.admit(inbound(id));
    await backend.outbox.reserve({ key: "str", chatId: "c", content: 1, contentHash: "h", inboundId: null });
    await backend.outbox.reserve({ key: "next", chatId: "c", content: 2, contentHash: "h", inboundId: null });
    for (const key of ["in:r:str", "out:r:str"]) {
      await admin!.del(`{${keyPrefix}}${key}`);
      await admin!.set(`{${keyPrefix}}${key}`, "not a hash");
    }
    const me = { owner: "w", incarnation: "i1", leaseMs: 60_000 };
    for (const id of ["old", "dead"]) {
      const r = (await backend.inbox.claim(id, me))!;
      await backend.inbox.fail(id, r.lease!.token, { error: "gave up", dead: true });
    }
    await admin!.hset(`{${keyPrefix}}in:r:old`, "error", `botmesh: quarantined as damaged: the record at key "x" has a bad field "fence": not a number: x`);

    expect((await backend.inbox.list({ state: "dead" })).map((r) => r.id), "a DLQ of real failures only").toEqual(["dead"]);
    // The entry's chat cannot be read: its chat moves on when it is next written to.
    expect((await backend.outbox.claimDue({ ...me, limit: 10 })).due).toEqual([]);
    await backend.outbox.reserve({ key: "third", chatId: "c", content: 3, contentHash: "h", inboundId: null });
    expect((await backend.outbox.claimDue({ ...me, limit: 10 })).due.map((e) => e.key), "the chat moves on").toEqual(["next"]);
    expect((await backend.inbox.claimDue({ ...me, limit: 10 })).map((r) => r.id)).toEqual([]);
    expect((await backend.inbox.damaged()).map((d) => [d.id, d.problem])).toEqual([
      ["old", `the record at key "x" has a bad field "fence": not a number: x`],
      ["str", expect.stringContaining(`the key "{${keyPrefix}}in:r:str" holds no hash (WRONGTYPE`)],
    ]);
    expect((await backend.outbox.damaged()).map((d) => d.id)).toEqual(["str"]);
    expect(await admin!.get(`{${keyPrefix}}in:r:str`), "kept").toBe("not a hash");
    expect(await rejection(() => backend.outbox.get("str"))).toBeInstanceOf(DamagedRecordError);
  });
});

describe.skipIf(Boolean(skip))("RedisStore", () => {
  test("get/set/delete with TTL (PX on the server)", async () => {
    const keyPrefix = prefix();
    const store = new RedisStore({ client: client(), keyPrefix });
    expect(await store.get("missing")).toBe(undefined);
    await store.set("forever", { step: 2, text: "✓ 你好", big: 1e21, empty: [], "": "" });
    expect(await store.get("forever")).toEqual({ step: 2, text: "✓ 你好", big: 1e21, empty: [], "": "" });
    expect(await admin!.pttl(`{${keyPrefix}}s:forever`)).toBe(-1);
    await store.set("short", "soon gone", { ttlMs: 150 });
    const pttl = await admin!.pttl(`{${keyPrefix}}s:short`);
    expect(pttl).toBeGreaterThan(0);
    expect(pttl).toBeLessThanOrEqual(150);
    expect(await store.get("short")).toBe("soon gone");
    await Bun.sleep(250);
    expect(await store.get("short")).toBe(undefined);
    await store.delete("forever");
    expect(await store.get("forever")).toBe(undefined);
    for (const ttlMs of [0, -1, Number.NaN, Infinity, "1s"]) {
      const error = await rejection(() => store.set("x", 1, { ttlMs: ttlMs as number }));
      expect(error).toBeInstanceOf(RangeError);
      expect(error.message).toContain(`Option "ttlMs" must be a positive number`);
    }
    await admin!.set(`{${keyPrefix}}s:garbage`, "{oops");
    const error = await rejection(() => store.get("garbage"));
    expect(error.message).toContain(`Redis session value at key "{${keyPrefix}}s:garbage" is not JSON`);
  });

  test("durability() journals with the same client and prefix, one instance per store", async () => {
    const keyPrefix = prefix();
    const store = new RedisStore({ client: client(), keyPrefix });
    const backend = store.durability();
    expect(store.durability()).toBe(backend);
    expect(backend.name).toBe("redis");
    expect(backend.scope).toBe("shared");
    expect(backend.keyPrefix).toBe(keyPrefix);
    await backend.inbox.admit(inbound("s1"));
    expect(await admin!.exists(`{${keyPrefix}}in:r:s1`)).toBe(1);
  });
});

describe.skipIf(Boolean(skip))("RedisKv", () => {
  test("compare-and-set, versions never reused (also after a delete)", async () => {
    const kv = new RedisKv({ client: client(), keyPrefix: prefix() });
    expect(kv.name).toBe("redis");
    expect(kv.scope).toBe("shared");
    const v1 = await kv.set("a", { n: 1 }, null);
    expect(typeof v1).toBe("string");
    expect(await kv.set("a", { n: 9 }, null), "create of an existing key").toBe(null);
    const v2 = await kv.set("a", { n: 2 }, v1!);
    expect(v2 !== null && v2 !== v1).toBe(true);
    expect(await kv.set("a", { n: 3 }, v1!), "stale version").toBe(null);
    expect(await kv.get("a")).toEqual({ key: "a", value: { n: 2 }, version: v2! });
    expect(await kv.delete("a", v1!)).toBe(false);
    expect(await kv.delete("a", v2!)).toBe(true);
    expect(await kv.get("a")).toBe(null);
    expect(await kv.delete("a")).toBe(false);
    expect(await kv.set("a", { n: 4 }, v2!), "the deleted version does not match").toBe(null);
    const v3 = await kv.set("a", { n: 4 }, null);
    expect([v1, v2].includes(v3)).toBe(false);
    const v4 = await kv.set("a", "unconditional");
    expect([v1, v2, v3].includes(v4)).toBe(false);
    const tricky = { "": "", big: 1e21, small: 1e-7, nested: [[], {}, [null]], text: "e\u0301 🎉" };
    await kv.set("t", tricky);
    expect((await kv.get("t"))?.value).toEqual(tricky);
    const [sec] = await admin!.time();
    expect(Math.abs((await kv.now()) - Number(sec) * 1000)).toBeLessThan(2_000);
  });

  test("list: prefix, after, limit, in byte order (not UTF-16 order)", async () => {
    const kv = new RedisKv({ client: client(), keyPrefix: prefix() });
    const names = ["p/b", "p/a", "p/\uffff", "p/😀", "p/é", "p/", "q/x", "o/z", "p"];
    for (const k of names) await kv.set(k, k);
    const keys = async (prefix: string, options?: { after?: string; limit?: number }) =>
      (await kv.list(prefix, options)).map((e) => e.key);
    // UTF-8 byte order: "é" (C3 A9) < "\uffff" (EF BF BF) < "😀" (F0 9F 98 80).
    expect(await keys("p/")).toEqual(["p/", "p/a", "p/b", "p/é", "p/\uffff", "p/😀"]);
    expect(await keys("p/", { limit: 2 })).toEqual(["p/", "p/a"]);
    expect(await keys("p/", { after: "p/a", limit: 2 })).toEqual(["p/b", "p/é"]);
    expect(await keys("p/", { after: "p/é" })).toEqual(["p/\uffff", "p/😀"]);
    expect(await keys("p/", { after: "a" }), "after before the prefix").toEqual(["p/", "p/a", "p/b", "p/é", "p/\uffff", "p/😀"]);
    expect(await keys("p/", { after: "q" }), "after past the prefix").toEqual([]);
    expect(await keys("")).toEqual(["o/z", "p", "p/", "p/a", "p/b", "p/é", "p/\uffff", "p/😀", "q/x"]);
    expect(await keys("p/", { limit: 0 })).toEqual([]);
    expect(await keys("r")).toEqual([]);
    const listed = await kv.list("q/");
    expect(listed).toEqual([{ key: "q/x", value: "q/x", version: (await kv.get("q/x"))!.version }]);
  });
});

// The events journal's outbox as a shared Redis kv: the journal contract over it.
runBackendContract({
  name: "new EventsDurability(MemoryEventJournal, outbox: RedisKv)",
  skip,
  create: () => new EventsDurability({ journal: new MemoryEventJournal(), outbox: new RedisKv({ client: client(), keyPrefix: prefix() }) }),
  harness: { describe, test, expect },
  timeScale: 2,
});


/** A TCP proxy to Redis that, when armed, drops the connection instead of passing on the next reply (Redis ran the command). */
async function lossyProxy(): Promise<{ url: string; dropNextReply(): void; dropped(): number; close(): void }> {
  const { createServer, connect } = await import("node:net");
  const target = new URL(REDIS_URL);
  let armed = false;
  let drops = 0;
  const sockets = new Set<import("node:net").Socket>();
  const server = createServer((c) => {
    const s = connect(Number(target.port || 6379), target.hostname);
    sockets.add(c).add(s);
    c.on("data", (d) => s.write(d));
    s.on("data", (d) => {
      if (armed) {
        armed = false;
        drops++;
        c.destroy();
        s.destroy();
        return;
      }
      c.write(d);
    });
    c.on("error", () => s.destroy());
    s.on("error", () => c.destroy());
    c.on("close", () => s.destroy());
    s.on("close", () => c.destroy());
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", () => resolve()));
  const { port } = server.address() as { port: number };
  return {
    url: `redis://127.0.0.1:${port}`,
    dropNextReply: () => {
      armed = true;
    },
    dropped: () => drops,
    close: () => {
      for (const s of sockets) s.destroy();
      server.close();
    },
  };
}

describe.skipIf(Boolean(skip))("lost leases and lost replies", () => {
  test("a lapsed lease is claimable by its own incarnation (a claim whose reply was lost); a live one is not", async () => {
    const backend = new RedisDurability({ client: client(), keyPrefix: prefix() });
    const me = { owner: "o", incarnation: "i", leaseMs: 150 };
    await backend.inbox.admit(inbound("lost", "c", 1), me);
    await backend.inbox.admit(inbound("live", "c", 2), { ...me, leaseMs: 60_000 });
    expect(await backend.inbox.claimDue({ ...me, limit: 10 }), "not while live").toEqual([]);
    expect(await backend.inbox.claim("lost", me)).toBe(null);
    const sent = await backend.outbox.reserve({ key: "k", chatId: "c", content: 1, contentHash: "h", inboundId: null }, me);
    expect(sent.status).toBe("leased");
    expect(await backend.outbox.markCalling("k", 1, me.leaseMs)).toBe(true);
    expect((await backend.outbox.claimDue({ ...me, limit: 10 })).ambiguous).toEqual([]);
    await Bun.sleep(250);
    const due = await backend.inbox.claimDue({ ...me, limit: 10 });
    expect(due.map((r) => [r.id, r.lease?.token])).toEqual([["lost", 2]]);
    const claim = await backend.outbox.claimDue({ ...me, limit: 10 });
    expect(claim.ambiguous.map((e) => [e.key, e.state])).toEqual([["k", "unknown"]]);
    // reclaimOwn still takes the live lease of another incarnation, never this one's own.
    expect(await backend.inbox.claim("live", { ...me, reclaimOwn: true })).toBe(null);
    expect((await backend.inbox.claim("live", { ...me, incarnation: "j", reclaimOwn: true }))?.lease?.token).toBe(2);
  });

  test("ioredis re-sends a call whose reply was lost: every mutating script answers as its first run did", async () => {
    const proxy = await lossyProxy();
    const io = new IORedis(proxy.url); // default options: unfulfilled commands are re-sent after the reconnect
    clients.push(io);
    const keyPrefix = prefix();
    const backend = new RedisDurability({ client: io, keyPrefix });
    const lease = { owner: "A", incarnation: "1", leaseMs: 60_000 };
    try {
      await backend.open();
      await backend.inbox.admit(inbound("warm"), lease);

      proxy.dropNextReply();
      const admitted = await backend.inbox.admit(inbound("m1"), lease);
      expect(admitted?.lease?.owner, "admit: the record, not null").toBe("A");

      proxy.dropNextReply();
      const reserved = await backend.outbox.reserve({ key: "k1", chatId: "c", content: 1, contentHash: "h", inboundId: null }, lease);
      expect(reserved.status, "reserve: leased, not exists").toBe("leased");
      proxy.dropNextReply();
      await backend.outbox.markSent("k1", reserved.entry.lease!.token, "msg-1"); // not a StaleLeaseError
      expect((await backend.outbox.get("k1"))?.state).toBe("sent");

      for (const id of ["p1", "p2", "p3"]) await backend.inbox.admit(inbound(id, "c2"));
      proxy.dropNextReply();
      const due = await backend.inbox.claimDue({ ...lease, limit: 10 });
      expect(due.map((r) => r.id).sort(), "claimDue: the records it leased").toEqual(["p1", "p2", "p3"]);

      await backend.outbox.reserve({ key: "s2", chatId: "y", content: 1, contentHash: "h", inboundId: null }, { ...lease, owner: "old", leaseMs: 60_000 });
      // markCalling stores no reply (it is idempotent by itself): the re-sent call runs again and answers true.
      proxy.dropNextReply();
      expect(await backend.outbox.markCalling("s2", 1, 1), "markCalling: true, not stale").toBe(true);
      expect((await backend.outbox.get("s2"))?.called).toBe(true);
      await Bun.sleep(20);
      proxy.dropNextReply();
      const claim = await backend.outbox.claimDue({ ...lease, limit: 10 });
      expect(claim.ambiguous.map((e) => e.key), "the lost send it moved to unknown is reported").toEqual(["s2"]);

      proxy.dropNextReply();
      await backend.inbox.complete("m1", 1);
      expect((await backend.inbox.get("m1"))?.state).toBe("done");
      expect(proxy.dropped()).toBe(7);
      // The stored replies expire on their own.
      const rq = await admin!.keys(`{${keyPrefix}}rq:*`);
      expect(rq.length).toBeGreaterThan(0);
      const ttl = await admin!.pttl(rq[0]!);
      expect(ttl).toBeGreaterThan(0);
      expect(ttl).toBeLessThanOrEqual(120_000);
    } finally {
      io.disconnect();
      proxy.close();
    }
  });
});

describe.skipIf(Boolean(skip))("due scans asked again (requestId, repeat)", () => {
  /** Commands over a client of their own whose next reply can be lost after the server ran the script. */
  function lossy(): { commands: RedisCommands; loseNextReply(): void } {
    const real = fromIoredis(client());
    let lose = false;
    return {
      commands: {
        evalsha: async (sha, keys, args) => {
          const reply = await real.evalsha(sha, keys, args);
          if (lose) {
            lose = false;
            throw new Error("connection reset (the reply never arrived)");
          }
          return reply;
        },
        scriptLoad: (script) => real.scriptLoad(script),
      },
      loseNextReply: () => void (lose = true),
    };
  }

  test("a named scan whose reply was lost: the repeat, from another client, answers what it took under the same tokens, from the server", async () => {
    const keyPrefix = prefix();
    const first = lossy();
    const a = new RedisDurability({ client: first.commands, keyPrefix });
    const b = new RedisDurability({ client: client(), keyPrefix }); // another process: nothing of a's memory
    const me = claimer("A");
    for (const id of ["m1", "m2", "m3"]) await a.inbox.admit(inbound(id, `c-${id}`));
    first.loseNextReply();
    expect((await rejection(() => a.inbox.claimDue({ ...me, limit: 2, requestId: "scan-in" }))).message).toContain("reply never arrived");
    const held = await Promise.all(["m1", "m2"].map((id) => b.inbox.get(id)));
    expect(held.map((r) => [r?.state, r?.lease?.owner, r?.lease?.token]), "the scan committed").toEqual([["processing", "A", 2], ["processing", "A", 2]]);
    const again = await b.inbox.claimDue({ ...me, limit: 10, requestId: "scan-in", repeat: true });
    expect(again.map((r) => [r.id, r.lease?.token]), "the records the lost reply held").toEqual([["m1", 2], ["m2", 2]]);
    expect(again).toEqual(held as NonNullable<(typeof held)[number]>[]);
    expect(await a.inbox.claimDue({ ...me, limit: 10, requestId: "scan-in", repeat: true }), "the scanner's own repeat").toEqual(again);
    expect((await b.inbox.get("m3"))?.state, "a repeat takes nothing more").toBe("pending");
    expect(await b.outbox.claimDue({ ...me, limit: 10, requestId: "scan-in", repeat: true }), "the outbox's scans are apart")
      .toEqual({ due: [], ambiguous: [] });
    // The reply stays in the prefix's hash slot, for SCAN_ANSWER_KEEP_MS (the other request keys: REQUEST_TTL_MS).
    const kept = `{${keyPrefix}}rq:scan:in:scan-in`;
    const ttl = await admin!.pttl(kept);
    expect(ttl).toBeGreaterThan(SCAN_ANSWER_KEEP_MS - 10_000);
    expect(ttl).toBeLessThanOrEqual(SCAN_ANSWER_KEEP_MS);
    const others = (await admin!.keys(`{${keyPrefix}}rq:*`)).filter((k) => !k.includes("rq:scan:"));
    expect(others.length).toBeGreaterThan(0);
    for (const k of others) expect(await admin!.pttl(k)).toBeLessThanOrEqual(REQUEST_TTL_MS);
    await admin!.del(kept); // gone (expired): the repeat answers nothing
    expect(await b.inbox.claimDue({ ...me, limit: 10, requestId: "scan-in", repeat: true })).toEqual([]);

    // The outbox: a due entry leased and a lost announced send made ambiguous, by a scan whose reply was lost.
    await a.outbox.reserve({ key: "k1", chatId: "x", content: 1, contentHash: "h", inboundId: null });
    const gone = await a.outbox.reserve({ key: "k2", chatId: "y", content: 2, contentHash: "h", inboundId: null }, claimer("B", 100));
    expect(await a.outbox.markCalling("k2", gone.entry.lease!.token, 100)).toBe(true);
    await Bun.sleep(200);
    first.loseNextReply();
    expect((await rejection(() => a.outbox.claimDue({ ...me, limit: 10, requestId: "scan-out" }))).message).toContain("reply never arrived");
    const claim = await b.outbox.claimDue({ ...me, limit: 10, requestId: "scan-out", repeat: true });
    expect(claim.due.map((e) => [e.key, e.state, e.lease?.token])).toEqual([["k1", "sending", 2]]);
    expect(claim.ambiguous.map((e) => [e.key, e.state])).toEqual([["k2", "unknown"]]);
    expect(claim.due[0]).toEqual((await b.outbox.get("k1"))!);
    expect(await b.outbox.claimDue({ ...me, limit: 10, requestId: "never-run", repeat: true })).toEqual({ due: [], ambiguous: [] });
  });

  test("a repeat that comes before its scan closes the request: the scan, arriving late, answers nothing and changes nothing", async () => {
    const keyPrefix = prefix();
    // Commands whose calls wait for `held` before they are sent (a scan still on its way).
    const real = fromIoredis(client());
    let held: Promise<void> | null = null;
    let sent = () => {};
    const waiting = new Promise<void>((r) => (sent = r));
    const slow: RedisCommands = {
      evalsha: async (sha, keys, args) => {
        if (held) {
          sent();
          await held;
        }
        return await real.evalsha(sha, keys, args);
      },
      scriptLoad: (script) => real.scriptLoad(script),
    };
    const a = new RedisDurability({ client: slow, keyPrefix });
    const b = new RedisDurability({ client: client(), keyPrefix });
    const me = claimer("A");
    await b.inbox.admit(inbound("m1"));
    await b.outbox.reserve({ key: "k1", chatId: "x", content: 1, contentHash: "h", inboundId: null });
    const gone = await b.outbox.reserve({ key: "k2", chatId: "y", content: 2, contentHash: "h", inboundId: null }, claimer("B", 100));
    expect(await b.outbox.markCalling("k2", gone.entry.lease!.token, 100)).toBe(true);
    await Bun.sleep(200);
    const before = [await b.inbox.list(), await b.outbox.list()];
    let go = () => {};
    held = new Promise<void>((r) => (go = r));
    const lateIn = a.inbox.claimDue({ ...me, limit: 10, requestId: "late-in" });
    await waiting;
    expect(await b.inbox.claimDue({ ...me, limit: 10, requestId: "late-in", repeat: true }), "nothing ran yet").toEqual([]);
    expect(await b.outbox.claimDue({ ...me, limit: 10, requestId: "late-out", repeat: true }), "nothing ran yet").toEqual({ due: [], ambiguous: [] });
    const kept = `{${keyPrefix}}rq:scan:out:late-out`;
    expect(await admin!.pttl(kept), "the placeholder is kept as an answer is").toBeGreaterThan(SCAN_ANSWER_KEEP_MS - 10_000);
    go();
    held = null;
    expect(await lateIn, "the late scan answers the placeholder").toEqual([]);
    expect(await a.outbox.claimDue({ ...me, limit: 10, requestId: "late-out" }), "the late scan answers the placeholder").toEqual({ due: [], ambiguous: [] });
    expect([await b.inbox.list(), await b.outbox.list()], "and changes nothing").toEqual(before);
    expect(await b.inbox.claimDue({ ...me, limit: 10, requestId: "late-in", repeat: true })).toEqual([]);
    // A fresh request takes them.
    expect((await a.inbox.claimDue({ ...me, limit: 10, requestId: "next" })).map((r) => r.id)).toEqual(["m1"]);
    const next = await a.outbox.claimDue({ ...me, limit: 10, requestId: "next" });
    expect([next.due.map((e) => e.key), next.ambiguous.map((e) => e.key)]).toEqual([["k1"], ["k2"]]);
  });

  test("without a requestId a scan keeps nothing; repeat without one is a TypeError naming the option", async () => {
    const keyPrefix = prefix();
    const backend = new RedisDurability({ client: client(), keyPrefix });
    await backend.inbox.admit(inbound("m1"));
    expect((await backend.inbox.claimDue({ ...claimer(), limit: 10 })).map((r) => r.id)).toEqual(["m1"]);
    expect(await admin!.keys(`{${keyPrefix}}rq:scan:*`)).toEqual([]);
    for (const call of [
      () => backend.inbox.claimDue({ ...claimer(), limit: 10, repeat: true }),
      () => backend.outbox.claimDue({ ...claimer(), limit: 10, repeat: true }),
    ]) {
      const error = await rejection(call);
      expect(error).toBeInstanceOf(TypeError);
      expect(error.message).toContain(`option "repeat" needs a "requestId"`);
    }
    expect((await rejection(() => backend.inbox.claimDue({ ...claimer(), limit: 10, requestId: "" }))).message).toContain(`option "requestId"`);
  });
});

describe.skipIf(Boolean(skip))("damaged records in due scans", () => {
  /** Every key under the prefix that holds `member` (a sorted-set or set member), but the damaged lists. */
  async function indexesOf(keyPrefix: string, member: string): Promise<string[]> {
    const found: string[] = [];
    for (const key of await admin!.keys(`{${keyPrefix}}*`)) {
      const type = await admin!.type(key);
      const has = type === "zset" ? (await admin!.zscore(key, member)) !== null : type === "set" ? (await admin!.sismember(key, member)) === 1 : false;
      if (has && !/:dmgu?$/.test(key)) found.push(key.slice(keyPrefix.length + 2));
    }
    return found.sort();
  }

  test("outbox.claimDue: a damaged entry is set aside before any write, its hash as it was; the lapsed send is reported; its chat moves on", async () => {
    const keyPrefix = prefix();
    const backend = new RedisDurability({ client: client(), keyPrefix });
    await backend.outbox.reserve({ key: "lost1", chatId: "a", content: 1, contentHash: "h", inboundId: null }, { owner: "A", incarnation: "1", leaseMs: 60_000 });
    expect(await backend.outbox.markCalling("lost1", 1, 10)).toBe(true);
    await backend.outbox.reserve({ key: "q", chatId: "b", content: 1, contentHash: "h", inboundId: null });
    await backend.outbox.reserve({ key: "q2", chatId: "b", content: 2, contentHash: "h", inboundId: null });
    await admin!.hset(`{${keyPrefix}}out:r:q`, "fence", "x");
    const before = await admin!.hgetall(`{${keyPrefix}}out:r:q`);
    await Bun.sleep(50);
    const claim = await backend.outbox.claimDue({ owner: "B", incarnation: "1", leaseMs: 60_000, limit: 10 });
    expect(claim.ambiguous.map((e) => e.key)).toEqual(["lost1"]);
    expect(claim.due.map((e) => e.key), "the damaged head no longer blocks its chat").toEqual(["q2"]);
    expect(await admin!.hgetall(`{${keyPrefix}}out:r:q`), "kept as stored").toEqual(before);
    expect(await indexesOf(keyPrefix, "q"), "in no index").toEqual([]);
    const [found] = await backend.outbox.damaged();
    expect(found).toEqual({
      journal: "outbox",
      id: "q",
      backend: "redis",
      problem: `the record at key "{${keyPrefix}}out:r:q" has a bad field "fence": not a number: x`,
      setAsideAt: expect.any(Number),
      reported: false,
    });
    expect(Math.abs(found!.setAsideAt - await backend.now())).toBeLessThan(5_000);
    expect((await rejection(() => backend.outbox.get("q"))).message).toContain(`field "fence"`);
    const again = await backend.outbox.claimDue({ owner: "C", incarnation: "1", leaseMs: 60_000, limit: 10 });
    expect(again).toEqual({ due: [], ambiguous: [] });
    expect(await backend.outbox.discard("q"), "a set-aside entry is never deleted").toBe(false);
    expect(await admin!.exists(`{${keyPrefix}}out:r:q`)).toBe(1);
    expect((await backend.outbox.list()).map((e) => e.key)).toEqual(["lost1", "q2"]);
  });

  test("inbox.claimDue: a damaged record is set aside, the good ones are leased and returned; its old lease is stale", async () => {
    const keyPrefix = prefix();
    const backend = new RedisDurability({ client: client(), keyPrefix });
    const old = { owner: "A", incarnation: "1", leaseMs: 60_000 };
    for (const id of ["m1", "m2", "m3"]) await backend.inbox.admit(inbound(id));
    await backend.inbox.admit(inbound("m4"), old);
    await admin!.hset(`{${keyPrefix}}in:r:m2`, "payload", "{bad");
    await admin!.hset(`{${keyPrefix}}in:r:m4`, "attempts", "many");
    const before = await admin!.hgetall(`{${keyPrefix}}in:r:m4`);
    const me = { owner: "w", incarnation: "i1", leaseMs: 60_000, reclaimOwn: true };
    const due = await backend.inbox.claimDue({ ...me, limit: 10 });
    expect(due.map((r) => r.id)).toEqual(["m1", "m3"]);
    // m4 is processing under A's live lease: its holder's heartbeat meets it.
    expect(await backend.inbox.heartbeat("m4", 1, 60_000)).toBe(false);
    expect((await backend.inbox.damaged()).map((d) => [d.id, d.problem])).toEqual([
      ["m2", `the record at key "{${keyPrefix}}in:r:m2" has a bad field "payload": not JSON: {bad`],
      ["m4", `the record at key "{${keyPrefix}}in:r:m4" has a bad field "attempts": not a number: many`],
    ]);
    expect(await indexesOf(keyPrefix, `${"0".repeat(15)}2m2`)).toEqual([]);
    expect(await indexesOf(keyPrefix, `${"0".repeat(15)}4m4`)).toEqual([]);
    expect(await indexesOf(keyPrefix, "m4")).toEqual([]);
    // The old holder's calls under its lease are stale and change nothing.
    expect(await backend.inbox.heartbeat("m4", 1, 60_000)).toBe(false);
    expect(await backend.inbox.claimDue({ ...old, reclaimOwn: true, limit: 10 })).toEqual([]);
    expect(await rejection(() => backend.inbox.complete("m4", 1))).toBeInstanceOf(StaleLeaseError);
    expect(await rejection(() => backend.inbox.fail("m4", 1, { error: "x", retryInMs: 0 }))).toBeInstanceOf(StaleLeaseError);
    expect(await admin!.hgetall(`{${keyPrefix}}in:r:m4`)).toEqual(before);
    expect(await backend.inbox.claimDue({ ...me, limit: 10 })).toEqual([]);

    const out = await backend.outbox.reserve({ key: "k1", chatId: "c", content: 1, contentHash: "h", inboundId: null }, old);
    await backend.outbox.reserve({ key: "k2", chatId: "c", content: 2, contentHash: "h", inboundId: null });
    await admin!.hset(`{${keyPrefix}}out:r:${out.entry.key}`, "content", "{bad");
    // The holder's own operations read no content (it sends what it read when it took the entry): its
    // call and outcome go on; the next read that hands the entry out meets the damage and sets it aside.
    expect(await backend.outbox.markCalling("k1", 1, 60_000)).toBe(true);
    await backend.outbox.markSent("k1", 1, "m");
    const claim = await backend.outbox.claimDue({ ...me, limit: 10 });
    expect(claim.due.map((e) => e.key), "k2 is its chat's head now").toEqual(["k2"]);
    expect(await admin!.hget(`{${keyPrefix}}out:r:k1`, "state")).toBe("sent");
    expect((await rejection(() => backend.outbox.get("k1"))).message).toContain(`out:r:k1" has a bad field "content": not JSON`);
    expect((await backend.outbox.list()).map((e) => e.key), "nor listed").toEqual(["k2"]);
    expect((await backend.outbox.damaged()).map((d) => d.id)).toEqual(["k1"]);

    // So too a held inbound record: its run's start, heartbeat and completion go on; get meets the damage.
    const held = await backend.inbox.admit(inbound("m5", "c5"), me);
    await admin!.hset(`{${keyPrefix}}in:r:m5`, "payload", "{bad");
    expect(await backend.inbox.start("m5", held!.lease!.token, 2)).toBe(true);
    expect(await backend.inbox.heartbeat("m5", held!.lease!.token, 60_000)).toBe(true);
    await backend.inbox.complete("m5", held!.lease!.token);
    expect(await admin!.hget(`{${keyPrefix}}in:r:m5`, "state")).toBe("done");
    expect((await rejection(() => backend.inbox.get("m5"))).message).toContain(`in:r:m5" has a bad field "payload": not JSON`);
    expect((await backend.inbox.damaged()).map((d) => d.id)).toEqual(["m2", "m4", "m5"]);
  });

  test("a damaged record is set aside once, however many scans and lists meet it at once; reportDamaged answers true once", async () => {
    const keyPrefix = prefix();
    const backend = new RedisDurability({ client: client(), keyPrefix });
    for (let i = 0; i < 20; i++) await backend.inbox.admit(inbound(`m${i}`, `c${i % 4}`, 1_000 + i));
    for (const i of [3, 7, 11]) await admin!.hset(`{${keyPrefix}}in:r:m${i}`, "state", "???");
    const calls = Array.from({ length: 12 }, (_, i) =>
      i % 3 === 0 ? backend.inbox.list({ limit: 5 }) : backend.inbox.claimDue({ owner: "o", incarnation: "x", leaseMs: 60_000, limit: 4 })
    );
    const results = await Promise.all(calls);
    const claimed = results.filter((_, i) => i % 3 !== 0).flat().map((r) => r.id);
    expect(claimed.length).toBe(17);
    expect(new Set(claimed).size, "each good record claimed once").toBe(17);
    for (const i of [0, 3, 6, 9]) expect(results[i]!.length, "a full page of readable records").toBe(5);
    expect((await backend.inbox.damaged()).map((d) => d.id).sort()).toEqual(["m11", "m3", "m7"]);
    expect(await admin!.get(`{${keyPrefix}}in:dmgn`)).toBe("3");
    const asked = ["m3", "m3", "m7", "m3", "m7", "m11", "nothing"];
    const reports = await Promise.all(asked.map((id) => backend.inbox.reportDamaged(id)));
    for (const id of ["m3", "m7", "m11"]) expect(asked.filter((x, i) => x === id && reports[i]).length, id).toBe(1);
    expect(reports[6]).toBe(false);
    expect(await backend.inbox.damaged({ unreported: true })).toEqual([]);
  });

  test("stale marks of records that are gone cannot fill the due window and hide a due record", async () => {
    const keyPrefix = prefix();
    const backend = new RedisDurability({ client: client(), keyPrefix });
    const me = { owner: "w", incarnation: "i1", leaseMs: 60_000 };
    await backend.inbox.admit(inbound("due", "c", 5), { ...me, leaseMs: 1 });
    await backend.outbox.reserve({ key: "lapsed", chatId: "c", content: 1, contentHash: "h", inboundId: null }, me);
    expect(await backend.outbox.markCalling("lapsed", 1, 1)).toBe(true);
    const stale = Array.from({ length: 1_500 }, (_, i) => [0, `gone-${i}`] as const).flat();
    await admin!.zadd(`{${keyPrefix}}in:timed`, ...stale);
    await admin!.zadd(`{${keyPrefix}}out:lease`, ...stale);
    await Bun.sleep(20);
    let found: string[] = [];
    let ambiguous: string[] = [];
    for (let i = 0; i < 3 && (found.length === 0 || ambiguous.length === 0); i++) {
      found = found.concat((await backend.inbox.claimDue({ ...me, limit: 1 })).map((r) => r.id));
      ambiguous = ambiguous.concat((await backend.outbox.claimDue({ ...me, limit: 1 })).ambiguous.map((e) => e.key));
    }
    expect(found).toEqual(["due"]);
    expect(ambiguous).toEqual(["lapsed"]);
    expect(await admin!.zcard(`{${keyPrefix}}in:timed`)).toBe(1);
    expect(await admin!.zcard(`{${keyPrefix}}out:lease`)).toBe(0);
  });
});

describe.skipIf(Boolean(skip))("the chat index of records written before it", () => {
  test("records without the chat index (in:act:*, in:actv deleted) are indexed by the first scan: one held elsewhere still holds back its chat", async () => {
    const keyPrefix = prefix();
    const backend = new RedisDurability({ client: client(), keyPrefix });
    const a = { owner: "A", incarnation: "1", leaseMs: 60_000 };
    const b = { owner: "B", incarnation: "1", leaseMs: 60_000 };
    await backend.inbox.admit(inbound("held", "c", 1_000), a);
    await backend.inbox.admit(inbound("next", "c", 2_000));
    await backend.inbox.admit(inbound("later", "c", 3_000));
    await backend.inbox.admit(inbound("other", "d", 4_000));
    await backend.inbox.admit(inbound("bad", "e", 500));
    await admin!.hset(`{${keyPrefix}}in:r:bad`, "payload", "[");
    await backend.inbox.claimDue({ ...a, limit: 0 }); // (no scan: in:actv is set by the first one)
    const index = await admin!.keys(`{${keyPrefix}}in:act*`);
    expect(index.sort()).toEqual([`{${keyPrefix}}in:act:c`, `{${keyPrefix}}in:act:d`, `{${keyPrefix}}in:act:e`]);
    await admin!.del(...index, `{${keyPrefix}}in:actv`); // as an older version left them

    expect((await backend.inbox.claimDue({ ...b, limit: 10 })).map((r) => r.id), "c is held by A").toEqual(["other"]);
    expect(await admin!.exists(`{${keyPrefix}}in:actv`)).toBe(1);
    expect(await admin!.zrange(`{${keyPrefix}}in:act:c`, 0, -1)).toEqual(["0000000000000001held", "0000000000000002next", "0000000000000003later"]);
    expect(await admin!.exists(`{${keyPrefix}}in:act:e`), "the damaged record is set aside, not indexed").toBe(0);
    expect((await backend.inbox.damaged()).map((d) => d.id)).toEqual(["bad"]);

    // Records an older replica admits after the index was built are indexed by the scan that meets them.
    await backend.inbox.admit(inbound("f1", "f", 5_000));
    await backend.inbox.admit(inbound("f2", "f", 6_000));
    await admin!.del(`{${keyPrefix}}in:act:f`);
    expect((await backend.inbox.claimDue({ ...b, limit: 10 })).map((r) => r.id)).toEqual(["f1", "f2"]);
    expect(await admin!.zcard(`{${keyPrefix}}in:act:f`)).toBe(2);
    await backend.inbox.complete("held", 1);
    expect((await backend.inbox.claimDue({ ...b, limit: 10 })).map((r) => r.id), "c is free").toEqual(["next", "later"]);
  });
});

/**
 * The leases an index audit's operations hold (id → token), and how each one moved when it was taken
 * over while held (counted by `count`): by another owner, by its owner's next incarnation, or by its own
 * holder once it lapsed.
 */
class HeldLeases {
  readonly tokens = new Map<string, number>();
  readonly #holders = new Map<string, { owner: string; incarnation: string }>();
  constructor(readonly count: (kind: string) => void) {}

  take(id: string, lease: Lease): void {
    const last = this.#holders.get(id);
    if (last && this.tokens.has(id)) {
      this.count(
        last.owner !== lease.owner
          ? "taken by another owner"
          : last.incarnation !== lease.incarnation
          ? "taken from an earlier incarnation"
          : "lapsed, taken again by its holder",
      );
    }
    this.tokens.set(id, lease.token);
    this.#holders.set(id, { owner: lease.owner, incarnation: lease.incarnation });
  }

  /** A held id drawn by `prng`, or `undefined` when none is held. */
  any(prng: Prng): string | undefined {
    return this.tokens.size > 0 ? prng.pick([...this.tokens.keys()]) : undefined;
  }
}

/** A backend under a new key prefix on a test clock (`clock.now`), for one seed of an index audit. */
function auditBackend(): { keyPrefix: string; backend: RedisDurability; clock: { now: number } } {
  const keyPrefix = prefix();
  const clock = { now: 1_800_000_000_000 };
  return { keyPrefix, backend: new RedisDurability({ client: client(), keyPrefix, clock: () => clock.now }), clock };
}

/** A write under a lease another took meanwhile is refused as stale: expected in the audits' random operations. */
function ignoreStaleLease(e: unknown): void {
  if (!(e instanceof StaleLeaseError)) throw e;
}

/**
 * The index entries stored under a journal's keys (`in` or `out`), as `key member score` (sorted set)
 * or `key member` (set, when `sets`): every key but the records, the damaged marks and `leaveOut`.
 */
async function storedIndexEntries(keyPrefix: string, journal: "in" | "out", opts: { sets: boolean; leaveOut: string[] }): Promise<string[]> {
  const tag = `{${keyPrefix}}`;
  const stored: string[] = [];
  for (const key of await admin!.keys(`${tag}${journal}:*`)) {
    const name = key.slice(tag.length);
    if (name.startsWith(`${journal}:r:`) || name.startsWith(`${journal}:dmg`) || opts.leaveOut.includes(name)) continue;
    const type = await admin!.type(key);
    if (type === "set" && opts.sets) for (const m of await admin!.smembers(key)) stored.push(`${name} ${m}`);
    if (type !== "zset") continue;
    const r = await admin!.zrange(key, 0, -1, "WITHSCORES");
    for (let i = 0; i < r.length; i += 2) stored.push(`${name} ${r[i]} ${Number(r[i + 1])}`);
  }
  return stored.sort();
}

describe.skipIf(Boolean(skip))("the inbox's indexes", () => {
  /** Each index entry of the inbox's records, as `key member score`: what is stored, or what each record's state and lease call for. */
  async function indexEntries(keyPrefix: string): Promise<{ stored: string[]; expected: string[]; incsMissing: string[] }> {
    const tag = `{${keyPrefix}}`;
    const expected: string[] = [], incsMissing: string[] = [];
    const stored = await storedIndexEntries(keyPrefix, "in", { sets: false, leaveOut: [] });
    for (const key of await admin!.keys(`${tag}in:r:*`)) {
      const h = await admin!.hgetall(key);
      const id = key.slice(`${tag}in:r:`.length), state = h.state as InboundState, at = Number(h.receivedAt);
      expected.push(`in:st:${state} ${h.om} ${at}`, `in:chat:${h.chatId} ${h.om} ${at}`);
      if (ACTIVE_INBOX_STATES.includes(state)) expected.push(`in:act:${h.chatId} ${h.om} ${at}`);
      const due = INBOX_TABLE[state].due;
      if (due === "nextAttemptAt") expected.push(`in:timed ${id} ${Number(h.nextAttemptAt ?? 0)}`);
      if (due === "leaseExpiry") expected.push(`in:timed ${id} ${Number(h.leaseExp)}`);
      if (INBOX_TABLE[state].leased) {
        expected.push(`in:own:${h.leaseOwner!.length}:${h.leaseOwner}:${h.leaseInc} ${h.om} ${at}`);
        if (!(await admin!.sismember(`${tag}in:incs:${h.leaseOwner}`, h.leaseInc!))) incsMissing.push(`${id}: ${h.leaseOwner}/${h.leaseInc}`);
      }
      if (INBOX_TABLE[state].purgeable) expected.push(`in:done ${id} ${Number(h.updatedAt)}`);
    }
    return { stored, expected: expected.sort(), incsMissing };
  }

  test("through every transition, each record is in exactly the indexes its state and lease call for (seeded random operations)", async () => {
    for (const seed of [1, 2, 3]) {
      const { keyPrefix, backend, clock } = auditBackend();
      const inbox = backend.inbox;
      const prng = new Prng(seed);
      const rand = () => prng.next(), pick = <T>(xs: readonly T[]): T => prng.pick(xs);
      let aInc = 1;
      const visited = new Set<InboundState>();
      const kinds = new Map<string, number>();
      const count = (kind: string) => kinds.set(kind, (kinds.get(kind) ?? 0) + 1);
      const held = new HeldLeases(count);
      const hold = (records: (InboundRecord | null)[]) => {
        for (const r of records) if (r?.lease) held.take(r.id, r.lease);
      };
      let ids = 0;
      for (let step = 0; step < 300; step++) {
        const op = rand();
        const owner = rand() < 0.7 ? "A" : "B";
        const lease = { owner, incarnation: owner === "A" ? `a${aInc}` : "b1", leaseMs: 30_000 };
        const heldId = held.any(prng);
        let kind: string;
        if (op < 0.25) {
          kind = "admit";
          const id = `m${ids++}`;
          hold([await inbox.admit(inbound(id, `c${Math.floor(rand() * 4)}`, clock.now - Math.floor(rand() * 1000)), rand() < 0.5 ? lease : undefined)]);
        } else if (op < 0.4) {
          kind = "claimDue";
          hold(await inbox.claimDue({ ...lease, limit: 1 + Math.floor(rand() * 5), reclaimOwn: rand() < 0.5 }));
        } else if (op < 0.45) {
          kind = "claim";
          hold([await inbox.claim(`m${Math.floor(rand() * Math.max(ids, 1))}`, lease)]);
        } else if (op < 0.75 && heldId !== undefined) {
          const token = held.tokens.get(heldId)!;
          kind = pick(["start", "heartbeat", "complete", "fail", "dead", "schedule"]);
          if (kind === "start") await inbox.start(heldId, token, 1 + Math.floor(rand() * 3));
          else if (kind === "heartbeat") await inbox.heartbeat(heldId, token, 30_000);
          else {
            held.tokens.delete(heldId);
            const finish = kind === "complete"
              ? inbox.complete(heldId, token)
              : kind === "fail"
              ? inbox.fail(heldId, token, { error: "e", retryInMs: Math.floor(rand() * 20_000) })
              : kind === "dead"
              ? inbox.fail(heldId, token, { error: "e", dead: true })
              : inbox.schedule(heldId, token, Math.floor(rand() * 20_000));
            await finish.catch(ignoreStaleLease);
          }
        } else if (op < 0.85) {
          kind = "replay";
          await inbox.replay(`m${Math.floor(rand() * Math.max(ids, 1))}`);
        } else if (op < 0.95) {
          kind = "time";
          clock.now += Math.floor(rand() * 40_000);
        } else {
          kind = "restart";
          aInc++;
        }
        kinds.set(kind, (kinds.get(kind) ?? 0) + 1);
        if (step % 10 === 9) {
          const { stored, expected, incsMissing } = await indexEntries(keyPrefix);
          expect(stored, `seed ${seed}, after step ${step} (${kind})`).toEqual(expected);
          expect(incsMissing, `seed ${seed}, after step ${step}: leases of an incarnation in:incs lacks`).toEqual([]);
          for (const r of await inbox.list({ limit: 1000 })) visited.add(r.state);
        }
      }
      // Every transition was exercised, leases taken over by their owner's next incarnation, by another
      // owner, and by their own holder once lapsed among them.
      for (
        const k of [
          "admit", "claimDue", "claim", "start", "heartbeat", "complete", "fail", "dead", "schedule", "replay", "time", "restart",
          "taken by another owner", "taken from an earlier incarnation", "lapsed, taken again by its holder",
        ]
      ) {
        expect(kinds.get(k) ?? 0, `seed ${seed}: ${k}`).toBeGreaterThan(0);
      }
      expect([...visited].sort(), `seed ${seed}: the states audited`).toEqual(["dead", "done", "failed", "pending", "processing", "scheduled"]);
    }
  }, 60_000);
});

describe.skipIf(Boolean(skip))("the outbox's indexes", () => {
  /**
   * Each index entry of the outbox's entries, as `key member [score]`: what is stored, or what each
   * entry's state and lease call for; and the chats whose head (first unsettled entry) is due by its
   * retry time without its mark in out:due (other marks may be stale: due scans drop those).
   */
  async function outboxEntries(keyPrefix: string): Promise<{ stored: string[]; expected: string[]; unmarkedHeads: string[] }> {
    const tag = `{${keyPrefix}}`;
    const expected: string[] = [], unmarkedHeads: string[] = [];
    const stored = await storedIndexEntries(keyPrefix, "out", { sets: true, leaveOut: ["out:due", "out:seq"] });
    const heads = new Map<string, Record<string, string>>();
    for (const key of await admin!.keys(`${tag}out:r:*`)) {
      const h = await admin!.hgetall(key);
      const k = h.key!, state = h.state as OutboxState, seq = Number(h.seq), row = OUTBOX_TABLE[state];
      expected.push(`out:st:${state} ${k} ${seq}`, `out:chat:${h.chatId} ${k} ${seq}`);
      if (row.blocksChat) {
        expected.push(`out:open:${h.chatId} ${k} ${seq}`);
        const head = heads.get(h.chatId!);
        if (!head || Number(head.seq) > seq) heads.set(h.chatId!, h);
      }
      if (row.leased) expected.push(`out:lease ${k} ${Number(h.leaseExp)}`, `out:owner:${h.leaseOwner} ${k}`);
      if (row.purgeable) expected.push(`out:sent ${k} ${Number(h.updatedAt)}`);
    }
    for (const [chat, h] of heads) {
      if (OUTBOX_TABLE[h.state as OutboxState].due !== "nextAttemptAt") continue;
      const mark = await admin!.zscore(`${tag}out:due`, h.key!);
      if (mark === null || Number(mark) !== Number(h.nextAttemptAt ?? 0)) {
        unmarkedHeads.push(`${chat}: ${h.key} ${h.state} due ${h.nextAttemptAt}, marked ${mark}`);
      }
    }
    return { stored, expected: expected.sort(), unmarkedHeads };
  }

  test("through every transition, each entry is in exactly the indexes its state and lease call for, each due head marked", async () => {
    // (the transitions each kind of operation made, over every seed: a rare one, such as the late outcome of
    // a send taken for lost, need not come up in each)
    const kinds = new Map<string, number>();
    const count = (kind: string) => kinds.set(kind, (kinds.get(kind) ?? 0) + 1);
    for (const seed of [1, 2, 3]) {
      const { keyPrefix, backend, clock } = auditBackend();
      const outbox = backend.outbox;
      const prng = new Prng(seed);
      const rand = () => prng.next(), pick = <T>(xs: readonly T[]): T => prng.pick(xs);
      let aInc = 1;
      const held = new HeldLeases(count);
      const hold = (entries: OutboxEntry[]) => {
        for (const e of entries) if (e.lease && e.state === "sending") held.take(e.key, e.lease);
      };
      const visited = new Set<OutboxState>();
      let keys = 0;
      for (let step = 0; step < 300; step++) {
        const op = rand();
        const owner = rand() < 0.7 ? "A" : "B";
        const lease = { owner, incarnation: owner === "A" ? `A${aInc}` : "B1", leaseMs: 30_000 };
        const heldKey = held.any(prng);
        const someKey = `k${Math.floor(rand() * Math.max(keys, 1))}`;
        let kind: string;
        if (op < 0.25) {
          kind = "reserve";
          const key = `k${keys++}`;
          const r = await outbox.reserve(
            { key, chatId: `c${Math.floor(rand() * 3)}`, content: { text: key }, contentHash: "h", inboundId: null },
            rand() < 0.6 ? { ...lease, calling: rand() < 0.5 } : undefined,
          );
          hold([r.entry]);
        } else if (op < 0.37) {
          kind = "claimDue";
          const limit = 1 + Math.floor(rand() * 4);
          const claim = await outbox.claimDue({ ...lease, limit, reclaimOwn: rand() < 0.5, resendAmbiguous: rand() < 0.3 });
          hold(claim.due);
        } else if (op < 0.7 && heldKey !== undefined) {
          const token = held.tokens.get(heldKey)!;
          kind = pick(["markCalling", "heartbeat", "sent", "retry later", "dead", "ambiguous"]);
          if (kind === "markCalling") await outbox.markCalling(heldKey, token, 30_000);
          else if (kind === "heartbeat") await outbox.heartbeat(heldKey, token, 30_000);
          else {
            held.tokens.delete(heldKey);
            // the late outcome of a send whose lease was taken for lost (unknown), under its token still its fence
            if ((await outbox.get(heldKey))?.state === "unknown") count("late outcome");
            const outcome = kind === "sent"
              ? outbox.markSent(heldKey, token, `msg-${step}`)
              : kind === "retry later"
              ? outbox.markFailed(heldKey, token, { error: "e", retryInMs: Math.floor(rand() * 20_000) })
              : kind === "dead"
              ? outbox.markFailed(heldKey, token, { error: "e", dead: true })
              : outbox.markFailed(heldKey, token, { error: "e", ambiguous: true });
            await outcome.catch(ignoreStaleLease);
          }
        } else if (op < 0.8) {
          kind = "retry";
          await outbox.retry(someKey);
        } else if (op < 0.85) {
          kind = "discard";
          if (await outbox.discard(someKey)) held.tokens.delete(someKey);
        } else if (op < 0.96) {
          kind = "time";
          clock.now += Math.floor(rand() * 40_000);
        } else {
          // a restart: the owner's next incarnation takes back what its last one held (a bot's first sweep)
          kind = "restart";
          aInc++;
          const next = { owner: "A", incarnation: `A${aInc}`, leaseMs: 30_000 };
          hold((await outbox.claimDue({ ...next, limit: 10, reclaimOwn: true, resendAmbiguous: rand() < 0.5 })).due);
        }
        count(kind);
        if (step % 10 === 9) {
          const { stored, expected, unmarkedHeads } = await outboxEntries(keyPrefix);
          expect(stored, `seed ${seed}, after step ${step} (${kind})`).toEqual(expected);
          expect(unmarkedHeads, `seed ${seed}, after step ${step} (${kind}): due heads without their mark`).toEqual([]);
          for (const e of await outbox.list({ limit: 1000 })) visited.add(e.state);
        }
      }
      expect([...visited].sort(), `seed ${seed}: the states audited`).toEqual(["dead", "failed", "queued", "sending", "sent", "unknown"]);
    }
    for (
      const k of [
        "reserve", "claimDue", "markCalling", "heartbeat", "sent", "retry later", "dead", "ambiguous", "retry", "discard", "time", "restart",
        "taken by another owner", "taken from an earlier incarnation", "lapsed, taken again by its holder", "late outcome",
      ]
    ) {
      expect(kinds.get(k) ?? 0, k).toBeGreaterThan(0);
    }
  }, 60_000);
});

describe.skipIf(Boolean(skip))("chat order at admission", () => {
  test("a leased admit reads the chat's active records ahead of it (pages of 16): a damaged or stale one counts for nothing, a later one neither", async () => {
    const keyPrefix = prefix();
    const backend = new RedisDurability({ client: client(), keyPrefix });
    const a = { owner: "A", incarnation: "1", leaseMs: 60_000 };
    const b = { owner: "B", incarnation: "1", leaseMs: 60_000 };
    // 20 of A's own live leases, then a pending record: the walk goes past the first page to find it.
    for (let i = 0; i < 20; i++) expect((await backend.inbox.admit(inbound(`a${i}`, "c", 1_000 + i), a))?.state).toBe("processing");
    await backend.inbox.admit(inbound("p", "c", 2_000));
    expect((await backend.inbox.admit(inbound("a-next", "c", 3_000), a))?.state, "behind the pending one").toBe("pending");
    // A record that comes later (a greater receivedAt) holds nothing back: only those ahead count.
    expect((await backend.inbox.admit(inbound("a-early", "c", 1_500), a))?.state).toBe("processing");

    // A damaged record ahead is set aside by the admission and holds nothing back; a stale index entry is dropped.
    await backend.inbox.admit(inbound("x", "d", 1_000));
    await admin!.hset(`{${keyPrefix}}in:r:x`, "payload", "{bad");
    await admin!.zadd(`{${keyPrefix}}in:act:d`, 1_100, "0000000000009999gone");
    const own = await backend.inbox.admit(inbound("y", "d", 2_000), b);
    expect([own?.state, own?.lease?.owner, own?.fence]).toEqual(["processing", "B", 1]);
    expect((await backend.inbox.damaged()).map((d) => d.id)).toEqual(["x"]);
    expect(await admin!.zrange(`{${keyPrefix}}in:act:d`, 0, -1)).toEqual(["0000000000000025y"]);
  });
});

describe.skipIf(Boolean(skip))("the called flag", () => {
  const entry = (key: string, chatId = key) => ({ key, chatId, content: 1, contentHash: "h", inboundId: null });

  test("an entry hash written without the called field (an older version) reads as called: true and, when its lease lapses, is ambiguous", async () => {
    const keyPrefix = prefix();
    const backend = new RedisDurability({ client: client(), keyPrefix });
    const old = { owner: "A", incarnation: "1", leaseMs: 150 };
    for (const key of ["legacy", "legacy-resend"]) {
      expect((await backend.outbox.reserve(entry(key), old)).status).toBe("leased");
      expect(await admin!.hget(`{${keyPrefix}}out:r:${key}`, "called")).toBe("0");
      await admin!.hdel(`{${keyPrefix}}out:r:${key}`, "called"); // as written before the field existed
    }
    await backend.outbox.reserve(entry("legacy-queued"));
    await admin!.hdel(`{${keyPrefix}}out:r:legacy-queued`, "called");
    for (const key of ["legacy", "legacy-resend", "legacy-queued"]) {
      expect((await backend.outbox.get(key))?.called, key).toBe(true);
    }
    expect((await backend.outbox.list()).map((e) => e.called)).toEqual([true, true, true]);

    await Bun.sleep(250);
    // Not resending: the lapsed legacy send is unknown (a call may have started), reported once; the
    // queued one is leased, uncalled under its new fence.
    const claim = await backend.outbox.claimDue({ owner: "B", incarnation: "1", leaseMs: 60_000, limit: 1 });
    expect(claim.ambiguous.map((e) => [e.key, e.state, e.attempts, e.fence, e.called])).toEqual([
      ["legacy", "unknown", 1, 1, true],
      ["legacy-resend", "unknown", 1, 1, true],
    ]);
    expect(claim.due.map((e) => [e.key, e.attempts, e.fence, e.called])).toEqual([["legacy-queued", 1, 2, false]]);
    expect(await admin!.hget(`{${keyPrefix}}out:r:legacy-queued`, "called")).toBe("0");
    expect(await admin!.hget(`{${keyPrefix}}out:r:legacy`, "called"), "an unknown entry keeps its (missing) flag").toBe(null);
    expect((await backend.outbox.get("legacy"))?.called).toBe(true);

    // With resendAmbiguous a lapsed legacy send is re-leased as an ambiguous one: attempts + 1, still called (its lost call may yet arrive).
    await backend.outbox.reserve(entry("legacy-2"), old);
    await admin!.hdel(`{${keyPrefix}}out:r:legacy-2`, "called");
    await Bun.sleep(250);
    const resend = await backend.outbox.claimDue({ owner: "C", incarnation: "1", leaseMs: 60_000, resendAmbiguous: true, limit: 10 });
    expect(resend.ambiguous.map((e) => e.key)).toEqual(["legacy-2"]);
    expect(resend.due.map((e) => [e.key, e.attempts, e.fence, e.called])).toEqual([["legacy-2", 2, 2, true]]);
    expect(await admin!.hget(`{${keyPrefix}}out:r:legacy-2`, "called")).toBe("1");
  });

  test("a damaged called field: the markCalling that meets it sets the entry aside and answers false; no scan takes it", async () => {
    const keyPrefix = prefix();
    const backend = new RedisDurability({ client: client(), keyPrefix });
    await backend.outbox.reserve(entry("bad"), claimer("A", 100));
    await backend.outbox.reserve(entry("good"), claimer("A", 100));
    await admin!.hset(`{${keyPrefix}}out:r:bad`, "called", "yes");
    expect(await backend.outbox.markCalling("bad", 1, 100), "no provider call under it").toBe(false);
    expect(await admin!.hget(`{${keyPrefix}}out:r:bad`, "called"), "nothing changed").toBe("yes");
    const read = await rejection(() => backend.outbox.get("bad"));
    expect((read as DamagedRecordError).problem).toBe(`the record at key "{${keyPrefix}}out:r:bad" has a bad field "called": yes`);
    await Bun.sleep(200);
    const claim = await backend.outbox.claimDue({ ...claimer("B"), limit: 10 });
    expect(claim.ambiguous).toEqual([]);
    expect(claim.due).toEqual([(await backend.outbox.get("good"))!]);
    expect(claim.due[0]!.attempts, "the uncalled lapsed send started no attempt").toBe(1);
    expect(await admin!.hget(`{${keyPrefix}}out:r:bad`, "state")).toBe("sending");
  });

  test("markCalling is one script call and stores no request key; the flag and the lease are written together", async () => {
    const keyPrefix = prefix();
    const inner = fromIoredis(client());
    let evalshas = 0;
    const commands: RedisCommands = {
      evalsha: (sha, keys, args) => {
        evalshas++;
        return inner.evalsha(sha, keys, args);
      },
      scriptLoad: (text) => inner.scriptLoad(text),
    };
    const backend = new RedisDurability({ client: commands, keyPrefix });
    const res = await backend.outbox.reserve(entry("k"), claimer("A", 1_000));
    await backend.outbox.markCalling("k", 1, 1_000); // scripts loaded
    const rq = (await admin!.keys(`{${keyPrefix}}rq:*`)).length;
    const before = evalshas;
    expect(await backend.outbox.markCalling("k", 1, 60_000)).toBe(true);
    expect(evalshas - before, "one EVALSHA").toBe(1);
    expect((await admin!.keys(`{${keyPrefix}}rq:*`)).length, "no request key").toBe(rq);
    const e = (await backend.outbox.get("k"))!;
    expect(e.called).toBe(true);
    expect(e.lease!.expiresAt).toBeGreaterThan(res.entry.lease!.expiresAt + 50_000);
    expect(Number(await admin!.zscore(`{${keyPrefix}}out:lease`, "k")), "the lease window moves too").toBe(e.lease!.expiresAt);
    expect(await backend.outbox.markCalling("k", 2, 60_000)).toBe(false);
    const bad = await rejection(() => backend.outbox.markCalling("k", 1, Number.NaN));
    expect(bad).toBeInstanceOf(TypeError);
    expect(bad.message).toContain(`outbox.markCalling: "leaseMs" must be a finite number`);
  });
});

describe.skipIf(Boolean(skip))("ioredis Cluster", () => {
  test("fromIoredis loads a script on every master of a Cluster (SCRIPT LOAD has no key to route by)", async () => {
    const masters = [client(), client()];
    const loadedOn: number[] = [];
    const cluster = {
      evalsha: (sha: string, n: number, ...rest: string[]) => masters[0]!.evalsha(sha, n, ...rest),
      script: () => Promise.reject(new Error("a random node, not the keyed one")),
      call: () => Promise.reject(new Error("unused")),
      nodes: (role?: string) => {
        expect(role).toBe("master");
        return masters.map((m, i) => ({
          ...m,
          script: (sub: "LOAD", text: string) => {
            loadedOn.push(i);
            return m.script(sub, text);
          },
        })) as never;
      },
    };
    const commands = fromIoredis(cluster);
    const sha = await commands.scriptLoad("return 'x'");
    expect(sha).toBe(await admin!.script("LOAD", "return 'x'") as string);
    expect(loadedOn.sort()).toEqual([0, 1]);
    await admin!.script("FLUSH");
    const backend = new RedisDurability({ client: commands, keyPrefix: prefix() });
    expect((await backend.inbox.admit(inbound("c1")))?.state, "NOSCRIPT, loaded on the masters, run").toBe("pending");
  });
});
