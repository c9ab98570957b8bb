/**
 * Checks of records read back from a file (snapshots, logs): every field of
 * an inbox record or outbox entry, with a message naming the first bad one.
 *
 * @module
 */
import type { InboundRecord, JsonValue, OutboxEntry } from "./contract.ts";
import { INBOX, INBOX_STATES, OUTBOX, OUTBOX_STATES } from "./machine.ts";
import { MAX_STORED_DEPTH, nestsDeeperThan } from "./content.ts";
import { showValue as show } from "./show.ts";

/**
 * What kind of JSON value `value` is, for messages (`an array`, `string "x"`).
 *
 * @param value a parsed JSON value
 * @returns a short description
 */
export function describeJsonKind(value: unknown): string {
  if (value === null) return "null";
  if (Array.isArray(value)) return "an array";
  return typeof value === "object" ? "an object" : `${typeof value} ${show(value)}`;
}

type FieldCheck = (value: unknown) => string | null;

const str: FieldCheck = (v) => typeof v === "string" ? null : "a string";
const strOrNull: FieldCheck = (v) => v === null || typeof v === "string" ? null : "a string or null";
const time: FieldCheck = (v) => typeof v === "number" && Number.isFinite(v) ? null : "a finite number";
const timeOrNull: FieldCheck = (v) => v === null || (typeof v === "number" && Number.isFinite(v)) ? null : "a finite number or null";
const count: FieldCheck = (v) => Number.isSafeInteger(v) && (v as number) >= 0 ? null : "a non-negative integer";
const positive: FieldCheck = (v) => Number.isSafeInteger(v) && (v as number) > 0 ? null : "a positive integer";
const boolOrMissing: FieldCheck = (v) => v === undefined || typeof v === "boolean" ? null : "a boolean";
const json: FieldCheck = (v) =>
  v === undefined
    ? "a JSON value"
    : nestsDeeperThan(v, MAX_STORED_DEPTH)
    ? `a JSON value nested at most ${MAX_STORED_DEPTH} levels deep (MAX_STORED_DEPTH)`
    : null;
const oneOf = (values: readonly string[]): FieldCheck => (v) =>
  typeof v === "string" && values.includes(v) ? null : `one of ${values.join(", ")}`;
const lease: FieldCheck = (v) => {
  if (v === null) return null;
  if (typeof v !== "object" || Array.isArray(v)) return "null or a lease object";
  const l = v as Record<string, unknown>;
  for (const [name, check] of [["owner", str], ["incarnation", str], ["token", positive], ["expiresAt", time]] as const) {
    if (check(l[name]) !== null) return `a lease whose "${name}" is ${check(l[name])} (got ${show(l[name])})`;
  }
  return null;
};

const INBOUND_FIELDS: readonly (readonly [string, FieldCheck])[] = [
  ["id", str],
  ["kind", oneOf(["message", "interaction"])],
  ["chatId", str],
  ["provider", str],
  ["payload", json],
  ["receivedAt", time],
  ["state", oneOf(INBOX_STATES)],
  ["attempts", count],
  ["nextAttemptAt", timeOrNull],
  ["lease", lease],
  ["fence", count],
  ["error", strOrNull],
  ["updatedAt", time],
];

const OUTBOUND_FIELDS: readonly (readonly [string, FieldCheck])[] = [
  ["key", str],
  ["chatId", str],
  ["content", json],
  ["contentHash", str],
  ["inboundId", strOrNull],
  ["state", oneOf(OUTBOX_STATES)],
  ["attempts", count],
  ["nextAttemptAt", timeOrNull],
  ["lease", lease],
  ["fence", count],
  // Missing in entries written before the call marker existed: read as `true` (see storedCalled).
  ["called", boolOrMissing],
  ["messageId", strOrNull],
  ["error", strOrNull],
  ["seq", positive],
  ["createdAt", time],
  ["updatedAt", time],
];

/** {@link show} of a field's value, except one nested too deep to print (JSON.stringify would overflow the stack, or take seconds). */
const shown = (value: unknown): string =>
  nestsDeeperThan(value, MAX_STORED_DEPTH) ? `${describeJsonKind(value)} nested deeper` : show(value);

function checkFields(value: unknown, fields: readonly (readonly [string, FieldCheck])[]): string | null {
  if (typeof value !== "object" || value === null || Array.isArray(value)) return `expected an object, got ${describeJsonKind(value)}`;
  const record = value as Record<string, unknown>;
  for (const [name, check] of fields) {
    const expected = check(record[name]);
    if (expected !== null) {
      return name in record
        ? `field "${name}" must be ${expected}, got ${shown(record[name])}`
        : `field "${name}" is missing (must be ${expected})`;
    }
  }
  return null;
}

/**
 * What is wrong with an inbox record read back from storage, or `null`.
 *
 * @param value what was stored
 * @returns the first problem, naming the field, or `null`
 */
export function storedInboundProblem(value: unknown): string | null {
  const problem = checkFields(value, INBOUND_FIELDS);
  if (problem) return problem;
  const r = value as InboundRecord;
  if (INBOX[r.state].leased !== (r.lease !== null)) {
    return r.lease === null
      ? `field "lease" must be a lease object in state ${JSON.stringify(r.state)}, got null`
      : `field "lease" must be null in state ${JSON.stringify(r.state)}`;
  }
  if (r.lease !== null && r.lease.token > r.fence) return `field "fence" (${r.fence}) is below the lease token ${r.lease.token}`;
  return null;
}

/**
 * What is wrong with an outbox entry read back from storage, or `null`.
 *
 * @param value what was stored
 * @returns the first problem, naming the field, or `null`
 */
export function storedOutboxProblem(value: unknown): string | null {
  const problem = checkFields(value, OUTBOUND_FIELDS);
  if (problem) return problem;
  const e = value as OutboxEntry;
  if (OUTBOX[e.state].leased !== (e.lease !== null)) {
    return e.lease === null
      ? `field "lease" must be a lease object in state ${JSON.stringify(e.state)}, got null`
      : `field "lease" must be null in state ${JSON.stringify(e.state)}`;
  }
  if (e.lease !== null && e.lease.token > e.fence) return `field "fence" (${e.fence}) is below the lease token ${e.lease.token}`;
  return null;
}

/**
 * The `called` flag of an outbox entry read back from storage. An entry
 * journaled before the flag existed has none: a call may have started under
 * its lease, so it reads as `true` (a lost one stays ambiguous, as it was).
 *
 * @param value the stored flag (`undefined` or `null` when absent)
 * @returns the flag
 */
export function storedCalled(value: unknown): boolean {
  return typeof value === "boolean" ? value : true;
}

/**
 * An outbox entry as stored, with `called` filled in ({@link storedCalled})
 * when it was written before the flag existed; the entry itself (not a copy)
 * when it has the flag.
 *
 * @param entry an entry read back from storage
 * @returns the entry with a boolean `called`
 */
export function withStoredCalled(entry: OutboxEntry): OutboxEntry {
  return typeof entry.called === "boolean" ? entry : { ...entry, called: storedCalled((entry as { called?: unknown }).called) };
}

/** What is wrong with a stored row that does not read back as a record, naming the column (SQL backends). */
export class Damage {
  /**
   * @param problem what is wrong, naming the column
   */
  constructor(readonly problem: string) {}
}

/**
 * The JSON value of a text column, or the {@link Damage} naming it.
 * @param text the column's value
 * @param column the column's name, for the problem
 * @returns the parsed value, or what is wrong with it
 */
export function jsonOf(text: unknown, column: string): JsonValue | Damage {
  if (typeof text !== "string") return new Damage(`column ${column} must be JSON text, got ${describeJsonKind(text)}`);
  try {
    return JSON.parse(text) as JsonValue;
  } catch (error) {
    return new Damage(`column ${column} is not valid JSON: ${(error as Error).message}`);
  }
}
