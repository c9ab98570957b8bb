// When a send answers its caller: a handler's reply as soon as the provider answered (its outcome's journal
// write goes on beside the message's done mark), a send from outside a handler only once that write is done.
import { expect, test } from "bun:test";
import { ANY, Bot, MemoryDurability } from "../mod.ts";
import { MockProvider } from "../testing.ts";

/** A memory backend whose markSent waits for `release()`, and the order the engine called markSent and complete in. */
function heldMarkSent() {
  const backend = new MemoryDurability();
  const calls: string[] = [];
  let release!: () => void;
  const released = new Promise<void>((resolve) => (release = resolve));
  const markSent = backend.outbox.markSent.bind(backend.outbox);
  backend.outbox.markSent = async (key, token, messageId) => {
    calls.push(`markSent ${key}`);
    await released;
    return markSent(key, token, messageId);
  };
  const complete = backend.inbox.complete.bind(backend.inbox);
  backend.inbox.complete = (id, token) => {
    calls.push(`complete ${id}`);
    return complete(id, token);
  };
  return { backend, calls, release };
}

test("a handler's reply answers once the provider answered; the done mark is written beside its sent mark, not before it is asked", async () => {
  const { backend, calls, release } = heldMarkSent();
  const provider = new MockProvider();
  const bot = new Bot({ provider, durability: { backend, instanceId: "a" } });
  const seen: { messageId?: string; state?: string }[] = [];
  bot.when(ANY, async (ctx) => {
    const result = await ctx.reply("pong");
    // Answered while its outcome's write waits: the journal still says the call is under way.
    seen.push({ messageId: result.messageId, state: (await backend.outbox.get(result.key))?.state });
  });
  await bot.start();
  try {
    await provider.receive({ id: "m1", chatId: "c", text: "ping" });
    for (let i = 0; i < 50 && calls.length < 2; i++) await new Promise((r) => setTimeout(r, 10));
    expect(seen).toEqual([{ messageId: provider.sent[0]!.messageId, state: "sending" }]);
    expect(calls, "the sent mark is asked first, the done mark right after it (one group commit)").toEqual(["markSent m1:1", "complete m1"]);
    let idle = false;
    const waiting = bot.idle().then(() => (idle = true));
    await new Promise((r) => setTimeout(r, 30));
    expect(idle, "bot.idle() waits for the outcome's write").toBe(false);
    release();
    await waiting;
    expect((await backend.outbox.get("m1:1"))?.state).toBe("sent");
    expect((await backend.inbox.get("m1"))?.state).toBe("done");
  } finally {
    release();
    await bot.stop();
  }
});

test("a send from outside a handler answers only once its outcome is journaled (a script may end right after it)", async () => {
  const { backend, calls, release } = heldMarkSent();
  const provider = new MockProvider();
  const bot = new Bot({ provider, durability: { backend, instanceId: "a" } });
  await bot.start();
  try {
    let answered = false;
    const sending = bot.send("c", "hello", { idempotencyKey: "k1" }).then((r) => {
      answered = true;
      return r;
    });
    for (let i = 0; i < 50 && calls.length < 1; i++) await new Promise((r) => setTimeout(r, 10));
    expect(calls).toEqual(["markSent k1"]);
    expect(provider.sent.length, "the call was made").toBe(1);
    await new Promise((r) => setTimeout(r, 30));
    expect(answered, "not answered while the outcome's write waits").toBe(false);
    release();
    expect((await sending).state).toBe("sent");
    expect((await backend.outbox.get("k1"))?.state).toBe("sent");
  } finally {
    release();
    await bot.stop();
  }
});
