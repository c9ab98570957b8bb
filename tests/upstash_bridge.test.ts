// The Upstash-REST bridge the Redis tests use, tested on its own with the real @upstash/redis client.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { Redis } from "@upstash/redis";
import { RespConnection, startUpstashBridge, type UpstashBridge } from "./support/upstash_bridge.ts";
import { REDIS_URL, runId, serviceSkip } from "./support/services.ts";

const skip = await serviceSkip("redis");
const prefix = `bridge-test:${runId()}:`;

describe.skipIf(Boolean(skip))("upstash bridge", () => {
  let bridge: UpstashBridge;
  let admin: RespConnection;
  const clients = (opts: { automaticDeserialization?: boolean } = {}) => ({
    base64: new Redis({ url: bridge.url, token: bridge.token, retry: false, ...opts }),
    plain: new Redis({ url: bridge.url, token: bridge.token, retry: false, responseEncoding: false, ...opts }),
  });

  beforeAll(async () => {
    bridge = await startUpstashBridge();
    const u = new URL(REDIS_URL);
    admin = new RespConnection(u.hostname, Number(u.port || 6379));
  });
  afterAll(async () => {
    const keys = await admin.send(["KEYS", `${prefix}*`]);
    if (Array.isArray(keys) && keys.length > 0) await admin.send(["DEL", ...(keys as Buffer[])]);
    admin.destroy();
    await bridge.stop();
  });

  const tricky = ["héllo ✓ 你好 🎉👨‍👩‍👧‍👦", "", "line\nbreak\t\u0000nul", "{\"json\":[1,2]}", "T0s=", "OK", "123", "1e21"];

  for (const mode of ["base64", "plain"] as const) {
    test(`get/set of unicode and binary-ish strings (${mode})`, async () => {
      const { [mode]: redis } = clients({ automaticDeserialization: false });
      for (const [i, value] of tricky.entries()) {
        const key = `${prefix}${mode}:${i}`;
        expect(await redis.set(key, value)).toBe("OK");
        expect(await redis.get(key), JSON.stringify(value)).toBe(value);
      }
      expect(await redis.get(`${prefix}missing`)).toBe(null);
      expect(await redis.incr(`${prefix}${mode}:n`)).toBe(1);
      // The raw bytes reach Redis unchanged.
      const raw = await admin.send(["GET", `${prefix}${mode}:0`]);
      expect((raw as Buffer).toString("utf8")).toBe(tricky[0]!);
    });

    test(`pipeline and multi-exec (${mode})`, async () => {
      const { [mode]: redis } = clients({ automaticDeserialization: false });
      const key = `${prefix}${mode}:list`;
      const p = redis.pipeline();
      p.rpush(key, "a✓", "b");
      p.lrange(key, 0, -1);
      p.get(`${prefix}missing`);
      p.incr(key); // WRONGTYPE: only this command fails
      const results = await p.exec({ keepErrors: true });
      expect(results[0]!.result).toBe(2);
      expect(results[1]!.result).toEqual(["a✓", "b"]);
      expect(results[2]!.result).toBe(null);
      expect(String(results[3]!.error)).toMatch(/WRONGTYPE/);

      const m = redis.multi();
      m.set(`${prefix}${mode}:m1`, "x€");
      m.incrby(`${prefix}${mode}:m2`, 5);
      m.mget(`${prefix}${mode}:m1`, `${prefix}${mode}:m2`, `${prefix}none`);
      expect(await m.exec()).toEqual(["OK", 5, ["x€", "5", null]]);
    });

    test(`EVAL, EVALSHA and NOSCRIPT (${mode})`, async () => {
      const { [mode]: redis } = clients({ automaticDeserialization: false });
      const script = `return {KEYS[1], ARGV[1], 42, false, {ARGV[2], ''}} -- ${mode} ${runId()}`;
      expect(await redis.eval(script, [`${prefix}k`], ["✓ v", "nested"])).toEqual([`${prefix}k`, "✓ v", 42, null, ["nested", ""]]);
      const sha = await redis.scriptLoad(script);
      expect(sha).toMatch(/^[0-9a-f]{40}$/);
      expect(await redis.evalsha(sha, ["k2"], ["a", "b"])).toEqual(["k2", "a", 42, null, ["b", ""]]);
      let error: unknown;
      try {
        await redis.evalsha("0".repeat(40), [], []);
      } catch (e) {
        error = e;
      }
      expect(String(error)).toMatch(/NOSCRIPT/);
      let luaError: unknown;
      try {
        await redis.eval("return redis.error_reply('ERR botmesh: custom ✓')", [], []);
      } catch (e) {
        luaError = e;
      }
      expect(String(luaError)).toMatch(/ERR botmesh: custom ✓/);
    });
  }

  test("the token is checked", async () => {
    const wrong = new Redis({ url: bridge.url, token: "wrong", retry: false });
    let error: unknown;
    try {
      await wrong.get(`${prefix}x`);
    } catch (e) {
      error = e;
    }
    expect(String(error)).toMatch(/Unauthorized/);
    const res = await fetch(bridge.url, { method: "POST", body: JSON.stringify(["PING"]) });
    expect(res.status).toBe(401);
    const ok = await fetch(bridge.url, {
      method: "POST",
      headers: { authorization: `Bearer ${bridge.token}` },
      body: JSON.stringify(["PING"]),
    });
    expect(await ok.json()).toEqual({ result: "PONG" });
  });

  test("base64 on the wire: every string, nested too; numbers and nil unchanged", async () => {
    const res = await fetch(bridge.url, {
      method: "POST",
      headers: { authorization: `Bearer ${bridge.token}`, "upstash-encoding": "base64" },
      body: JSON.stringify(["EVAL", "return {'é', 7, false, {'x'}}", 0]),
    });
    expect(await res.json()).toEqual({ result: [Buffer.from("é").toString("base64"), 7, null, ["eA=="]] });
  });

  test("restart listens again on the same port; killed Redis connections are reopened", async () => {
    const redis = new Redis({ url: bridge.url, token: bridge.token, retry: false });
    const port = bridge.port;
    await bridge.pause();
    let error: unknown;
    try {
      await redis.get(`${prefix}x`);
    } catch (e) {
      error = e;
    }
    expect(error).toBeDefined();
    await bridge.restart();
    expect(bridge.port).toBe(port);
    expect(await redis.set(`${prefix}after`, "1")).toBe("OK");
    bridge.killRedisConnections();
    expect(await redis.get(`${prefix}after`)).toBe(1); // auto-deserialized by the client
  });
});
