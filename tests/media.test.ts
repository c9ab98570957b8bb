// MediaSeal (the sealed media reference) and loadMediaOf's reasons, without a channel.
import { describe, expect, test } from "bun:test";
import { Bot, IMAGE, type InboundMessage, loadMediaOf, MediaUnavailableError, MemoryDurability, type Provider, type StoredMediaRef } from "../mod.ts";
import { MediaSeal } from "../provider.ts";
import { MockProvider } from "../src/testing/mock_provider.ts";

const KEY = "a key of at least sixteen bytes";

async function reasonOf(work: Promise<unknown>): Promise<string> {
  try {
    await work;
    return "resolved";
  } catch (error) {
    if (error instanceof MediaUnavailableError) return error.reason;
    throw error;
  }
}

describe("MediaSeal", () => {
  test("seal and open round-trip through JSON text, whatever the key order after the round trip", async () => {
    const seal = new MediaSeal({ provider: "tg", key: KEY });
    const ref = { fileId: "AgAC", size: 12, nested: { b: [1, { y: 2, x: 3 }], a: "é\u0000" } };
    const stored = await seal.seal(ref);
    expect(stored).toMatchObject({ v: 1, provider: "tg", ref });
    const reordered = JSON.parse(JSON.stringify({ mac: (stored as { mac: string }).mac, ref: { nested: { a: "é\u0000", b: [1, { x: 3, y: 2 }] }, size: 12, fileId: "AgAC" }, provider: "tg", v: 1 }));
    expect(await seal.open(reordered, "m1")).toEqual(ref);
    expect(await seal.open(JSON.parse(JSON.stringify(stored)), "m1")).toEqual(ref);
  });

  test("a Date in a reference seals as its string and opens again", async () => {
    const seal = new MediaSeal({ provider: "tg", key: KEY });
    const stored = await seal.seal({ at: new Date(0) } as never);
    expect(await seal.open(JSON.parse(JSON.stringify(stored)))).toEqual({ at: "1970-01-01T00:00:00.000Z" });
  });

  test("tampered, another key, a bad MAC encoding, an unknown version, another provider: each with its reason", async () => {
    const seal = new MediaSeal({ provider: "tg", key: KEY });
    const stored = await seal.seal({ fileId: "A" }) as { v: number; provider: string; ref: { fileId: string }; mac: string };
    expect(await reasonOf(seal.open({ ...stored, ref: { fileId: "B" } }))).toBe("rehydrate-failed");
    expect(await reasonOf(new MediaSeal({ provider: "tg", key: `${KEY}!` }).open(stored))).toBe("rehydrate-failed");
    expect(await reasonOf(seal.open({ ...stored, mac: "not base64url!" }))).toBe("rehydrate-failed");
    expect(await reasonOf(seal.open({ ...stored, mac: stored.mac.slice(0, -2) }))).toBe("rehydrate-failed");
    const unknown = seal.open({ ...stored, v: 2 }, "m9");
    await expect(unknown).rejects.toThrow('unknown version 2');
    expect(await reasonOf(seal.open({ ...stored, v: 2 }))).toBe("rehydrate-failed");
    expect(await reasonOf(seal.open({ ...stored, provider: "wa" }))).toBe("provider-mismatch");
    expect(await reasonOf(seal.open({ v: 1, provider: "tg", ref: {} }))).toBe("rehydrate-failed");
    expect(await reasonOf(seal.open("garbage"))).toBe("rehydrate-failed");
    expect(await reasonOf(seal.open(seal.notDurable("view-once")))).toBe("not-durable");
  });

  test("bad options name the field", () => {
    expect(() => new MediaSeal({ provider: "tg", key: "short" })).toThrow(/"mediaKey" must be at least 16 bytes, got 5/);
    expect(() => new MediaSeal({ provider: "tg", key: 42 as never })).toThrow(/"mediaKey" must be a string or a Uint8Array/);
    expect(() => new MediaSeal({ provider: "", key: KEY })).toThrow(/"provider" must be a non-empty string/);
    expect(() => new MediaSeal({ provider: "tg", key: new Uint8Array(16) })).not.toThrow();
  });

  test("a reference that is not JSON is refused", async () => {
    const seal = new MediaSeal({ provider: "tg", key: KEY });
    await expect(seal.seal({ f: (() => 1) as never })).rejects.toThrow(TypeError);
  });
});

describe("loadMediaOf", () => {
  const ctxOf = (message: Partial<InboundMessage>, provider: Partial<Provider>) => ({
    message: { id: "m1", chatId: "c", type: "image", ...message } as InboundMessage,
    bot: { provider: { name: "tg", start() {}, send: () => Promise.reject(new Error("unused")), ...provider } as Provider },
  });

  test("the reasons: no media, no loader, unsealed media, not kept, another provider; null without throwOnError", async () => {
    const seal = new MediaSeal({ provider: "tg", key: KEY });
    const loader = { loadMedia: (m: StoredMediaRef) => seal.open(m).then(() => ({ data: new Uint8Array([1]) })) };
    const cases: [Partial<InboundMessage>, Partial<Provider>, string][] = [
      [{}, loader, "not-durable"],
      [{ media: await seal.seal({ id: 1 }) }, {}, "not-durable"],
      [{ media: { fileId: "raw" } }, loader, "not-durable"],
      [{ media: seal.notDurable("view-once") }, loader, "not-durable"],
      [{ media: { ...await seal.seal({ id: 1 }), provider: "wa" } }, loader, "provider-mismatch"],
      [{ media: { ...await seal.seal({ id: 1 }), v: 7 } }, loader, "rehydrate-failed"],
      [{ media: { ...await seal.seal({ id: 1 }), ref: { id: 2 } } }, loader, "rehydrate-failed"],
    ];
    for (const [message, provider, reason] of cases) {
      const ctx = ctxOf(message, provider);
      expect(await reasonOf(loadMediaOf(ctx, { throwOnError: true })), JSON.stringify(message)).toBe(reason);
      expect(await loadMediaOf(ctx)).toBe(null);
    }
    const ok = await loadMediaOf(ctxOf({ media: await seal.seal({ id: 1 }) }, loader));
    expect(ok?.data).toEqual(new Uint8Array([1]));
  });

  test("an error that is not about the reference (a network failure) is thrown as it is, so the inbox retries", async () => {
    const seal = new MediaSeal({ provider: "tg", key: KEY });
    const ctx = ctxOf({ media: await seal.seal({ id: 1 }) }, { loadMedia: () => Promise.reject(new TypeError("fetch failed")) });
    await expect(loadMediaOf(ctx)).rejects.toThrow("fetch failed");
    const bad = ctxOf({ media: await seal.seal({ id: 1 }) }, { loadMedia: () => Promise.resolve({ data: "x" } as never) });
    await expect(loadMediaOf(bad)).rejects.toThrow(/without a Uint8Array "data"/);
  });

  test("through a bot: the first processing and a replay load the same media", async () => {
    const provider = new MockProvider();
    const bot = new Bot({ provider, durability: { backend: new MemoryDurability(), instanceId: "media" } });
    const seen: string[] = [];
    bot.when(IMAGE, async (ctx) => {
      const media = await loadMediaOf(ctx, { throwOnError: true });
      seen.push(`${media!.mimeType} ${new TextDecoder().decode(media!.data)}`);
    });
    await bot.start();
    await provider.receive({ id: "p1", chatId: "c", media: { type: "image", data: "bytes", mimeType: "image/png" } });
    await bot.idle();
    await bot.durability!.replayInbound("p1");
    await bot.idle();
    expect(seen).toEqual(["image/png bytes", "image/png bytes"]);
    await bot.stop();
  });
});
