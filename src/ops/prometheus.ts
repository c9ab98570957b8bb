/**
 * Prometheus text exposition (format 0.0.4) of a bot's durability: the 17
 * counters of `bot.durability.metrics()` and gauges of the journals (records
 * per state, age of the oldest unhandled inbound record).
 *
 * Serve the string with `content-type: text/plain; version=0.0.4; charset=utf-8`
 * ({@link PROMETHEUS_CONTENT_TYPE}).
 *
 * @example
 * ```ts ignore
 * import { prometheusMetrics, PROMETHEUS_CONTENT_TYPE } from "@botmesh/durable/ops";
 * Deno.serve({ port: 9464 }, async () =>
 *   new Response(await prometheusMetrics(bot, { labels: { bot: "support" } }), {
 *     headers: { "content-type": PROMETHEUS_CONTENT_TYPE },
 *   }));
 * ```
 *
 * @module
 */
import { checkKnownOptions } from "../options.ts";
import type { DurabilityBackend, InboundState, OutboxState } from "../contract.ts";
import type { DurabilityControl, DurabilityMetrics } from "../engine.ts";
import { showValue as show } from "../show.ts";

/** The `content-type` of the text exposition format 0.0.4. */
export const PROMETHEUS_CONTENT_TYPE: string = "text/plain; version=0.0.4; charset=utf-8";

/** Every inbound state, in lifecycle order. */
export const INBOX_STATES: readonly InboundState[] = ["pending", "processing", "failed", "done", "dead"];
/** Every outbox state, in lifecycle order. */
export const OUTBOX_STATES: readonly OutboxState[] = ["queued", "sending", "sent", "failed", "dead", "unknown"];

/** Default of {@link PrometheusOptions.countCap}. */
export const DEFAULT_COUNT_CAP = 1000;

/** What the counters are: name in `metrics()`, and its HELP text. */
const COUNTERS: ReadonlyArray<readonly [keyof DurabilityMetrics, string]> = [
  ["inboundJournaled", "Inbound records journaled."],
  ["inboundDuplicates", "Redeliveries of known inbound ids, dropped."],
  ["inboundReplayed", "Inbound records processed again after a crash, a lapsed lease or an operator replay."],
  ["inboundDead", "Inbound records moved to the inbound dead-letter queue."],
  ["outboxJournaled", "Sends journaled in the outbox."],
  ["outboxDeduped", "Sends answered from the outbox (key already journaled with the same content)."],
  ["outboxRetried", "Provider calls that retried a failed send."],
  ["outboxDeferred", "Sends journaled as queued for the worker instead of going out at once."],
  ["outboxDead", "Sends moved to the outbound dead-letter queue."],
  ["outboxAmbiguous", "Sends whose outcome is unknown (sender died mid-call, call timed out), held for an operator."],
  ["outboxResolved", "Ambiguous sends the channel settled (a delivery status or the provider's confirm)."],
  ["outboxBypassed", "Sends that bypassed the outbox (too large or not encodable)."],
  ["staleLeases", "Completions rejected because another instance had taken the record."],
  ["outboxDiverged", "Reused idempotency keys whose content differed from the journaled one."],
  ["conversationsReplayed", "Conversations rebuilt by replaying their handler over the recorded answers."],
  ["conversationsDiverged", "Conversation replays that did not follow the recorded transcript."],
  ["damagedRecords", "Damaged records the backend set aside (never deleted), reported by this bot."],
  ["outboxThrottled", "Sends that waited for the outbox's rate limiter or that the channel paused with a 429 (no attempt spent)."],
];

/** Options of {@link prometheusMetrics}. */
export interface PrometheusOptions {
  /**
   * Labels added to every series, e.g. `{ bot: "support" }`. Names match
   * `^[a-zA-Z_][a-zA-Z0-9_]*$`, do not start with `__` and are not `state`
   * (used by the gauges); values are strings.
   */
  labels?: Record<string, string>;
  /**
   * Records counted per state at most (default {@link DEFAULT_COUNT_CAP}): each
   * gauge is `list({ state, limit: countCap }).length`, so a gauge equal to the
   * cap is a lower bound. A positive integer.
   */
  countCap?: number;
  /** The clock for the age gauge, in ms since epoch (default `Date.now`). */
  now?: () => number;
}

/** Record counts per state, as counted by {@link countRecords}. */
export interface RecordCounts {
  /** Inbound records per state (at most `cap` each). */
  inbox: Record<InboundState, number>;
  /** Outbox entries per state (at most `cap` each). */
  outbox: Record<OutboxState, number>;
  /** The cap used: a count equal to it is a lower bound. */
  cap: number;
  /** `receivedAt` of the oldest `pending` or `failed` inbound record, or `null` when none. */
  oldestPendingReceivedAt: number | null;
}

/**
 * What {@link prometheusMetrics} reads: a `Bot` (its `durability`), `bot.durability`
 * itself, or a bare backend (gauges only: a backend has no counters).
 */
export type PrometheusSource =
  | { readonly durability: DurabilityControl | undefined }
  | DurabilityControl
  | DurabilityBackend;

/** Something that has a durability backend's two journals (a backend, or `bot.durability`). */
type Journals = Pick<DurabilityBackend, "inbox" | "outbox"> | Pick<DurabilityControl, "inbox" | "outbox">;

const LABEL_NAME = /^[a-zA-Z_][a-zA-Z0-9_]*$/;

/**
 * Counts the records of each state of both journals, with one
 * `list({ state, limit: cap })` per state (run concurrently).
 *
 * @param journals a backend, or `bot.durability`
 * @param cap the most records counted per state (a count equal to it is a lower bound)
 * @returns the counts and the oldest pending inbound record's `receivedAt`
 * @throws {RangeError} when `cap` is not a positive integer
 * @example
 * ```ts
 * import { MemoryDurability } from "@botmesh/durable";
 * import { countRecords } from "@botmesh/durable/ops";
 * const backend = new MemoryDurability();
 * const counts = await countRecords(backend, 10_000);
 * console.log(counts.inbox.dead, counts.outbox.dead);
 * ```
 */
export async function countRecords(journals: Journals, cap: number = DEFAULT_COUNT_CAP): Promise<RecordCounts> {
  checkCap(cap, "cap");
  const inboxCounts = Promise.all(INBOX_STATES.map((state) => journals.inbox.list({ state, limit: cap })));
  const outboxCounts = Promise.all(OUTBOX_STATES.map((state) => journals.outbox.list({ state, limit: cap })));
  const oldest = journals.inbox.list({ state: ["pending", "failed"], limit: 1 });
  const [inboxLists, outboxLists, oldestList] = await Promise.all([inboxCounts, outboxCounts, oldest]);
  const inbox = {} as Record<InboundState, number>;
  INBOX_STATES.forEach((state, i) => (inbox[state] = inboxLists[i]!.length));
  const outbox = {} as Record<OutboxState, number>;
  OUTBOX_STATES.forEach((state, i) => (outbox[state] = outboxLists[i]!.length));
  return { inbox, outbox, cap, oldestPendingReceivedAt: oldestList[0]?.receivedAt ?? null };
}

/**
 * The Prometheus text exposition (format 0.0.4) of a bot's durability:
 *
 * - `botmesh_durable_<counter>_total` (counter): the 18 counters of
 *   `bot.durability.metrics()`, e.g. `botmesh_durable_inbound_duplicates_total`;
 * - `botmesh_durable_outbox_waiting_for_limit` (gauge): sends waiting for the
 *   outbox's rate limiter now (with the counters: a bot only);
 * - `botmesh_durable_inbox_records{state="…"}` and
 *   `botmesh_durable_outbox_records{state="…"}` (gauges): records per state,
 *   counted up to `countCap` (a value equal to the cap is a lower bound);
 * - `botmesh_durable_oldest_pending_age_seconds` (gauge): the age of the
 *   oldest `pending` or `failed` inbound record by its `receivedAt`, 0 when none;
 * - `botmesh_durable_records_count_cap` (gauge): the cap used.
 *
 * Given a bare backend (no bot, so no counters), only the gauges are written.
 * The counters are this process's since `bot.start()`; the gauges read the
 * shared journals, so with several replicas put a `labels` value per replica
 * (or scrape the gauges from one of them only).
 *
 * @param source a `Bot` with `durability`, its `bot.durability`, or a bare `DurabilityBackend`
 * @param options `labels`, `countCap`, `now`
 * @returns the exposition text, ending with a newline
 * @throws {TypeError} when `source` is none of those (or a bot without `durability`), or an option is
 *   invalid (the message names it)
 * @throws {RangeError} when `countCap` is not a positive integer
 * @example
 * ```ts
 * import { Bot, MemoryDurability } from "@botmesh/durable";
 * import { MockProvider } from "@botmesh/durable/testing";
 * const bot = new Bot({ provider: new MockProvider(), durability: { backend: new MemoryDurability(), instanceId: "bot-1" } });
 * import { prometheusMetrics } from "@botmesh/durable/ops";
 * const text = await prometheusMetrics(bot, { labels: { bot: "support" } });
 * // # HELP botmesh_durable_inbound_journaled_total Inbound records journaled.
 * // # TYPE botmesh_durable_inbound_journaled_total counter
 * // botmesh_durable_inbound_journaled_total{bot="support"} 42
 * // …
 * ```
 */
export async function prometheusMetrics(source: PrometheusSource, options: PrometheusOptions = {}): Promise<string> {
  const { labels, cap, now } = resolveOptions(options);
  const { journals, metrics } = resolveSource(source);
  const counts = await countRecords(journals, cap);
  const base = Object.entries(labels);
  const lines: string[] = [];
  const family = (name: string, type: "counter" | "gauge", help: string): void => {
    lines.push(`# HELP ${name} ${escapeHelp(help)}`, `# TYPE ${name} ${type}`);
  };
  const sample = (name: string, value: number, extra: Array<[string, string]> = []): void => {
    const all = [...base, ...extra];
    const text = all.length === 0 ? "" : `{${all.map(([k, v]) => `${k}="${escapeLabelValue(v)}"`).join(",")}}`;
    lines.push(`${name}${text} ${formatValue(value)}`);
  };

  if (metrics) {
    const snapshot = metrics();
    for (const [key, help] of COUNTERS) {
      const name = `botmesh_durable_${snakeCase(key)}_total`;
      family(name, "counter", help);
      sample(name, snapshot[key] ?? 0);
    }
    family("botmesh_durable_outbox_waiting_for_limit", "gauge", "Sends of this process waiting for the outbox's rate limiter now.");
    sample("botmesh_durable_outbox_waiting_for_limit", snapshot.outboxWaitingForLimit ?? 0);
  }
  family(
    "botmesh_durable_inbox_records",
    "gauge",
    `Inbound records per state (counted up to ${cap}: a value equal to the cap is a lower bound).`,
  );
  for (const state of INBOX_STATES) sample("botmesh_durable_inbox_records", counts.inbox[state], [["state", state]]);
  family(
    "botmesh_durable_outbox_records",
    "gauge",
    `Outbox entries per state (counted up to ${cap}: a value equal to the cap is a lower bound).`,
  );
  for (const state of OUTBOX_STATES) sample("botmesh_durable_outbox_records", counts.outbox[state], [["state", state]]);
  family(
    "botmesh_durable_oldest_pending_age_seconds",
    "gauge",
    "Age of the oldest pending or failed inbound record (by receivedAt), 0 when there is none.",
  );
  const oldest = counts.oldestPendingReceivedAt;
  sample("botmesh_durable_oldest_pending_age_seconds", oldest === null ? 0 : Math.max(0, (now() - oldest) / 1000));
  family("botmesh_durable_records_count_cap", "gauge", "The most records counted per state by the records gauges.");
  sample("botmesh_durable_records_count_cap", cap);
  return lines.join("\n") + "\n";
}

/**
 * Escapes a label value for the text format: backslash, double quote and newline.
 *
 * @param value the raw value
 * @returns the escaped value (without the surrounding quotes)
 * @example
 * ```ts
 * escapeLabelValue('say "hi"\n'); // 'say \\"hi\\"\\n'
 * ```
 */
export function escapeLabelValue(value: string): string {
  return value.replace(/\\/g, "\\\\").replace(/"/g, '\\"').replace(/\n/g, "\\n");
}

/** HELP text escapes backslash and newline only. */
function escapeHelp(text: string): string {
  return text.replace(/\\/g, "\\\\").replace(/\n/g, "\\n");
}

function formatValue(value: number): string {
  if (Number.isNaN(value)) return "NaN";
  if (value === Infinity) return "+Inf";
  if (value === -Infinity) return "-Inf";
  return Number.isInteger(value) ? String(value) : String(Math.round(value * 1000) / 1000);
}

function snakeCase(name: string): string {
  return name.replace(/[A-Z]/g, (c) => `_${c.toLowerCase()}`);
}

function checkCap(cap: unknown, option: string): void {
  if (typeof cap !== "number" || !Number.isSafeInteger(cap) || cap < 1) {
    throw new RangeError(`Option "${option}" must be a positive integer, got ${show(cap)}`);
  }
}

function resolveOptions(options: unknown): { labels: Record<string, string>; cap: number; now: () => number } {
  if (typeof options !== "object" || options === null || Array.isArray(options)) {
    throw new TypeError(`prometheusMetrics options must be an object, got ${show(options)}`);
  }
  const o = options as Record<string, unknown>;
  checkKnownOptions(o, ["labels", "countCap", "now"]);
  const cap = o.countCap === undefined ? DEFAULT_COUNT_CAP : o.countCap;
  checkCap(cap, "countCap");
  if (o.now !== undefined && typeof o.now !== "function") {
    throw new TypeError(`Option "now" must be a function returning ms since epoch, got ${show(o.now)}`);
  }
  const labels: Record<string, string> = {};
  if (o.labels !== undefined) {
    if (typeof o.labels !== "object" || o.labels === null || Array.isArray(o.labels)) {
      throw new TypeError(`Option "labels" must be an object of label names to strings, got ${show(o.labels)}`);
    }
    for (const [name, value] of Object.entries(o.labels)) {
      if (!LABEL_NAME.test(name) || name.startsWith("__")) {
        throw new TypeError(
          `Option "labels" has an invalid label name ${show(name)}: it must match ^[a-zA-Z_][a-zA-Z0-9_]*$ and not start with "__"`,
        );
      }
      if (name === "state") {
        throw new TypeError(`Option "labels" must not set "state": the records gauges use that label`);
      }
      if (typeof value !== "string") {
        throw new TypeError(`Option "labels.${name}" must be a string, got ${show(value)}`);
      }
      labels[name] = value;
    }
  }
  return { labels, cap: cap as number, now: (o.now as (() => number) | undefined) ?? Date.now };
}

function hasJournals(value: unknown): value is Journals {
  if (typeof value !== "object" || value === null) return false;
  const v = value as { inbox?: { list?: unknown }; outbox?: { list?: unknown } };
  return typeof v.inbox?.list === "function" && typeof v.outbox?.list === "function";
}

function resolveSource(source: unknown): { journals: Journals; metrics: (() => DurabilityMetrics) | null } {
  if (typeof source === "object" && source !== null && "durability" in source && !hasJournals(source)) {
    const control = (source as { durability: unknown }).durability;
    if (control === undefined || control === null) {
      throw new TypeError("prometheusMetrics got a bot without durability: configure `durability` on the Bot");
    }
    return resolveSource(control);
  }
  if (hasJournals(source)) {
    const metrics = (source as { metrics?: unknown }).metrics;
    return {
      journals: source,
      metrics: typeof metrics === "function" ? () => (metrics as () => DurabilityMetrics).call(source) : null,
    };
  }
  throw new TypeError(
    `prometheusMetrics needs a Bot with durability, bot.durability or a durability backend, got ${show(source)}`,
  );
}
