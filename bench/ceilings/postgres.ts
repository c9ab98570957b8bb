/**
 * Ceiling: the fewest Postgres statements our protocol needs per message, on the same client
 * (porsager `postgres`) with the same batching as our backend and no library logic.
 *
 * Per message, four writes, every one our protocol makes for a message whose reply goes out at once:
 * admit (INSERT the inbound record, leased), reserve with the call's announcement (INSERT the reply,
 * leased, `called` set: the write that tells a crash after it from a crash before the call), markSent
 * (UPDATE the reply: sent, fenced by its lease token), complete (UPDATE the record: done, fenced). The writes called in one turn go in one transaction (BEGIN, one multi-row statement per
 * kind via `json_to_recordset($1::text::json)`, COMMIT, pipelined on one connection: one round trip); a lone
 * write is one statement. Tables: the primary key plus the two indexes the protocol reads (due records,
 * a chat's active records), partial on the unfinished rows. No chat-order probe, no retries, no damage
 * checks, no chat table.
 *
 * The closed loop is ours: admit, reserve, the mock provider's send (the loop closes there), then
 * markSent and complete, while the chat's next message is admitted.
 *
 *   bun bench/ceilings/postgres.ts '{"ns":{...},"chats":100,"seconds":2,"warmSeconds":0.5,"groups":1}'
 */
import postgres from "postgres";
import { childMain, type LoadConfig, type Ns, pgUrl, type RowResult } from "../lib.ts";
import { protocolLoop, type ProtocolWrite, TurnBatcher, type Write } from "./batch.ts";

const cfg = JSON.parse(process.argv[2] ?? "{}") as LoadConfig & { ns: Ns; groups?: number };

childMain(async (): Promise<RowResult> => {
  const groups = cfg.groups ?? 1;
  const sql = postgres(pgUrl(cfg.ns), { max: 10, fetch_types: false, onnotice: () => {} });
  const s = `"${cfg.ns.name}"`;
  await sql.unsafe(`
    CREATE SCHEMA ${s};
    CREATE TABLE ${s}.inbox (id text PRIMARY KEY, chat_id text NOT NULL, state text NOT NULL, payload jsonb NOT NULL,
      received_at bigint NOT NULL, lease_token bigint, lease_until bigint, updated_at bigint NOT NULL);
    CREATE INDEX ON ${s}.inbox (lease_until) WHERE state <> 'done';
    CREATE INDEX ON ${s}.inbox (chat_id, received_at) WHERE state <> 'done';
    CREATE TABLE ${s}.outbox (key text PRIMARY KEY, chat_id text NOT NULL, inbound_id text, state text NOT NULL, content jsonb NOT NULL,
      called boolean NOT NULL, receipt text, lease_token bigint, lease_until bigint, updated_at bigint NOT NULL);
    CREATE INDEX ON ${s}.outbox (lease_until) WHERE state <> 'sent';
    CREATE INDEX ON ${s}.outbox (chat_id, updated_at) WHERE state <> 'sent';
  `);
  const text: Record<ProtocolWrite, string> = {
    admit: `INSERT INTO ${s}.inbox (id, chat_id, state, payload, received_at, lease_token, lease_until, updated_at)
      SELECT id, chat_id, 'processing', payload, at, token, until, at FROM json_to_recordset($1::text::json)
      AS r(id text, chat_id text, payload jsonb, at bigint, token bigint, until bigint)`,
    reserve: `INSERT INTO ${s}.outbox (key, chat_id, inbound_id, state, content, called, lease_token, lease_until, updated_at)
      SELECT key, chat_id, inbound_id, 'sending', content, true, token, until, at FROM json_to_recordset($1::text::json)
      AS r(key text, chat_id text, inbound_id text, content jsonb, at bigint, token bigint, until bigint)`,
    sent: `UPDATE ${s}.outbox o SET state = 'sent', receipt = r.receipt, lease_token = NULL, lease_until = NULL, updated_at = r.at
      FROM json_to_recordset($1::text::json) AS r(key text, token bigint, receipt text, at bigint) WHERE o.key = r.key AND o.lease_token = r.token`,
    done: `UPDATE ${s}.inbox i SET state = 'done', lease_token = NULL, lease_until = NULL, updated_at = r.at
      FROM json_to_recordset($1::text::json) AS r(id text, token bigint, at bigint) WHERE i.id = r.id AND i.lease_token = r.token`,
  };
  const ORDER: ProtocolWrite[] = ["admit", "reserve", "sent", "done"];
  // One client of one connection per group in flight (porsager's `reserve()` of a second connection
  // hangs under Bun here).
  const slots = Array.from({ length: groups }, () => postgres(pgUrl(cfg.ns), { max: 1, fetch_types: false, onnotice: () => {} }));
  const batcher = new TurnBatcher<ProtocolWrite>(async (batch: Write<ProtocolWrite>[], slot) => {
    const by = new Map<ProtocolWrite, Record<string, unknown>[]>();
    for (const w of batch) (by.get(w.kind) ?? by.set(w.kind, []).get(w.kind)!).push(w.row);
    const statements = ORDER.filter((k) => by.has(k)).map((k) => ({ k, rows: by.get(k)! }));
    const c = slots[slot]!;
    const run = (k: ProtocolWrite, rows: Record<string, unknown>[]) => c.unsafe(text[k], [JSON.stringify(rows)], { prepare: true });
    let results;
    if (batch.length === 1) results = [await run(statements[0]!.k, statements[0]!.rows)];
    else {
      const begin = c.unsafe("BEGIN");
      const pending = statements.map((st) => run(st.k, st.rows));
      const commit = c.unsafe("COMMIT");
      [, results] = await Promise.all([begin, Promise.all(pending), commit]);
    }
    statements.forEach((st, i) => {
      if (results[i]!.count !== st.rows.length) throw new Error(`ceiling ${st.k}: ${results[i]!.count} of ${st.rows.length} rows written`);
    });
  }, groups);

  const { total, result } = await protocolLoop(cfg, batcher, {
    admit: (m) => {
      const now = Date.now();
      return { id: m.id, chat_id: m.chat, payload: { id: m.id, chatId: m.chat, type: "text", text: m.id }, at: now, token: m.token, until: now + 30_000 };
    },
    reserve: (m) => {
      const now = Date.now();
      return { key: m.key, chat_id: m.chat, inbound_id: m.id, content: { text: `r:${m.id}` }, at: now, token: m.outToken, until: now + 30_000 };
    },
    sent: (m, receipt) => ({ key: m.key, token: m.outToken, receipt, at: Date.now() }),
    done: (m) => ({ id: m.id, token: m.token, at: Date.now() }),
  });
  const [counts] = await sql.unsafe(`SELECT (SELECT count(*) FILTER (WHERE state = 'done') FROM ${s}.inbox)::int AS done,
    (SELECT count(*) FROM ${s}.inbox)::int AS inbound, (SELECT count(*) FILTER (WHERE state = 'sent') FROM ${s}.outbox)::int AS sent,
    (SELECT count(*) FROM ${s}.outbox)::int AS outbound`);
  if (counts!.done !== total || counts!.inbound !== total || counts!.sent !== total || counts!.outbound !== total) {
    throw new Error(`ceiling tables hold ${JSON.stringify(counts)} for ${total} messages`);
  }
  for (const c of slots) await c.end({ timeout: 5 });
  await sql.end({ timeout: 5 });
  return { ...result, note: `${groups} group(s) in flight; ${(batcher.writes / batcher.batches).toFixed(1)} writes per group` };
});
