/**
 * Prometheus text exposition (format 0.0.4) of a bot's durability: the
 * counters of `bot.durability.metrics()`, the duration histograms of
 * `bot.durability.histograms()` and gauges of the journals (records per
 * state, age of the oldest record per state).
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
import { INBOX, INBOX_STATES as INBOX_TABLE_STATES, OUTBOX, OUTBOX_STATES as OUTBOX_TABLE_STATES, statesWhere } from "../machine.ts";
import type { DurabilityControl, DurabilityMetrics } from "../engine.ts";
import type { DurabilityHistograms, HistogramSnapshot } from "../histogram.ts";
import { showValue as show } from "../show.ts";

/** The `content-type` of the text exposition format 0.0.4. */
export const PROMETHEUS_CONTENT_TYPE: string = "text/plain; version=0.0.4; charset=utf-8";

/** Every inbound state, in lifecycle order. */
export const INBOX_STATES: readonly InboundState[] = INBOX_TABLE_STATES;
/** Every outbox state, in lifecycle order. */
export const OUTBOX_STATES: readonly OutboxState[] = OUTBOX_TABLE_STATES;

/** The inbound states whose oldest record's age is a gauge (`done` only grows until purged). */
export const INBOX_AGE_STATES: readonly InboundState[] = statesWhere(INBOX, (t) => !t.purgeable);
/** The outbox states whose oldest entry's age is a gauge (`sent` only grows until purged). */
export const OUTBOX_AGE_STATES: readonly OutboxState[] = statesWhere(OUTBOX, (t) => !t.purgeable);

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
  ["outboxResolved", "Ambiguous sends settled by the channel (a delivery status, the provider's confirm) or an operator."],
  ["outboxBypassed", "Sends that bypassed the outbox (too large or not encodable)."],
  ["staleLeases", "Completions rejected because another instance had taken the record."],
  ["outboxDiverged", "Reused idempotency keys whose content differed from the journaled one."],
  ["conversationsReplayed", "Conversations rebuilt by replaying their handler over the recorded answers."],
  ["conversationsDiverged", "Conversation replays that did not follow the recorded transcript."],
  ["damagedRecords", "Damaged records the backend set aside (never deleted), reported by this bot."],
  ["outboxThrottled", "Sends that waited for the outbox's rate limiter or that the channel paused with a 429 (no attempt spent)."],
  ["stepsCalled", "Calls of a durable step's function (ctx.step), retries included."],
  ["stepsReplayed", "Durable steps answered from the journal without a call (a rerun of their message)."],
  ["stepsFailed", "Durable steps that failed for good (their error journaled)."],
];

/** What the histograms are: name in `histograms()`, metric name, and its HELP text. */
const HISTOGRAMS: ReadonlyArray<readonly [keyof DurabilityHistograms, string, string]> = [
  [
    "replyLatency",
    "botmesh_durable_reply_latency_seconds",
    "From an inbound message's receipt to each of its replies recorded as sent.",
  ],
  ["providerCall", "botmesh_durable_provider_call_seconds", "Duration of each provider call that sends, success or failure."],
  [
    "outboxQueued",
    "botmesh_durable_outbox_queued_seconds",
    "Time an outbox entry waited from its reservation to its first provider call.",
  ],
];

/** One metric family: its name, type, HELP text and samples (extra labels, value). */
interface Family {
  name: string;
  type: "counter" | "gauge" | "histogram";
  help: string;
  samples: Array<{ suffix?: string; labels?: Array<[string, string]>; value: number }>;
}

/** The gauges read from the journals, in exposition order. */
const GAUGES: ReadonlyArray<(counts: RecordCounts, now: number) => Family> = [
  (c) => ({
    name: "botmesh_durable_inbox_records",
    type: "gauge",
    help: `Inbound records per state (counted up to ${c.cap}: a value equal to the cap is a lower bound).`,
    samples: INBOX_STATES.map((state) => ({ labels: [["state", state]], value: c.inbox[state] })),
  }),
  (c) => ({
    name: "botmesh_durable_outbox_records",
    type: "gauge",
    help: `Outbox entries per state (counted up to ${c.cap}: a value equal to the cap is a lower bound).`,
    samples: OUTBOX_STATES.map((state) => ({ labels: [["state", state]], value: c.outbox[state] })),
  }),
  (c, now) => ({
    name: "botmesh_durable_inbox_oldest_age_seconds",
    type: "gauge",
    help: "Age of the oldest inbound record in each state (by receivedAt), 0 when there is none.",
    samples: INBOX_AGE_STATES.map((state) => ({ labels: [["state", state]], value: age(now, c.inboxOldest[state]) })),
  }),
  (c, now) => ({
    name: "botmesh_durable_outbox_oldest_age_seconds",
    type: "gauge",
    help: "Age of the oldest outbox entry in each state (by createdAt), 0 when there is none.",
    samples: OUTBOX_AGE_STATES.map((state) => ({ labels: [["state", state]], value: age(now, c.outboxOldest[state]) })),
  }),
  (c, now) => ({
    name: "botmesh_durable_oldest_pending_age_seconds",
    type: "gauge",
    help: "Age of the oldest pending or failed inbound record (by receivedAt), 0 when there is none.",
    samples: [{ value: age(now, c.oldestPendingReceivedAt) }],
  }),
  (c) => ({
    name: "botmesh_durable_records_count_cap",
    type: "gauge",
    help: "The most records counted per state by the records gauges.",
    samples: [{ value: c.cap }],
  }),
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
  /** `receivedAt` of the oldest inbound record of each state of {@link INBOX_AGE_STATES}, `null` when none. */
  inboxOldest: Partial<Record<InboundState, number | null>>;
  /** `createdAt` of the oldest outbox entry of each state of {@link OUTBOX_AGE_STATES}, `null` when none. */
  outboxOldest: Partial<Record<OutboxState, number | null>>;
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
 * `list({ state, limit: cap })` per state, and finds the oldest record of
 * each state of {@link INBOX_AGE_STATES} and {@link OUTBOX_AGE_STATES} with
 * `list({ state, limit: 1 })` (lists are oldest first); all run concurrently.
 *
 * @param journals a backend, or `bot.durability`
 * @param cap the most records counted per state (a count equal to it is a lower bound)
 * @returns the counts and the times of the oldest records
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
  // One list per state: its length is the count, its first record the oldest (lists are oldest first).
  const [inboxLists, outboxLists] = await Promise.all([
    Promise.all(INBOX_STATES.map((state) => journals.inbox.list({ state, limit: cap }))),
    Promise.all(OUTBOX_STATES.map((state) => journals.outbox.list({ state, limit: cap }))),
  ]);
  const inbox = {} as Record<InboundState, number>;
  const inboxFirst = {} as Record<InboundState, number | null>;
  INBOX_STATES.forEach((state, i) => {
    inbox[state] = inboxLists[i]!.length;
    inboxFirst[state] = inboxLists[i]![0]?.receivedAt ?? null;
  });
  const outbox = {} as Record<OutboxState, number>;
  const outboxFirst = {} as Record<OutboxState, number | null>;
  OUTBOX_STATES.forEach((state, i) => {
    outbox[state] = outboxLists[i]!.length;
    outboxFirst[state] = outboxLists[i]![0]?.createdAt ?? null;
  });
  const inboxOldest: RecordCounts["inboxOldest"] = {};
  for (const state of INBOX_AGE_STATES) inboxOldest[state] = inboxFirst[state];
  const outboxOldest: RecordCounts["outboxOldest"] = {};
  for (const state of OUTBOX_AGE_STATES) outboxOldest[state] = outboxFirst[state];
  const waiting = [inboxFirst.pending, inboxFirst.failed].filter((t): t is number => t !== null);
  const oldestPendingReceivedAt = waiting.length === 0 ? null : Math.min(...waiting);
  return { inbox, outbox, cap, oldestPendingReceivedAt, inboxOldest, outboxOldest };
}

/**
 * The Prometheus text exposition (format 0.0.4) of a bot's durability:
 *
 * - `botmesh_durable_<counter>_total` (counter): every counter of
 *   `bot.durability.metrics()` in snake case, e.g. `botmesh_durable_inbound_duplicates_total`;
 * - `botmesh_durable_reply_latency_seconds`, `botmesh_durable_provider_call_seconds` and
 *   `botmesh_durable_outbox_queued_seconds` (histograms, buckets from 5 ms to 10 min): the
 *   durations of `bot.durability.histograms()`;
 * - `botmesh_durable_outbox_waiting_for_limit` (gauge): sends waiting for the
 *   outbox's rate limiter now (with the counters: a bot only);
 * - `botmesh_durable_inbox_records{state="…"}` and
 *   `botmesh_durable_outbox_records{state="…"}` (gauges): records per state,
 *   counted up to `countCap` (a value equal to the cap is a lower bound);
 * - `botmesh_durable_inbox_oldest_age_seconds{state="…"}` and
 *   `botmesh_durable_outbox_oldest_age_seconds{state="…"}` (gauges): the age of the oldest
 *   record of each unsettled state and `dead` (by `receivedAt`, `createdAt`), 0 when none;
 * - `botmesh_durable_oldest_pending_age_seconds` (gauge): the age of the
 *   oldest `pending` or `failed` inbound record by its `receivedAt`, 0 when none;
 * - `botmesh_durable_records_count_cap` (gauge): the cap used.
 *
 * Given a bare backend (no bot, so no counters), only the gauges are written.
 * The counters and histograms are this process's since `bot.start()`; the gauges read the
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
  const { journals, metrics, histograms } = resolveSource(source);
  const counts = await countRecords(journals, cap);
  const families: Family[] = [];
  if (metrics) {
    const snapshot = metrics();
    for (const [key, help] of COUNTERS) {
      families.push({ name: `botmesh_durable_${snakeCase(key)}_total`, type: "counter", help, samples: [{ value: snapshot[key] ?? 0 }] });
    }
    families.push({
      name: "botmesh_durable_outbox_waiting_for_limit",
      type: "gauge",
      help: "Sends of this process waiting for the outbox's rate limiter now.",
      samples: [{ value: snapshot.outboxWaitingForLimit ?? 0 }],
    });
  }
  if (histograms) {
    const snapshot = histograms();
    for (const [key, name, help] of HISTOGRAMS) families.push(histogramFamily(name, help, snapshot[key]));
  }
  const at = now();
  for (const gauge of GAUGES) families.push(gauge(counts, at));
  return render(families, Object.entries(labels));
}

/** The samples of a histogram: cumulative `_bucket{le}` up to `+Inf`, then `_sum` and `_count`. */
function histogramFamily(name: string, help: string, h: HistogramSnapshot): Family {
  const samples: Family["samples"] = h.bounds.map((bound, i) => ({
    suffix: "_bucket",
    labels: [["le", formatValue(bound)]],
    value: h.cumulative[i]!,
  }));
  samples.push({ suffix: "_bucket", labels: [["le", "+Inf"]], value: h.count });
  samples.push({ suffix: "_sum", value: h.sum }, { suffix: "_count", value: h.count });
  return { name, type: "histogram", help, samples };
}

function render(families: readonly Family[], base: Array<[string, string]>): string {
  const lines: string[] = [];
  for (const f of families) {
    lines.push(`# HELP ${f.name} ${escapeHelp(f.help)}`, `# TYPE ${f.name} ${f.type}`);
    for (const s of f.samples) {
      const all = s.labels === undefined ? base : [...base, ...s.labels];
      const text = all.length === 0 ? "" : `{${all.map(([k, v]) => `${k}="${escapeLabelValue(v)}"`).join(",")}}`;
      lines.push(`${f.name}${s.suffix ?? ""}${text} ${formatValue(s.value)}`);
    }
  }
  return lines.join("\n") + "\n";
}

function age(now: number, since: number | null | undefined): number {
  return since === null || since === undefined ? 0 : Math.max(0, (now - since) / 1000);
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
      if (name === "state" || name === "le") {
        throw new TypeError(
          `Option "labels" must not set ${show(name)}: the gauges use "state" and the histograms "le"`,
        );
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

interface Resolved {
  journals: Journals;
  metrics: (() => DurabilityMetrics) | null;
  histograms: (() => DurabilityHistograms) | null;
}

function resolveSource(source: unknown): Resolved {
  if (typeof source === "object" && source !== null && "durability" in source && !hasJournals(source)) {
    const control = (source as { durability: unknown }).durability;
    if (control === undefined || control === null) {
      throw new TypeError("prometheusMetrics got a bot without durability: configure `durability` on the Bot");
    }
    return resolveSource(control);
  }
  if (hasJournals(source)) {
    const { metrics, histograms } = source as { metrics?: unknown; histograms?: unknown };
    return {
      journals: source,
      metrics: typeof metrics === "function" ? () => (metrics as () => DurabilityMetrics).call(source) : null,
      histograms: typeof histograms === "function" ? () => (histograms as () => DurabilityHistograms).call(source) : null,
    };
  }
  throw new TypeError(
    `prometheusMetrics needs a Bot with durability, bot.durability or a durability backend, got ${show(source)}`,
  );
}
