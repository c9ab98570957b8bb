// An admission answered leased while an inbox scan that leased an earlier message of its chat to this
// process is unanswered (its immediate repeats failed too): the earlier message still runs first.
import { expect, test } from "bun:test";
import { ANY, Bot, MemoryDurability } from "../mod.ts";
import { MockProvider } from "../testing.ts";
import type { ClaimDueOptions, ClaimOptions, DurabilityBackend, InboxJournal, NewInboundRecord } from "../src/contract.ts";
import { proxied, until } from "./support/lossy.ts";

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));


test("chat order: a later message admitted leased during a lost inbox scan runs before the earlier one it leased", async () => {
  const inner = new MemoryDurability();
  let scanStarted!: () => void;
  const scanStartedP = new Promise<void>((r) => scanStarted = r);
  let m2Issued!: () => void;
  const m2IssuedP = new Promise<void>((r) => m2Issued = r);
  let lost = false;
  let repeatsFail = true;
  let failedRepeats = 0;
  const log: string[] = [];
  const inbox = proxied<InboxJournal>(inner.inbox, {
    claimDue: async (o: ClaimDueOptions) => {
      if (o.repeat) {
        if (repeatsFail) {
          failedRepeats++;
          log.push(`repeat ${o.requestId} -> ECONNREFUSED`);
          throw new Error("connect ECONNREFUSED (repeat)");
        }
        const r = await inner.inbox.claimDue(o);
        log.push(`repeat ${o.requestId} -> [${r.map((x) => x.id)}]`);
        return r;
      }
      const r = await inner.inbox.claimDue(o);
      if (!lost && r.some((x) => x.id === "m1")) {
        lost = true;
        scanStarted();
        await m2IssuedP;
        log.push(`scan ${o.requestId} -> [${r.map((x) => x.id)}] reply lost`);
        throw new Error("read ECONNRESET (after the commit)");
      }
      return r;
    },
    admit: async (record: NewInboundRecord, lease?: ClaimOptions) => {
      const r = await inner.inbox.admit(record, lease);
      if (record.id === "m2") {
        log.push(`admit m2 (leased: ${lease !== undefined}) -> ${r?.state}`);
        m2Issued();
        while (failedRepeats < 3) await sleep(5);
        await sleep(30);
      }
      return r;
    },
  });
  const backend: DurabilityBackend = { name: "lossy", scope: inner.scope, inbox, outbox: inner.outbox };
  const provider = new MockProvider();
  const bot = new Bot({
    provider,
    durability: {
      backend,
      instanceId: "one",
      sweepIntervalMs: 20,
      inbox: { leaseMs: 60_000, admitTimeoutMs: 5_000 },
      outbox: { leaseMs: 60_000 },
    },
  });
  bot.on("error", () => {});
  const starts: string[] = [];
  bot.when(ANY, (ctx) => {
    starts.push(ctx.message.id);
  });
  await bot.start();
  try {
    // m1 of chat c was journaled (pending) by a process that is gone; the next sweep takes it.
    await inner.inbox.admit({
      id: "m1",
      kind: "message",
      chatId: "c",
      provider: "mock",
      payload: { id: "m1", chatId: "c", type: "text", text: "one" },
      receivedAt: Date.now() - 1000,
    });
    await scanStartedP;
    const answer = await provider.receive({ id: "m2", chatId: "c", text: "two" });
    log.push(`m2 answered ${answer.status}`);
    await sleep(100);
    repeatsFail = false;
    await until(() => starts.length === 2, `both handlers (${log.join("; ")})`);
    expect(starts).toEqual(["m1", "m2"]);
  } finally {
    await bot.stop();
  }
});
