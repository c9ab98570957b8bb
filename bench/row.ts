/**
 * One measured run of the bot in its own process (spawned by bench/run.ts):
 *
 *   bun bench/row.ts '{"mode":"load","ns":{...},"chats":100,"seconds":2,"warmSeconds":0.5}'
 *   bun bench/row.ts '{"mode":"recovery","ns":{...},"records":10000}'
 *
 * Prints one JSON line ({@link RowResult}); exits 1 when the run was incorrect
 * (a message not replied exactly once, a record left unfinished, the done and
 * sent counts not the totals) or crashed.
 */
import { Bot } from "../mod.ts";
import type { DurabilityBackend, InboundRecord } from "../src/contract.ts";
import { encodeContent } from "../src/content.ts";
import { BenchProvider, childMain, closedLoop, type LoadConfig, type Ns, openKind, peakRssMb, replyWaiters, type RowResult } from "./lib.ts";

interface Config extends Partial<LoadConfig> {
  mode: "load" | "recovery";
  ns: Ns;
  records?: number;
  /** Scale rows: finished messages already in the store (for verify). */
  retained?: number;
}

function makeBot(provider: BenchProvider, backend: DurabilityBackend | undefined): Bot {
  const bot = new Bot({ provider, ...(backend ? { durability: { backend, instanceId: "bench" } } : {}) });
  bot.when(() => true, (ctx) => ctx.reply(`r:${ctx.message.id}`));
  return bot;
}

/** How many of `ids` the journals hold done (inbound) and sent (their replies), listed by state. */
async function countStates(backend: DurabilityBackend, ids: Set<string>, limit: number): Promise<{ done: number; sent: number }> {
  const done = (await backend.inbox.list({ state: "done", limit })).filter((r) => ids.has(r.id)).length;
  const sent = (await backend.outbox.list({ state: "sent", limit })).filter((e) => e.inboundId !== null && ids.has(e.inboundId)).length;
  return { done, sent };
}

/**
 * Throws unless every message got exactly one reply, the journals hold nothing unfinished, and (when
 * the backend lists by state) the done inbound records and sent replies of these messages are the totals.
 */
async function verify(provider: BenchProvider, total: number, prefix: string, backend: DurabilityBackend | undefined, retained = 0): Promise<void> {
  provider.verify(total, prefix);
  if (!backend) return;
  const inbound = await backend.inbox.list({ state: ["pending", "processing", "failed", "dead"], limit: 5 });
  if (inbound.length > 0) throw new Error(`inbox records left unfinished: ${inbound.map((r) => `${r.id} ${r.state}`).join(", ")}`);
  const outbound = await backend.outbox.list({ state: ["queued", "sending", "failed", "dead", "unknown"], limit: 5 });
  if (outbound.length > 0) throw new Error(`outbox entries left unsent: ${outbound.map((e) => `${e.key} ${e.state}`).join(", ")}`);
  const ids = new Set(Array.from({ length: total }, (_, n) => `${prefix}m-${n}`));
  // A scale row's store holds up to 1M more finished messages: counting them all is left out above 10k (the 1k size runs the same check).
  if (retained > 10_000) return;
  const { done, sent } = await countStates(backend, ids, retained + 1_000_000);
  if (done !== total || sent !== total) throw new Error(`journals hold ${done} done inbound records and ${sent} sent replies of ${total} messages`);
}

/** Closed loop: each chat sends its next message once the reply to its previous one went out. */
async function load(cfg: Config): Promise<RowResult> {
  const opened = await openKind(cfg.ns);
  const provider = new BenchProvider();
  const bot = makeBot(provider, opened.backend);
  await bot.start();
  const replied = replyWaiters(provider);
  const prefix = cfg.idPrefix ?? "";
  const { total, result } = await closedLoop(cfg as LoadConfig, async (n, c) => {
    const id = `${prefix}m-${n}`;
    const reply = replied(id);
    const admitted = await provider.receive({ id, chatId: `c${c}`, text: id });
    if (admitted.status !== "admitted") throw new Error(`message ${id} was ${admitted.status}`);
    await reply;
  }, () => bot.idle());
  await verify(provider, total, prefix, opened.backend, cfg.retained ?? 0);
  await bot.stop();
  await opened.close();
  return result;
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
  // Record i is received at t0 + i, and admitted last first: a leased admission looks at the chat's
  // records received before it (none yet), so seeding a large backlog stays linear.
  const t0 = Date.now() - n;
  for (let end = n; end > 0; end -= 500) {
    await Promise.all(Array.from({ length: Math.min(500, end) }, (_, k) => {
      const i = end - 1 - k, id = `rec-m-${i}`, chatId = `rc${i % 100}`;
      return dead.inbox.admit({
        id,
        kind: "message",
        chatId,
        provider: "mock",
        payload: encodeContent({ id, chatId, type: "text", text: id }, "message"),
        receivedAt: t0 + i,
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
  await verify(provider, n, "rec-", backend);
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
