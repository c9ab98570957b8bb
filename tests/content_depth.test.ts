// The journal's bound on nesting: content nested deeper than MAX_CONTENT_DEPTH is refused with the field
// named (never a stack overflow), and cutDeepNesting copies parsed JSON of any depth in bounded stack.
// On the way out: a stored payload or content nested deeper than MAX_STORED_DEPTH (a hand edit, another
// writer) is damage: its record is set aside, and the CLI and the console print such a value cut.
import { afterAll, describe, expect, test } from "bun:test";
import { Database } from "bun:sqlite";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Bot, MemoryDurability } from "../mod.ts";
import { DamagedRecordError } from "../backend.ts";
import { MockProvider } from "../testing.ts";
import { SQLiteDurability } from "../backends/sqlite/mod.ts";
import { openBackend } from "../backends/open_url.ts";
import { runCli } from "../src/ops/cli.ts";
import { prettyJson } from "../src/ops/console_render.ts";
import { storedInboundProblem, storedOutboxProblem } from "../src/stored_records.ts";
import {
  CUT_NESTING_MARK,
  cutDeepNesting,
  decodeContent,
  encodeContent,
  MAX_CONTENT_DEPTH,
  MAX_STORED_DEPTH,
  nestsDeeperThan,
  UnencodableContentError,
} from "../src/content.ts";
import { jsonText } from "../src/sha256_hex.ts";

/** Arrays nested `levels` deep around `inner`. */
function nested(levels: number, inner: unknown = 1): unknown {
  let value = inner;
  for (let i = 0; i < levels; i++) value = [value];
  return value;
}

describe("the journal's bound on nesting", () => {
  test("encodeContent takes MAX_CONTENT_DEPTH levels and refuses one more, naming the field", () => {
    expect(() => encodeContent({ a: nested(MAX_CONTENT_DEPTH - 1) })).not.toThrow();
    let error: unknown;
    try {
      encodeContent({ a: nested(MAX_CONTENT_DEPTH) }, "message");
    } catch (e) {
      error = e;
    }
    expect(error).toBeInstanceOf(UnencodableContentError);
    expect((error as UnencodableContentError).field).toBe(`message.a${"[0]".repeat(MAX_CONTENT_DEPTH - 1)}`);
    expect((error as Error).message).toContain(`nests deeper than ${MAX_CONTENT_DEPTH} levels`);
    // 20 000 levels (40 KB of JSON): the same error, not a stack overflow.
    const deep = JSON.parse("[".repeat(20_000) + "]".repeat(20_000));
    expect(() => encodeContent({ a: deep }, "message")).toThrow(UnencodableContentError);
  });

  test("cutDeepNesting: a copy cut at the depth, the first cut named in document order, any depth", () => {
    const value = { a: 1, b: [{ c: [[2]] }, { d: { e: {} } }], f: "x", __proto__x: null };
    expect(cutDeepNesting(value, 10)).toEqual({ value, cutAt: undefined });
    expect(cutDeepNesting(value, 3)).toEqual({
      value: { a: 1, b: [{ c: CUT_NESTING_MARK }, { d: CUT_NESTING_MARK }], f: "x", __proto__x: null },
      cutAt: "b[0].c",
    });
    expect(cutDeepNesting(7, 1)).toEqual({ value: 7, cutAt: undefined });
    const own = cutDeepNesting(JSON.parse('{"__proto__":{"polluted":1}}'), 5).value as Record<string, unknown>;
    expect(Object.hasOwn(own, "__proto__")).toBe(true);
    expect(({} as Record<string, unknown>).polluted).toBeUndefined();
    const deep = JSON.parse(`{"m":${"[".repeat(300_000)}${"]".repeat(300_000)}}`);
    const cut = cutDeepNesting(deep, 4, "update");
    expect(cut).toEqual({ value: { m: [[[CUT_NESTING_MARK]]] }, cutAt: "update.m[0][0][0]" });
  });

  test("jsonText: JSON.stringify's text of parsed JSON, at any depth (what an unreadable payload's id hashes)", () => {
    const text = '{"a":1,"b":[{"c":[["\\u2028\\"x"]]},null,true,-0.5e-7],"__proto__":{"d":{}},"2":[]}';
    const value = JSON.parse(text);
    expect(jsonText(value)).toBe(JSON.stringify(value));
    expect([jsonText({ a: undefined, b: [undefined] }), jsonText(undefined), jsonText("s")]).toEqual(['{"b":[null]}', undefined, '"s"']);
    const deep = `${"[".repeat(300_000)}{"k":"v"}${"]".repeat(300_000)}`;
    expect(jsonText(JSON.parse(deep))).toBe(deep);
    const loop: Record<string, unknown> = {};
    loop.self = loop;
    expect(() => jsonText(loop)).toThrow(TypeError);
  });

  test("a bot: a message nested too deep is refused at admission with the field named; a send is bypassed, not journaled", async () => {
    const provider = new MockProvider();
    const bot = new Bot({ provider, durability: { backend: new MemoryDurability(), instanceId: "deep" } });
    const errors: Error[] = [];
    bot.on("error", (e) => errors.push(e));
    bot.on("warning", () => {});
    await bot.start();
    try {
      const deep = JSON.parse("[".repeat(20_000) + "]".repeat(20_000));
      const result = await provider.receive({ id: "d1", chatId: "c1", text: "hi", extra: { a: deep } } as never);
      expect(result.status).toBe("rejected");
      const message = "error" in result ? result.error?.message : undefined;
      expect(message).toContain('Field "message.extra.a[0]');
      expect(message).toContain(`nests deeper than ${MAX_CONTENT_DEPTH} levels`);
      const sent = await bot.send("c1", { text: "deep", data: nested(MAX_CONTENT_DEPTH) } as never);
      expect(sent.state).toBe("sent");
      expect(bot.durability!.metrics().outboxBypassed).toBe(1);
    } finally {
      await bot.stop();
    }
  });
});

/** Poll `check` until it holds; fail naming `what` after `ms`. */
async function waitFor(what: string, check: () => boolean | Promise<boolean>, ms = 15_000): Promise<void> {
  const start = performance.now();
  while (!(await check())) {
    if (performance.now() - start > ms) throw new Error(`timed out waiting for ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 10));
  }
}

/** Bun's stack takes a recursion some hundreds of thousands of levels deep; Node's overflows at about 20 000. */
const OVERFLOWING = 300_000;
const overflowingJson = () => "[".repeat(OVERFLOWING) + "]".repeat(OVERFLOWING);

describe("nesting read back from storage", () => {
  const dir = mkdtempSync(join(tmpdir(), "botmesh-stored-depth-"));
  afterAll(() => rmSync(dir, { recursive: true, force: true }));

  const record = (payload: unknown) => ({
    id: "m1", kind: "message", chatId: "c1", provider: "mock", payload, receivedAt: 1, state: "pending",
    attempts: 0, nextAttemptAt: null, lease: null, fence: 0, error: null, updatedAt: 1,
  });

  test("nestsDeeperThan counts levels as encodeContent does, at any depth", () => {
    expect(nestsDeeperThan(nested(3), 3)).toBe(false);
    expect(nestsDeeperThan(nested(4), 3)).toBe(true);
    expect(nestsDeeperThan({ a: [1, { b: {} }], c: "x" }, 4)).toBe(false);
    expect(nestsDeeperThan({ a: [1, { b: {} }], c: "x" }, 3)).toBe(true);
    expect(nestsDeeperThan("text", 1)).toBe(false);
    expect(nestsDeeperThan(JSON.parse(overflowingJson()), MAX_STORED_DEPTH)).toBe(true);
  });

  test("what encodeContent journals reads back (binary at the deepest level included); deeper is a damaged field", () => {
    // The deepest content the journal takes, with bytes at its bottom: one level more once stored ({ "$bytes": … }).
    const deepest = encodeContent({ a: nested(MAX_CONTENT_DEPTH - 1, new Uint8Array([1, 2])) });
    expect(nestsDeeperThan(deepest, MAX_CONTENT_DEPTH)).toBe(true);
    expect(storedInboundProblem(record(deepest))).toBeNull();
    expect(decodeContent(deepest)).toEqual({ a: nested(MAX_CONTENT_DEPTH - 1, new Uint8Array([1, 2])) });
    const problem = storedInboundProblem(record(JSON.parse(overflowingJson())));
    expect(problem).toBe(`field "payload" must be a JSON value nested at most ${MAX_STORED_DEPTH} levels deep (MAX_STORED_DEPTH), got an array nested deeper`);
    expect(storedOutboxProblem({
      key: "k", chatId: "c1", content: { a: nested(MAX_STORED_DEPTH) }, contentHash: "h", inboundId: null, state: "queued",
      attempts: 0, nextAttemptAt: 1, lease: null, fence: 0, called: false, messageId: null, error: null, seq: 1, createdAt: 1, updatedAt: 1,
    })).toContain('field "content" must be a JSON value nested at most');
  });

  test("decodeContent refuses a value nested too deep, naming it, without overflowing the stack", () => {
    expect(() => decodeContent(JSON.parse(overflowingJson()), "payload")).toThrow(
      `Field "payload" cannot be decoded: it nests deeper than ${MAX_STORED_DEPTH} levels`,
    );
  });

  test("the console prints a value nested too deep cut, with a note", () => {
    const text = prettyJson({ a: JSON.parse(overflowingJson()) }, "payload");
    expect(text).toContain(CUT_NESTING_MARK);
    expect(text).toContain(`(payload cut: nested deeper than ${MAX_STORED_DEPTH} levels, first at payload.a${"[0]".repeat(MAX_STORED_DEPTH - 1)})`);
  });

  /** A SQLite journal with a record `ok1` and a record `deep1` whose stored payload was edited to nest too deep. */
  async function journalWithDeepRecord(): Promise<string> {
    const file = join(dir, `${crypto.randomUUID()}.db`);
    const b = new SQLiteDurability({ file });
    await b.open();
    for (const [id, chatId] of [["deep1", "c1"], ["ok1", "c2"]]) {
      await b.inbox.admit({
        id: id!,
        kind: "message",
        chatId: chatId!,
        provider: "mock",
        payload: encodeContent({ id, chatId, text: "hi", extra: { x: 0 } }, "message"),
        receivedAt: Date.now(),
      });
    }
    await b.close();
    const db = new Database(file);
    try {
      const row = db.prepare("SELECT payload FROM botmesh_inbox WHERE id = 'deep1'").get() as { payload: string };
      db.prepare("UPDATE botmesh_inbox SET payload = ? WHERE id = 'deep1'").run(row.payload.replace('{"x":0}', overflowingJson()));
    } finally {
      db.close();
    }
    return file;
  }

  test("a bot sets a record whose stored payload nests too deep aside as damaged; the other records go on", async () => {
    const file = await journalWithDeepRecord();
    const provider = new MockProvider();
    const backend = new SQLiteDurability({ file });
    const bot = new Bot({ provider, durability: { backend, instanceId: "stored-deep", sweepIntervalMs: 20 } });
    const errors: Error[] = [];
    bot.on("error", (e) => errors.push(e));
    bot.on("warning", () => {});
    bot.when(/.*/, (ctx) => ctx.reply("ok"));
    await bot.start();
    try {
      await waitFor("the damaged record reported", () => errors.some((e) => e instanceof DamagedRecordError));
      await waitFor("the other record answered", () => provider.sent.length === 1);
      expect(provider.sent.map((s) => s.chatId)).toEqual(["c2"]);
      expect(errors.map((e) => e.message).filter((m) => m.includes("Maximum call stack"))).toEqual([]);
      const damaged = await backend.inbox.damaged();
      expect(damaged.map((d) => d.id)).toEqual(["deep1"]);
      expect(damaged[0]!.problem).toContain(`column payload must be a JSON value nested at most ${MAX_STORED_DEPTH} levels deep`);
      await waitFor("the other record done", async () => (await backend.inbox.get("ok1"))?.state === "done");
    } finally {
      await bot.stop();
    }
  }, 30_000);

  test("CLI show of such a record says it is damaged and why", async () => {
    const file = await journalWithDeepRecord();
    const out: string[] = [];
    const io = { stdout: (t: string) => void out.push(t), stderr: (t: string) => void out.push(t) };
    await runCli(["-b", `sqlite:${file}`, "show", "inbox", "deep1"], io, { open: openBackend });
    const text = out.join("");
    expect(text).not.toContain("Maximum call stack");
    expect(text).toContain("deep1");
    expect(text).toContain(`nested at most ${MAX_STORED_DEPTH} levels deep`);
  }, 30_000);
});
