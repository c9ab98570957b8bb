/**
 * Stored hashes read back as records: the fields of an inbox record or an
 * outbox entry decoded and checked, an error naming the key and the field
 * when one is damaged.
 *
 * @module
 */
import { errorMessage } from "../../src/errors.ts";
import type { InboundRecord, JsonValue, OutboxEntry } from "../../src/contract.ts";
import { showValue as show } from "../../src/show.ts";
import { storedCalled, storedInboundProblem, storedOutboxProblem } from "../../src/stored_records.ts";
import { list, type Runner } from "./runner.ts";

/** An `HGETALL` array as a map, or `null` when empty. */
export function fieldsOf(flat: unknown): Map<string, string> | null {
  const items = list(flat);
  if (items.length === 0) return null;
  const m = new Map<string, string>();
  for (let i = 0; i + 1 < items.length; i += 2) m.set(String(items[i]), String(items[i + 1]));
  return m;
}

/** A number field: the number, the raw text when it is not one (so the check quotes it), `undefined` when absent. */
function numField(m: Map<string, string>, field: string): number | string | undefined {
  const raw = m.get(field);
  if (raw === undefined) return undefined;
  const n = Number(raw);
  return raw.trim() !== "" && Number.isFinite(n) ? n : raw;
}

function optNum(m: Map<string, string>, field: string): number | string | null {
  return m.has(field) ? numField(m, field)! : null;
}

function jsonField(m: Map<string, string>, field: string, what: string): JsonValue | undefined {
  const raw = m.get(field);
  if (raw === undefined) return undefined;
  try {
    return JSON.parse(raw) as JsonValue;
  } catch (error) {
    throw new Error(`${what}: field "${field}" is not JSON (${errorMessage(error)}): ${show(raw.slice(0, 80))}`);
  }
}

/**
 * The `called` field as the record check wants it: a boolean for `1`/`0`, `undefined` when absent
 * (an entry written before the field existed: {@link storedCalled} reads it as `true`), else the raw
 * text, so that the check quotes it.
 */
function calledField(m: Map<string, string>): boolean | string | undefined {
  const raw = m.get("called");
  return raw === "1" ? true : raw === "0" ? false : raw;
}

function leaseOf(m: Map<string, string>): unknown {
  if (!m.has("leaseOwner")) return null;
  return {
    owner: m.get("leaseOwner"),
    incarnation: m.get("leaseInc"),
    token: numField(m, "leaseToken"),
    expiresAt: numField(m, "leaseExp"),
  };
}

export function inboundOf(flat: unknown, runner: Runner, id: string): InboundRecord | null {
  const m = fieldsOf(flat);
  if (!m) return null;
  const what = `Redis inbox record at key ${JSON.stringify(`${runner.tag}in:r:${m.get("id") ?? id}`)}`;
  const record = {
    id: m.get("id"),
    kind: m.get("kind"),
    chatId: m.get("chatId"),
    provider: m.get("provider"),
    payload: jsonField(m, "payload", what),
    receivedAt: numField(m, "receivedAt"),
    state: m.get("state"),
    attempts: numField(m, "attempts"),
    nextAttemptAt: optNum(m, "nextAttemptAt"),
    lease: leaseOf(m),
    fence: numField(m, "fence"),
    error: m.get("error") ?? null,
    updatedAt: numField(m, "updatedAt"),
  };
  const problem = storedInboundProblem(record);
  if (problem) throw new Error(`${what}: ${problem}`);
  return record as InboundRecord;
}

export function outboxOf(flat: unknown, runner: Runner, key: string): OutboxEntry | null {
  const m = fieldsOf(flat);
  if (!m) return null;
  const what = `Redis outbox entry at key ${JSON.stringify(`${runner.tag}out:r:${m.get("key") ?? key}`)}`;
  const entry = {
    key: m.get("key"),
    chatId: m.get("chatId"),
    content: jsonField(m, "content", what),
    contentHash: m.get("contentHash"),
    inboundId: m.get("inboundId") ?? null,
    state: m.get("state"),
    attempts: numField(m, "attempts"),
    nextAttemptAt: optNum(m, "nextAttemptAt"),
    lease: leaseOf(m),
    fence: numField(m, "fence"),
    called: calledField(m),
    messageId: m.get("messageId") ?? null,
    error: m.get("error") ?? null,
    seq: numField(m, "seq"),
    createdAt: numField(m, "createdAt"),
    updatedAt: numField(m, "updatedAt"),
  };
  const problem = storedOutboxProblem(entry);
  if (problem) throw new Error(`${what}: ${problem}`);
  entry.called = storedCalled(entry.called);
  return entry as OutboxEntry;
}
