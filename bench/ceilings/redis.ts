/**
 * Ceiling: the fewest Redis commands our protocol needs per message, on the same client (ioredis, one
 * connection) with the batching our backend does or aims for (the writes called in one turn go out in
 * one MULTI/EXEC: one round trip, atomic as a script call; up to `inFlight`, 8, such batches pipelined)
 * and no library logic.
 *
 * Per message, four writes of three commands each, every one our protocol makes for a message whose
 * reply goes out at once: admit (HSET the inbound record, leased; ZADD it to the due index and to its
 * chat's active index), reserve with the call's announcement (the same for the reply, its `called`
 * field set in the same HSET), markSent (HSET sent;
 * ZREM from both indexes), complete (HSET done; ZREM from both). No script, no fencing check (a script
 * would be needed for one), no payload checks, no chat-order read, no damage indexes.
 *
 * The closed loop is ours: admit, reserve, the mock provider's send (the loop closes there), then
 * markSent and complete, while the chat's next message is admitted.
 *
 *   bun bench/ceilings/redis.ts '{"ns":{...},"chats":100,"seconds":2,"warmSeconds":0.5}'
 */
import Redis from "ioredis";
import { REDIS_URL } from "../../tests/support/services.ts";
import { childMain, type LoadConfig, type Ns, type RowResult } from "../lib.ts";
import { protocolLoop, type ProtocolWrite, TurnBatcher, type Write } from "./batch.ts";

const cfg = JSON.parse(process.argv[2] ?? "{}") as LoadConfig & { ns: Ns; inFlight?: number };

childMain(async (): Promise<RowResult> => {
  const client = new Redis(cfg.ns.redisUrl ?? REDIS_URL);
  const P = `{${cfg.ns.name}}`;
  const batcher = new TurnBatcher<ProtocolWrite>(async (batch: Write<ProtocolWrite>[]) => {
    const m = client.multi();
    for (const { kind, row: r } of batch) {
      const s = (x: unknown) => String(x);
      if (kind === "admit") {
        m.hset(`${P}in:${r.id}`, "chatId", s(r.chat), "state", "processing", "payload", s(r.payload), "receivedAt", s(r.at), "token", s(r.token), "until", s(r.until));
        m.zadd(`${P}in:due`, s(r.until), s(r.id));
        m.zadd(`${P}in:act:${r.chat}`, s(r.at), s(r.id));
      } else if (kind === "reserve") {
        m.hset(`${P}out:${r.key}`, "chatId", s(r.chat), "inboundId", s(r.id), "state", "sending", "content", s(r.content), "called", "1", "token", s(r.token), "until", s(r.until));
        m.zadd(`${P}out:due`, s(r.until), s(r.key));
        m.zadd(`${P}out:act:${r.chat}`, s(r.at), s(r.key));
      } else if (kind === "sent") {
        m.hset(`${P}out:${r.key}`, "state", "sent", "receipt", s(r.receipt), "token", "", "until", "");
        m.zrem(`${P}out:due`, s(r.key));
        m.zrem(`${P}out:act:${r.chat}`, s(r.key));
      } else {
        m.hset(`${P}in:${r.id}`, "state", "done", "token", "", "until", "");
        m.zrem(`${P}in:due`, s(r.id));
        m.zrem(`${P}in:act:${r.chat}`, s(r.id));
      }
    }
    const replies = await m.exec();
    const failed = replies?.find(([e]) => e);
    if (!replies || failed) throw failed?.[0] ?? new Error("ceiling: MULTI aborted");
  }, cfg.inFlight ?? 8);

  const { total, result } = await protocolLoop(cfg, batcher, {
    admit: (m) => {
      const now = Date.now();
      return { id: m.id, chat: m.chat, payload: JSON.stringify({ id: m.id, chatId: m.chat, type: "text", text: m.id }), at: now, token: m.token, until: now + 30_000 };
    },
    reserve: (m) => {
      const now = Date.now();
      return { key: m.key, id: m.id, chat: m.chat, content: JSON.stringify({ text: `r:${m.id}` }), at: now, token: m.outToken, until: now + 30_000 };
    },
    sent: (m, receipt) => ({ key: m.key, chat: m.chat, receipt }),
    done: (m) => ({ id: m.id, chat: m.chat }),
  });
  let done = 0, sent = 0;
  for (let i = 0; i < total; i += 5000) {
    const p = client.pipeline();
    for (let n = i; n < Math.min(total, i + 5000); n++) p.hget(`${P}in:m-${n}`, "state").hget(`${P}out:m-${n}:0`, "state");
    for (const [k, [, v]] of (await p.exec())!.entries()) {
      if (k % 2 === 0 && v === "done") done++;
      if (k % 2 === 1 && v === "sent") sent++;
    }
  }
  const open = await client.zcard(`${P}in:due`) + await client.zcard(`${P}out:due`);
  if (done !== total || sent !== total || open !== 0) throw new Error(`ceiling: ${done} done, ${sent} sent of ${total}; ${open} left in the due indexes`);
  await client.quit();
  return { ...result, note: `one MULTI/EXEC per turn, ${cfg.inFlight ?? 8} in flight; ${(batcher.writes / batcher.batches).toFixed(1)} writes per batch` };
});
