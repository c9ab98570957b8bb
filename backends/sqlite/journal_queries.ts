/**
 * The queries both journals run alike: lists in their order, and purges in
 * steps of a bounded size.
 *
 * @module
 */
import type { ListOptions } from "../../src/contract.ts";
import { checkFinite, normalizeList } from "../../src/rules.ts";
import type { Connection, Gate } from "./connection.ts";
import { num, placeholders, type Row } from "./rows.ts";

/** Rows deleted per transaction by a purge. */
export const PURGE_BATCH: number = 1000;

/**
 * Runs a list: at most `limit` rows in `order` (`"received_at, ord"` or
 * `"seq"`), each query reading O(limit) index entries:
 * - no filter: the table in order (`byOrder`, an index on the order);
 * - a chat: that chat's rows in order (`byChat`, on the chat and the order),
 *   other states skipped;
 * - states only: one query per state on `byState` (the state, then the
 *   order), merged, so that no query sorts every row of its states.
 */
export function listRows(
  c: Connection,
  table: string,
  columns: string,
  order: "received_at, ord" | "seq",
  indexes: { byOrder: string | null; byChat: string; byState: string },
  options: ListOptions<string> | undefined,
): Row[] {
  const { states, chatId, limit } = normalizeList(options);
  if (limit === 0 || (states !== null && states.size === 0)) return [];
  // Rows set aside as damaged are left out.
  const from = (index: string | null) =>
    `SELECT ${columns} FROM ${table}${index ? ` INDEXED BY ${index}` : ""} WHERE set_aside_seq IS NULL`;
  if (chatId !== undefined) {
    const list = states === null ? [] : [...states];
    const where = list.length ? ` AND state IN (${placeholders(list.length)})` : "";
    return c.stmt(`${from(indexes.byChat)} AND chat_id = ?${where} ORDER BY ${order} LIMIT ?`)
      .all(chatId, ...list, limit);
  }
  if (states === null) return c.stmt(`${from(indexes.byOrder)} ORDER BY ${order} LIMIT ?`).all(limit);
  const statement = c.stmt(`${from(indexes.byState)} AND state = ? ORDER BY ${order} LIMIT ?`);
  if (states.size === 1) return statement.all([...states][0], limit);
  const rows = [...states].flatMap((state) => statement.all(state, limit));
  rows.sort(order === "seq"
    ? (a, b) => num(a.seq) - num(b.seq)
    : (a, b) => num(a.received_at) - num(b.received_at) || num(a.ord) - num(b.ord));
  return rows.slice(0, limit);
}

/**
 * Deletes what `sql` picks (its one parameter is the cutoff time), at most
 * {@link PURGE_BATCH} rows per step. Each step is one write operation (of a
 * group commit) and is queued only once the previous one has committed, so
 * that a large purge never holds the write lock for long (other processes
 * would run into their busy timeout) nor blocks this one's event loop.
 */
export async function purgeInBatches(gate: Gate, olderThanMs: number, sql: string): Promise<number> {
  checkFinite(olderThanMs, `purge: "olderThanMs"`);
  let cutoff: number | undefined;
  let total = 0;
  for (;;) {
    const c = await gate.ready();
    const n = await c.write((now) => c.stmt(sql).run(cutoff ??= now - olderThanMs).changes);
    total += n;
    if (n < PURGE_BATCH) return total;
  }
}
