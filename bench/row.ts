/**
 * One measured run of the bot in its own process (spawned by bench/run.ts):
 *
 *   bun bench/row.ts '{"mode":"load","ns":{...},"chats":100,"messages":20000}'
 *   bun bench/row.ts '{"mode":"recovery","ns":{...},"records":10000}'
 *
 * Prints one JSON line ({@link RowResult}); exits 1 when the run was incorrect
 * (a message not replied exactly once, a record left unfinished) or crashed.
 */
import { Bot } from "../mod.ts";
import type { DurabilityBackend, InboundRecord } from "../src/backend.ts";
import { encodeContent } from "../src/content.ts";
import type { OutboundContent, SendContext, SendReceipt } from "../src/provider.ts";
import { MockProvider } from "../testing.ts";
import { childMain, loadResult, type Ns, openKind, peakRssMb, type RowResult } from "./lib.ts";

interface Config {
  mode: "load" | "recovery";
  ns: Ns;
  chats?: number;
  messages?: number;
  records?: number;
}

/** A mock provider that answers at once and tells who waits for a reply. */
class BenchProvider extends MockProvider {
  readonly replies = new Map<string, number>();
  onReply: (id: string) => void = () => {};
  override async send(chatId: string, content: OutboundContent, context: SendContext): Promise<SendReceipt> {
    const receipt = await super.send(chatId, content, context);
    const text = typeof content === "string" ? content : String(content.text);
    const id = text.slice(2); // "r:<message id>"
    this.replies.set(id, (this.replies.get(id) ?? 0) + 1);
    this.onReply(id);
    return receipt;
  }
}

function makeBot(provider: BenchProvider, backend: DurabilityBackend | undefined, onHandler?: () => void): Bot {
  const bot = new Bot({ provider, ...(backend ? { durability: { backend, instanceId: "bench" } } : {}) });
  bot.when(() => true, (ctx) => {
    onHandler?.();
    return ctx.reply(`r:${ctx.message.id}`);
  });
  return bot;
}

/** Throws unless every id got exactly one reply and the journals hold nothing unfinished. */
async function verify(provider: BenchProvider, ids: string[], backend: DurabilityBackend | undefined): Promise<void> {
  const wrong = ids.filter((id) => provider.replies.get(id) !== 1);
  if (wrong.length > 0 || provider.replies.size !== ids.length) {
    throw new Error(
      `${wrong.length} of ${ids.length} messages not replied exactly once (e.g. ${wrong.slice(0, 3).map((id) => `${id}: ${provider.replies.get(id) ?? 0}`).join(", ")}); ${provider.replies.size} replied ids`,
    );
  }
  if (!backend) return;
  const inbound = await backend.inbox.list({ state: ["pending", "processing", "failed", "dead"], limit: 5 });
  if (inbound.length > 0) throw new Error(`inbox records left unfinished: ${inbound.map((r) => `${r.id} ${r.state}`).join(", ")}`);
  const outbound = await backend.outbox.list({ state: ["queued", "sending", "failed", "dead", "unknown"], limit: 5 });
  if (outbound.length > 0) throw new Error(`outbox entries left unsent: ${outbound.map((e) => `${e.key} ${e.state}`).join(", ")}`);
}

/** Closed loop: each chat sends its next message once the reply to its previous one went out. */
async function load(cfg: Config): Promise<RowResult> {
  const chats = cfg.chats!, perChat = Math.ceil(cfg.messages! / chats), total = perChat * chats;
  const opened = await openKind(cfg.ns);
  const provider = new BenchProvider();
  const bot = makeBot(provider, opened.backend);
  await bot.start();
  const latency = new Float64Array(total);
  const sentAt = new Map<string, number>();
  const waiting = new Map<string, () => void>();
  provider.onReply = (id) => {
    const t0 = sentAt.get(id);
    if (t0 !== undefined) latency[Number(id.slice(id.lastIndexOf("-") + 1))] = performance.now() - t0;
    waiting.get(id)?.();
  };
  const ids: string[] = [];
  const chat = async (c: number) => {
    for (let k = 0; k < perChat; k++) {
      const n = k * chats + c, id = `m-${n}`;
      ids.push(id);
      const replied = new Promise<void>((resolve) => waiting.set(id, resolve));
      sentAt.set(id, performance.now());
      const admitted = await provider.receive({ id, chatId: `c${c}`, text: id });
      if (admitted.status !== "admitted") throw new Error(`message ${id} was ${admitted.status}`);
      await replied;
      waiting.delete(id);
    }
  };
  const started = performance.now();
  await Promise.all(Array.from({ length: chats }, (_, c) => chat(c)));
  await bot.idle();
  const ms = performance.now() - started;
  await verify(provider, ids, opened.backend);
  await bot.stop();
  await opened.close();
  return loadResult(total, ms, latency);
}

/**
 * Restart recovery: `records` inbound records leased to a dead incarnation of
 * instance "bench" (long lease), then a new bot on the same store. A restarted
 * bot takes its own previous incarnation's leases at once (`reclaimOwn` in the
 * first sweep), whatever their expiry.
 */
async function recovery(cfg: Config): Promise<RowResult> {
  const n = cfg.records!;
  const first = await openKind(cfg.ns);
  const dead = first.backend!;
  await dead.open?.();
  const lease = { owner: "bench", incarnation: "dead-incarnation", leaseMs: 3_600_000 };
  const ids = Array.from({ length: n }, (_, i) => `rec-${i}`);
  for (let i = 0; i < n; i += 500) {
    await Promise.all(ids.slice(i, i + 500).map((id, j) => {
      const chatId = `rc${(i + j) % 100}`;
      return dead.inbox.admit({
        id,
        kind: "message",
        chatId,
        provider: "mock",
        payload: encodeContent({ id, chatId, type: "text", text: id }, "message"),
        receivedAt: Date.now(),
      }, lease);
    }));
  }
  await dead.close?.();
  await first.close();

  const opened = await openKind(cfg.ns);
  const backend = opened.backend!;
  let claimed = 0, claimedAt = 0, started = 0;
  const inbox = backend.inbox;
  const claimDue = inbox.claimDue.bind(inbox), claim = inbox.claim.bind(inbox);
  const count = (records: (InboundRecord | null)[]) => {
    claimed += records.filter((r) => r?.lease?.incarnation !== undefined && r.lease.incarnation !== lease.incarnation).length;
    if (claimed >= n && claimedAt === 0) claimedAt = performance.now();
  };
  inbox.claimDue = async (o) => {
    const r = await claimDue(o);
    count(r);
    return r;
  };
  inbox.claim = async (id, o) => {
    const r = await claim(id, o);
    count([r]);
    return r;
  };
  const provider = new BenchProvider();
  const bot = makeBot(provider, backend);
  let replies = 0;
  const all = new Promise<void>((resolve) => {
    provider.onReply = () => {
      if (++replies === n) resolve();
    };
  });
  started = performance.now();
  await bot.start();
  const startMs = performance.now() - started;
  await all;
  await bot.idle();
  const doneMs = performance.now() - started;
  if (claimedAt === 0) throw new Error(`only ${claimed} of ${n} records were claimed by the new incarnation`);
  await verify(provider, ids, backend);
  await bot.stop();
  await opened.close();
  return {
    messages: n,
    ms: doneMs,
    msgPerSec: n / (doneMs / 1000),
    p50: NaN,
    p99: NaN,
    rssMb: peakRssMb(),
    claimedMs: claimedAt - started,
    doneMs,
    startMs,
  };
}

const cfg = JSON.parse(process.argv[2] ?? "{}") as Config;
childMain(() => cfg.mode === "recovery" ? recovery(cfg) : load(cfg));
