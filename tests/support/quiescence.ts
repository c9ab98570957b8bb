/**
 * Waiting until a bot process on a SQLite file is quiescent, for the real-process tests that check
 * that something does NOT happen (a duplicate reply) once the bot is done: the journal is read
 * through the command line's opener (`openBackend` of `@botmesh/durable/ops`) while the bot runs.
 */
import type { InboundState, OutboxState } from "../../backend.ts";
import { countRecords, openBackend } from "../../ops.ts";
import type { FakeTelegram } from "./fake_telegram.ts";

/** Inbound states nothing leaves by itself (no due scan takes them). */
const SETTLED_INBOX: ReadonlySet<InboundState> = new Set(["done", "dead"]);
/** Outbox states nothing leaves by itself (no due scan takes them, no send of them is under way). */
const SETTLED_OUTBOX: ReadonlySet<OutboxState> = new Set(["sent", "dead", "unknown"]);
/** More records than any test journals: lists read them all. */
const ALL = 1_000_000;

/** What keeps a journal from being quiescent, `null` when nothing does. */
async function unsettled(
  backend: Awaited<ReturnType<typeof openBackend>>["backend"],
  fake: FakeTelegram,
  inboundIds: readonly string[],
): Promise<string | null> {
  // Every state of either journal, counted (up to 1): a state added later is not settled unless listed above.
  const counts = await countRecords(backend, 1);
  const active = [
    ...Object.entries(counts.inbox).filter(([state, n]) => n > 0 && !SETTLED_INBOX.has(state as InboundState)).map(([s]) => `inbox ${s}`),
    ...Object.entries(counts.outbox).filter(([state, n]) => n > 0 && !SETTLED_OUTBOX.has(state as OutboxState)).map(([s]) => `outbox ${s}`),
  ];
  if (active.length > 0) return `records still active (${active.join(", ")})`;
  const settled = new Set((await backend.inbox.list({ state: [...SETTLED_INBOX], limit: ALL })).map((r) => r.id));
  const unjournaled = inboundIds.filter((id) => !settled.has(id));
  if (unjournaled.length > 0) return `updates not journaled as settled: ${unjournaled.length}, the first ${JSON.stringify(unjournaled.slice(0, 5))}`;
  // A send is recorded `sent` only after the channel answered it: each must be at the fake.
  const received = new Set(fake.sent.map((s) => `${s.chatId}:${s.messageId}`));
  const sent = await backend.outbox.list({ state: "sent", limit: ALL });
  const unseen = sent.filter((e) => !received.has(`${e.chatId}:${e.messageId}`)).map((e) => e.key);
  if (unseen.length > 0) return `sends journaled as sent that the fake never received: ${unseen.length}, the first ${JSON.stringify(unseen.slice(0, 5))}`;
  return null;
}

/**
 * Resolves once the bot journaling in the SQLite file `db` is quiescent: every update of `inboundIds`
 * has an inbound record, every inbound record is `done` or `dead`, no outbox entry is `queued`,
 * `sending` or `failed` (nor in any other state a due scan takes), and every entry journaled as `sent`
 * was received by `fake`. Past that point the bot sends nothing more on its own: a duplicate reply
 * would already be in `fake.sent`. Re-checked after each API call the fake gets (and every 50 ms);
 * rejects after `timeoutMs` naming what was still unsettled.
 *
 * @param db the bot's SQLite file (its tables must exist: call once the bot has started)
 * @param fake the fake Bot API the bot sends to
 * @param inboundIds the inbound ids of every update delivered to the bot
 * @param timeoutMs the deadline
 */
export async function untilQuiescent(db: string, fake: FakeTelegram, inboundIds: Iterable<string>, timeoutMs = 20_000): Promise<void> {
  const ids = [...inboundIds];
  const opened = await openBackend(`sqlite:${db}`);
  let last: string | null = "not checked yet";
  try {
    await fake.until("the bot to be quiescent", async () => (last = await unsettled(opened.backend, fake, ids)) === null, timeoutMs)
      .catch((error: Error) => {
        throw new Error(`${error.message} (${timeoutMs} ms): ${last}`);
      });
  } finally {
    await opened.close();
  }
}
