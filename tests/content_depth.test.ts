// The journal's bound on nesting: content nested deeper than MAX_CONTENT_DEPTH is refused with the field
// named (never a stack overflow), and cutDeepNesting copies parsed JSON of any depth in bounded stack.
import { describe, expect, test } from "bun:test";
import { Bot, MemoryDurability } from "../mod.ts";
import { MockProvider } from "../testing.ts";
import { CUT_NESTING_MARK, cutDeepNesting, encodeContent, MAX_CONTENT_DEPTH, UnencodableContentError } from "../src/content.ts";
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
