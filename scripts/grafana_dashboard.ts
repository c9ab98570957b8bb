// The Grafana dashboard of docs/grafana/botmesh-durable.json, generated here: `bun scripts/grafana_dashboard.ts`
// prints it, `--write` writes the file. tests/grafana_dashboard.test.ts checks the file is what this makes, that
// every query names only series the exporter (src/ops/prometheus.ts) writes, and that the JSON is one Grafana imports.
import { writeFileSync } from "node:fs";
import { join } from "node:path";

export const DASHBOARD_FILE: string = join(import.meta.dir, "..", "docs", "grafana", "botmesh-durable.json");

/** The series selector of every query: the job and instance picked at the top of the dashboard. */
const SEL = 'job=~"$job", instance=~"$instance"';
const DS = { type: "prometheus", uid: "${datasource}" } as const;
const P = "botmesh_durable_";

type Json = null | boolean | number | string | Json[] | { [key: string]: Json };
interface Target {
  expr: string;
  legend: string;
  format?: "time_series" | "heatmap";
}
interface PanelSpec {
  type: "stat" | "timeseries" | "heatmap";
  title: string;
  description: string;
  targets: Target[];
  unit: string;
  w: number;
  h: number;
  /** Thresholds: green below the first step, then each [value, color]. */
  steps?: Array<[number, string]>;
  stack?: boolean;
  decimals?: number;
}

/** `sum(rate(<counter>[$__rate_interval]))`: the per-second rate of a counter over the selected processes. */
const rate = (counter: string) => `sum(rate(${P}${counter}_total{${SEL}}[$__rate_interval]))`;
/** A journal gauge: the same in every replica of a bot (they read the same journals), so the largest one. */
const journal = (gauge: string, filter = "") => `max by (state) (${P}${gauge}{${SEL}${filter}})`;
const quantile = (histogram: string, q: number) =>
  `histogram_quantile(${q}, sum by (le) (rate(${P}${histogram}_bucket{${SEL}}[$__rate_interval])))`;
const mean = (histogram: string) =>
  `sum(rate(${P}${histogram}_sum{${SEL}}[$__rate_interval])) / sum(rate(${P}${histogram}_count{${SEL}}[$__rate_interval]))`;
const quantiles = (histogram: string): Target[] => [
  { expr: quantile(histogram, 0.5), legend: "p50" },
  { expr: quantile(histogram, 0.9), legend: "p90" },
  { expr: quantile(histogram, 0.99), legend: "p99" },
  { expr: mean(histogram), legend: "mean" },
];

const ROWS: Array<{ title: string; panels: PanelSpec[] }> = [
  {
    title: "Overview",
    panels: [
      {
        type: "stat",
        title: "Inbound messages",
        description: "Inbound records journaled per second, all selected processes.",
        targets: [{ expr: rate("inbound_journaled"), legend: "journaled" }],
        unit: "reqps",
        w: 3,
        h: 4,
      },
      {
        type: "stat",
        title: "Sends",
        description: "Sends journaled in the outbox per second, all selected processes.",
        targets: [{ expr: rate("outbox_journaled"), legend: "journaled" }],
        unit: "reqps",
        w: 3,
        h: 4,
      },
      {
        type: "stat",
        title: "Inbound dead letters",
        description: "Inbound records in the dead-letter queue now (replay or discard them in the console).",
        targets: [{ expr: `max(${P}inbox_records{${SEL}, state="dead"})`, legend: "dead" }],
        unit: "none",
        w: 3,
        h: 4,
        steps: [[1, "red"]],
      },
      {
        type: "stat",
        title: "Outbound dead letters",
        description: "Sends in the outbound dead-letter queue now (retry or discard them in the console).",
        targets: [{ expr: `max(${P}outbox_records{${SEL}, state="dead"})`, legend: "dead" }],
        unit: "none",
        w: 3,
        h: 4,
        steps: [[1, "red"]],
      },
      {
        type: "stat",
        title: "Sends of unknown outcome",
        description:
          "Sends whose outcome is unknown (the sender died mid-call, the call timed out), held for an operator: " +
          "check the chat, then mark delivered or retry.",
        targets: [{ expr: `max(${P}outbox_records{${SEL}, state="unknown"})`, legend: "unknown" }],
        unit: "none",
        w: 3,
        h: 4,
        steps: [[1, "orange"]],
      },
      {
        type: "stat",
        title: "Oldest waiting message",
        description: "Age of the oldest pending or failed inbound record: messages wait when the bot is down or stuck.",
        targets: [{ expr: `max(${P}oldest_pending_age_seconds{${SEL}})`, legend: "age" }],
        unit: "s",
        w: 3,
        h: 4,
        steps: [[60, "yellow"], [300, "red"]],
      },
      {
        type: "stat",
        title: "Reply latency p99",
        description: "99th percentile from a message's receipt to each of its replies recorded as sent.",
        targets: [{ expr: quantile("reply_latency_seconds", 0.99), legend: "p99" }],
        unit: "s",
        w: 3,
        h: 4,
        steps: [[5, "yellow"], [30, "red"]],
        decimals: 2,
      },
      {
        type: "stat",
        title: "Damaged records (1 h)",
        description: "Records the backend could not read back and set aside (kept, never deleted) in the last hour.",
        targets: [{ expr: `sum(increase(${P}damaged_records_total{${SEL}}[1h]))`, legend: "damaged" }],
        unit: "none",
        w: 3,
        h: 4,
        steps: [[1, "red"]],
        decimals: 0,
      },
    ],
  },
  {
    title: "Inbox",
    panels: [
      {
        type: "timeseries",
        title: "Inbound rate",
        description: "Per second: journaled, redeliveries dropped as duplicates, processed again (crash, lapsed lease, replay), dead-lettered.",
        targets: [
          { expr: rate("inbound_journaled"), legend: "journaled" },
          { expr: rate("inbound_duplicates"), legend: "duplicates" },
          { expr: rate("inbound_replayed"), legend: "replayed" },
          { expr: rate("inbound_dead"), legend: "dead-lettered" },
        ],
        unit: "reqps",
        w: 8,
        h: 8,
      },
      {
        type: "timeseries",
        title: "Inbound records per state",
        description:
          "Records per state (done left out: it only grows until purged). Counted up to the count cap: a line at the cap is a lower bound.",
        targets: [{ expr: journal("inbox_records", ', state!="done"'), legend: "{{state}}" }],
        unit: "none",
        w: 8,
        h: 8,
      },
      {
        type: "timeseries",
        title: "Oldest inbound record per state",
        description:
          "Age of the oldest record in each state (0: none). pending or failed growing: messages wait; scheduled beyond your longest ask timeout: nothing sweeps the journal.",
        targets: [{ expr: journal("inbox_oldest_age_seconds"), legend: "{{state}}" }],
        unit: "s",
        w: 8,
        h: 8,
      },
    ],
  },
  {
    title: "Outbox",
    panels: [
      {
        type: "timeseries",
        title: "Outbox rate",
        description:
          "Per second: journaled, answered from the outbox (same key and content), retried calls, deferred to the worker, dead-lettered, bypassed (too large or not data).",
        targets: [
          { expr: rate("outbox_journaled"), legend: "journaled" },
          { expr: rate("outbox_deduped"), legend: "deduped" },
          { expr: rate("outbox_retried"), legend: "retried" },
          { expr: rate("outbox_deferred"), legend: "deferred" },
          { expr: rate("outbox_dead"), legend: "dead-lettered" },
          { expr: rate("outbox_bypassed"), legend: "bypassed" },
        ],
        unit: "reqps",
        w: 8,
        h: 8,
      },
      {
        type: "timeseries",
        title: "Outbox entries per state",
        description: "Entries per state (sent left out: it only grows until purged), counted up to the count cap.",
        targets: [{ expr: journal("outbox_records", ', state!="sent"'), legend: "{{state}}" }],
        unit: "none",
        w: 8,
        h: 8,
      },
      {
        type: "timeseries",
        title: "Oldest outbox entry per state",
        description: "Age of the oldest entry in each state (0: none). queued growing: replies wait (the worker is down, or a rate limit holds them).",
        targets: [{ expr: journal("outbox_oldest_age_seconds"), legend: "{{state}}" }],
        unit: "s",
        w: 8,
        h: 8,
      },
    ],
  },
  {
    title: "Dead letters and ambiguous sends",
    panels: [
      {
        type: "timeseries",
        title: "Dead letters",
        description: "Records in both dead-letter queues now, and how many moved there per interval.",
        targets: [
          { expr: `max(${P}inbox_records{${SEL}, state="dead"})`, legend: "inbound DLQ" },
          { expr: `max(${P}outbox_records{${SEL}, state="dead"})`, legend: "outbound DLQ" },
          { expr: `sum(increase(${P}inbound_dead_total{${SEL}}[$__rate_interval]))`, legend: "inbound dead-lettered" },
          { expr: `sum(increase(${P}outbox_dead_total{${SEL}}[$__rate_interval]))`, legend: "outbound dead-lettered" },
        ],
        unit: "none",
        w: 8,
        h: 8,
      },
      {
        type: "timeseries",
        title: "Ambiguous sends",
        description:
          "Sends that became of unknown outcome and that were settled (by a delivery status, the provider's confirm or an operator) per interval, and those held now.",
        targets: [
          { expr: `sum(increase(${P}outbox_ambiguous_total{${SEL}}[$__rate_interval]))`, legend: "became unknown" },
          { expr: `sum(increase(${P}outbox_resolved_total{${SEL}}[$__rate_interval]))`, legend: "resolved" },
          { expr: `max(${P}outbox_records{${SEL}, state="unknown"})`, legend: "held now" },
        ],
        unit: "none",
        w: 8,
        h: 8,
      },
      {
        type: "timeseries",
        title: "Oldest dead letter and unknown send",
        description: "Age of the oldest record of each DLQ and of the oldest send of unknown outcome: how long an operator has let them wait.",
        targets: [
          { expr: `max(${P}inbox_oldest_age_seconds{${SEL}, state="dead"})`, legend: "inbound dead" },
          { expr: `max(${P}outbox_oldest_age_seconds{${SEL}, state="dead"})`, legend: "outbound dead" },
          { expr: `max(${P}outbox_oldest_age_seconds{${SEL}, state="unknown"})`, legend: "unknown" },
        ],
        unit: "s",
        w: 8,
        h: 8,
      },
    ],
  },
  {
    title: "Latency",
    panels: [
      {
        type: "timeseries",
        title: "Reply latency",
        description: "From an inbound message's receipt to each of its replies recorded as sent: quantiles from the histogram's buckets, and the mean.",
        targets: quantiles("reply_latency_seconds"),
        unit: "s",
        w: 8,
        h: 8,
      },
      {
        type: "timeseries",
        title: "Provider call duration",
        description: "Each provider call that sends (journaled, bypassed or direct), success or failure.",
        targets: quantiles("provider_call_seconds"),
        unit: "s",
        w: 8,
        h: 8,
      },
      {
        type: "timeseries",
        title: "Time queued in the outbox",
        description: "From an entry's reservation to its first provider call: behind the chat's earlier sends, for the worker, or for the rate limiter.",
        targets: quantiles("outbox_queued_seconds"),
        unit: "s",
        w: 8,
        h: 8,
      },
      {
        type: "heatmap",
        title: "Reply latency distribution",
        description: "Replies per latency bucket per interval (the histogram's buckets, 5 ms to 10 min).",
        targets: [{
          expr: `sum by (le) (increase(${P}reply_latency_seconds_bucket{${SEL}}[$__rate_interval]))`,
          legend: "{{le}}",
          format: "heatmap",
        }],
        unit: "s",
        w: 24,
        h: 8,
      },
    ],
  },
  {
    title: "Rate limits",
    panels: [
      {
        type: "timeseries",
        title: "Throttled sends",
        description: "Sends per second that waited for the outbox's rate limiter or that the channel paused with a 429 (no attempt spent).",
        targets: [{ expr: rate("outbox_throttled"), legend: "throttled" }],
        unit: "reqps",
        w: 8,
        h: 8,
      },
      {
        type: "timeseries",
        title: "Waiting for the rate limiter",
        description: "Sends waiting for the outbox's rate limiter now, per process.",
        targets: [{ expr: `sum by (instance) (${P}outbox_waiting_for_limit{${SEL}})`, legend: "{{instance}}" }],
        unit: "none",
        w: 8,
        h: 8,
      },
      {
        type: "timeseries",
        title: "Time queued in the outbox, p99 per process",
        description: "The 99th percentile of the time an entry waited before its first provider call, per process: a rate limit shows here first.",
        targets: [{
          expr: `histogram_quantile(0.99, sum by (le, instance) (rate(${P}outbox_queued_seconds_bucket{${SEL}}[$__rate_interval])))`,
          legend: "{{instance}}",
        }],
        unit: "s",
        w: 8,
        h: 8,
      },
    ],
  },
  {
    title: "Integrity",
    panels: [
      {
        type: "timeseries",
        title: "Fencing and idempotency",
        description:
          "Per interval: completions rejected because another instance had taken the record (stale leases), and reused idempotency keys whose content differed (the handler is not deterministic).",
        targets: [
          { expr: `sum(increase(${P}stale_leases_total{${SEL}}[$__rate_interval]))`, legend: "stale leases" },
          { expr: `sum(increase(${P}outbox_diverged_total{${SEL}}[$__rate_interval]))`, legend: "diverged keys" },
        ],
        unit: "none",
        w: 6,
        h: 8,
      },
      {
        type: "timeseries",
        title: "Conversations",
        description: "Per interval: conversations rebuilt by replaying their handler, and replays that did not follow the recorded transcript.",
        targets: [
          { expr: `sum(increase(${P}conversations_replayed_total{${SEL}}[$__rate_interval]))`, legend: "replayed" },
          { expr: `sum(increase(${P}conversations_diverged_total{${SEL}}[$__rate_interval]))`, legend: "diverged" },
        ],
        unit: "none",
        w: 6,
        h: 8,
      },
      {
        type: "timeseries",
        title: "Durable steps",
        description: "Per second: calls of steps' functions (ctx.step, retries included), steps answered from the journal by a rerun, and steps that failed for good.",
        targets: [
          { expr: rate("steps_called"), legend: "called" },
          { expr: rate("steps_replayed"), legend: "answered from the journal" },
          { expr: rate("steps_failed"), legend: "failed" },
        ],
        unit: "reqps",
        w: 6,
        h: 8,
      },
      {
        type: "timeseries",
        title: "Damaged records",
        description: "Damaged records the backend set aside per interval (never deleted: see them in the console's damaged page).",
        targets: [{ expr: `sum(increase(${P}damaged_records_total{${SEL}}[$__rate_interval]))`, legend: "damaged" }],
        unit: "none",
        w: 6,
        h: 8,
      },
      {
        type: "timeseries",
        title: "Largest state count and the count cap",
        description: "The largest per-state count of either journal, and the cap it is counted up to: where they meet, the gauges are lower bounds.",
        targets: [
          { expr: `max(${P}inbox_records{${SEL}})`, legend: "largest inbox state" },
          { expr: `max(${P}outbox_records{${SEL}})`, legend: "largest outbox state" },
          { expr: `max(${P}records_count_cap{${SEL}})`, legend: "count cap" },
        ],
        unit: "none",
        w: 6,
        h: 8,
      },
    ],
  },
];

function thresholds(steps: Array<[number, string]> | undefined): Json {
  return {
    mode: "absolute",
    steps: [{ color: "green", value: null }, ...(steps ?? []).map(([value, color]) => ({ color, value }))],
  };
}

function panel(spec: PanelSpec, id: number, x: number, y: number): Json {
  const targets: Json[] = spec.targets.map((t, i) => ({
    datasource: DS,
    refId: String.fromCharCode(65 + i),
    expr: t.expr,
    legendFormat: t.legend,
    range: true,
    ...(t.format ? { format: t.format } : {}),
  }));
  const base = {
    id,
    type: spec.type,
    title: spec.title,
    description: spec.description,
    datasource: DS,
    gridPos: { h: spec.h, w: spec.w, x, y },
    targets,
  };
  if (spec.type === "stat") {
    return {
      ...base,
      fieldConfig: {
        defaults: { unit: spec.unit, ...(spec.decimals !== undefined ? { decimals: spec.decimals } : {}), color: { mode: "thresholds" }, thresholds: thresholds(spec.steps) },
        overrides: [],
      },
      options: {
        reduceOptions: { calcs: ["lastNotNull"], fields: "", values: false },
        colorMode: "background",
        graphMode: "area",
        justifyMode: "auto",
        textMode: "value",
        orientation: "auto",
      },
    };
  }
  if (spec.type === "heatmap") {
    return {
      ...base,
      options: {
        calculate: false,
        cellGap: 1,
        color: { mode: "scheme", scheme: "Oranges", steps: 64, exponent: 0.5, fill: "dark-orange", reverse: false, scale: "exponential" },
        yAxis: { axisPlacement: "left", unit: spec.unit },
        rowsFrame: { layout: "auto" },
        legend: { show: true },
        tooltip: { mode: "single", yHistogram: false, showColorScale: false },
        filterValues: { le: 1e-9 },
      },
      fieldConfig: { defaults: { custom: { hideFrom: { legend: false, tooltip: false, viz: false } } }, overrides: [] },
    };
  }
  return {
    ...base,
    fieldConfig: {
      defaults: {
        unit: spec.unit,
        ...(spec.decimals !== undefined ? { decimals: spec.decimals } : {}),
        min: 0,
        color: { mode: "palette-classic" },
        thresholds: thresholds(spec.steps),
        custom: {
          drawStyle: "line",
          lineWidth: 1,
          fillOpacity: 10,
          showPoints: "never",
          spanNulls: false,
          stacking: { mode: spec.stack ? "normal" : "none", group: "A" },
        },
      },
      overrides: [],
    },
    options: {
      legend: { displayMode: "list", placement: "bottom", showLegend: true },
      tooltip: { mode: "multi", sort: "desc" },
    },
  };
}

function variable(name: string, label: string, query: string): Json {
  return {
    name,
    label,
    type: "query",
    datasource: DS,
    definition: query,
    query: { query, refId: `${name}-query` },
    refresh: 2,
    includeAll: true,
    multi: true,
    allValue: ".*",
    current: { selected: true, text: ["All"], value: ["$__all"] },
    sort: 1,
    hide: 0,
    regex: "",
    skipUrlSync: false,
    options: [],
  };
}

/**
 * The dashboard: one row per concern, panels laid out left to right on Grafana's 24-column grid.
 * @returns the dashboard JSON, with the `__inputs` Grafana's import asks for
 */
export function dashboard(): Json {
  const panels: Json[] = [];
  let id = 1;
  let y = 0;
  for (const row of ROWS) {
    panels.push({ id: id++, type: "row", title: row.title, collapsed: false, datasource: DS, gridPos: { h: 1, w: 24, x: 0, y }, panels: [] });
    y += 1;
    let x = 0;
    let rowHeight = 0;
    for (const spec of row.panels) {
      if (x + spec.w > 24) {
        x = 0;
        y += rowHeight;
        rowHeight = 0;
      }
      panels.push(panel(spec, id++, x, y));
      x += spec.w;
      rowHeight = Math.max(rowHeight, spec.h);
    }
    y += rowHeight;
  }
  return {
    __inputs: [{
      name: "DS_PROMETHEUS",
      label: "Prometheus",
      description: "The Prometheus that scrapes the bot's /metrics",
      type: "datasource",
      pluginId: "prometheus",
      pluginName: "Prometheus",
    }],
    __requires: [
      { type: "grafana", id: "grafana", name: "Grafana", version: "10.0.0" },
      { type: "datasource", id: "prometheus", name: "Prometheus", version: "1.0.0" },
      { type: "panel", id: "stat", name: "Stat", version: "" },
      { type: "panel", id: "timeseries", name: "Time series", version: "" },
      { type: "panel", id: "heatmap", name: "Heatmap", version: "" },
    ],
    annotations: {
      list: [{
        builtIn: 1,
        datasource: { type: "grafana", uid: "-- Grafana --" },
        enable: true,
        hide: true,
        iconColor: "rgba(0, 211, 255, 1)",
        name: "Annotations & Alerts",
        type: "dashboard",
      }],
    },
    description: "@botmesh/durable: inbox and outbox rates, dead letters, ambiguous sends, latency, rate limits (prometheusMetrics).",
    editable: true,
    fiscalYearStartMonth: 0,
    graphTooltip: 1,
    id: null,
    links: [],
    panels,
    refresh: "30s",
    schemaVersion: 39,
    tags: ["botmesh", "chatbot", "durability"],
    templating: {
      list: [
        {
          name: "datasource",
          label: "Data source",
          type: "datasource",
          query: "prometheus",
          current: { selected: false, text: "${DS_PROMETHEUS}", value: "${DS_PROMETHEUS}" },
          hide: 0,
          includeAll: false,
          multi: false,
          options: [],
          refresh: 1,
          regex: "",
          skipUrlSync: false,
        },
        variable("job", "Job", `label_values(${P}records_count_cap, job)`),
        variable("instance", "Instance", `label_values(${P}records_count_cap{job=~"$job"}, instance)`),
      ],
    },
    time: { from: "now-6h", to: "now" },
    timepicker: {},
    timezone: "",
    title: "botmesh durable",
    uid: "botmesh-durable",
    version: 1,
    weekStart: "",
  };
}

/** The file's text: the dashboard as indented JSON. */
export function dashboardText(): string {
  return `${JSON.stringify(dashboard(), null, 2)}\n`;
}

if (import.meta.main) {
  if (process.argv.includes("--write")) writeFileSync(DASHBOARD_FILE, dashboardText());
  else process.stdout.write(dashboardText());
}
