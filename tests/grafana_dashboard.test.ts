// The Grafana dashboard (docs/grafana/botmesh-durable.json): every query names only series the exporter writes
// (read from the exposition of a real bot, not from a list), with label values it writes, and the JSON is one
// Grafana 10+ imports (datasource input, variables, unique ids, a grid without overlaps).
import { describe, expect, test } from "bun:test";
import { readFileSync } from "node:fs";
import { Bot, MemoryDurability, ProviderError } from "../mod.ts";
import { MockProvider } from "../testing.ts";
import { prometheusMetrics } from "../ops.ts";
import { DASHBOARD_FILE, dashboardText } from "../scripts/grafana_dashboard.ts";
import { parseExposition } from "./support/prometheus_parser.ts";
import { seriesOf, variableExpr } from "./support/promql_names.ts";

type Obj = Record<string, unknown>;

/** What the exporter writes: each series name a query may read, and the label values of its samples. */
interface Exported {
  /** Family name to its TYPE. */
  families: Map<string, string>;
  /** Series name (a histogram's `_bucket`, `_sum`, `_count`) to its labels' values. */
  series: Map<string, Map<string, Set<string>>>;
}

/** The exposition of a bot with the memory backend after a few messages: a reply, a dead letter, a dead send. */
async function exported(): Promise<Exported> {
  const provider = new MockProvider();
  const bot = new Bot({ provider, durability: { backend: new MemoryDurability(), instanceId: "grafana", inbox: { retries: 0 } } });
  bot.on("error", () => {});
  bot.on("warning", () => {});
  bot.when("ping", (ctx) => ctx.reply("pong"));
  bot.when("boom", () => {
    throw new Error("handler failed");
  });
  await bot.start();
  try {
    await provider.receive({ id: "m1", chatId: "c1", text: "ping" });
    await provider.receive({ id: "m2", chatId: "c1", text: "boom" });
    await bot.idle();
    provider.failNext(1, new ProviderError("Invalid recipient", { retryable: false }));
    await provider.receive({ id: "m3", chatId: "c2", text: "ping" });
    await bot.idle();
    const parsed = parseExposition(await prometheusMetrics(bot, { labels: { bot: "support" } }));
    const series: Exported["series"] = new Map();
    for (const [name, type] of parsed.types) {
      for (const s of type === "histogram" ? ["_bucket", "_sum", "_count"].map((x) => name + x) : [name]) series.set(s, new Map());
    }
    for (const sample of parsed.samples) {
      const labels = series.get(sample.name);
      if (labels === undefined) throw new Error(`sample ${sample.name} of no family`);
      for (const [k, v] of Object.entries(sample.labels)) {
        if (!labels.has(k)) labels.set(k, new Set());
        labels.get(k)!.add(v);
      }
    }
    return { families: parsed.types, series };
  } finally {
    await bot.stop();
  }
}

/** Every panel, those of collapsed rows included. */
function allPanels(dashboard: Obj): Obj[] {
  const out: Obj[] = [];
  for (const p of dashboard.panels as Obj[]) {
    out.push(p);
    for (const nested of (p.panels as Obj[] | undefined) ?? []) out.push(nested);
  }
  return out;
}

/** Every query of the dashboard: each panel target's `expr` and each query variable's query, with where it is. */
function queries(dashboard: Obj): Array<{ where: string; expr: string }> {
  const out: Array<{ where: string; expr: string }> = [];
  for (const p of allPanels(dashboard)) {
    for (const t of (p.targets as Obj[] | undefined) ?? []) out.push({ where: `panel ${p.id} "${p.title}" ${t.refId}`, expr: t.expr as string });
  }
  for (const v of (dashboard.templating as { list: Obj[] }).list) {
    if (v.type !== "query") continue;
    const q = v.query as string | { query: string };
    out.push({ where: `variable $${v.name}`, expr: variableExpr(typeof q === "string" ? q : q.query) });
  }
  return out;
}

/** Labels Prometheus adds at scrape time, and the label a histogram's buckets carry. */
const SCRAPE_LABELS = new Set(["job", "instance"]);

/**
 * The problems of the dashboard's queries against an exposition: series it does not write (a histogram's
 * bare name included: only `_bucket`, `_sum` and `_count` exist), label values it never writes, a quantile
 * not over the `_bucket` series by `le`, a query without the job and instance variables.
 */
function queryProblems(dashboard: Obj, exp: Exported): string[] {
  const problems: string[] = [];
  for (const { where, expr } of queries(dashboard)) {
    const series = seriesOf(expr);
    if (series.length === 0) problems.push(`${where}: reads no series: ${expr}`);
    for (const { name, matchers } of series) {
      const labels = exp.series.get(name);
      if (labels === undefined) {
        const hint = exp.families.get(name) === "histogram" ? " (a histogram: read its _bucket, _sum or _count)" : "";
        problems.push(`${where}: the exporter writes no series ${name}${hint}`);
        continue;
      }
      for (const m of matchers) {
        if (SCRAPE_LABELS.has(m.label)) {
          if (!m.value.includes("$")) problems.push(`${where}: ${m.label} is fixed to ${JSON.stringify(m.value)}, not the variable`);
          continue;
        }
        const values = labels.get(m.label);
        if (values === undefined) problems.push(`${where}: ${name} has no label ${m.label}`);
        else if ((m.op === "=" || m.op === "!=") && !values.has(m.value)) {
          problems.push(`${where}: ${name} never has ${m.label}=${JSON.stringify(m.value)} (it has ${[...values].join(", ")})`);
        }
      }
      if (where.startsWith("panel") && !["job", "instance"].every((l) => matchers.some((m) => m.label === l && m.value === `$${l}`))) {
        problems.push(`${where}: ${name} is not filtered by $job and $instance`);
      }
    }
    if (expr.includes("histogram_quantile") && !/sum by \(le(, [a-z_]+)*\) \(rate\([a-z_]+_bucket\{/.test(expr)) {
      problems.push(`${where}: a quantile must be histogram_quantile over sum by (le) (rate(<histogram>_bucket…)): ${expr}`);
    }
  }
  return problems;
}

/** The problems of the JSON as a Grafana 10+ dashboard to import. */
function shapeProblems(dashboard: Obj): string[] {
  const problems: string[] = [];
  const ds = { type: "prometheus", uid: "${datasource}" };
  if (typeof dashboard.schemaVersion !== "number" || dashboard.schemaVersion < 39) problems.push("schemaVersion below 39");
  if (typeof dashboard.uid !== "string" || !/^[a-zA-Z0-9_-]{1,40}$/.test(dashboard.uid)) problems.push("no valid uid");
  if (typeof dashboard.title !== "string" || dashboard.title === "") problems.push("no title");
  const inputs = (dashboard.__inputs as Obj[] | undefined) ?? [];
  if (!inputs.some((i) => i.name === "DS_PROMETHEUS" && i.type === "datasource" && i.pluginId === "prometheus")) {
    problems.push("no DS_PROMETHEUS datasource input");
  }
  const variables = (dashboard.templating as { list: Obj[] }).list;
  const dsVar = variables.find((v) => v.name === "datasource");
  if (dsVar?.type !== "datasource" || dsVar.query !== "prometheus" || (dsVar.current as Obj)?.value !== "${DS_PROMETHEUS}") {
    problems.push("no datasource variable defaulting to the DS_PROMETHEUS input");
  }
  for (const name of ["job", "instance"]) {
    const v = variables.find((x) => x.name === name);
    if (v?.type !== "query") problems.push(`no query variable $${name}`);
    else if (JSON.stringify(v.datasource) !== JSON.stringify(ds)) problems.push(`variable $${name} has no Prometheus datasource`);
  }
  const ids = new Set<unknown>();
  const boxes: Array<{ id: unknown; x: number; y: number; w: number; h: number }> = [];
  for (const p of allPanels(dashboard)) {
    const name = `panel ${p.id} "${p.title}"`;
    if (!Number.isInteger(p.id) || ids.has(p.id)) problems.push(`${name}: id missing or not unique`);
    ids.add(p.id);
    if (typeof p.title !== "string" || p.title === "") problems.push(`${name}: no title`);
    if (JSON.stringify(p.datasource) !== JSON.stringify(ds)) problems.push(`${name}: datasource is not the $datasource variable`);
    const g = p.gridPos as { x: number; y: number; w: number; h: number } | undefined;
    if (g === undefined || ![g.x, g.y, g.w, g.h].every(Number.isInteger) || g.w < 1 || g.h < 1 || g.x < 0 || g.y < 0 || g.x + g.w > 24) {
      problems.push(`${name}: gridPos missing or off the 24-column grid: ${JSON.stringify(g)}`);
    } else {
      for (const b of boxes) {
        if (g.x < b.x + b.w && b.x < g.x + g.w && g.y < b.y + b.h && b.y < g.y + g.h) problems.push(`${name}: overlaps panel ${b.id}`);
      }
      boxes.push({ id: p.id, ...g });
    }
    if (p.type === "row") continue;
    if (!["stat", "timeseries", "heatmap", "gauge", "table", "bargauge"].includes(p.type as string)) problems.push(`${name}: unknown type ${p.type}`);
    const targets = (p.targets as Obj[] | undefined) ?? [];
    if (targets.length === 0) problems.push(`${name}: no targets`);
    const refIds = new Set<unknown>();
    for (const t of targets) {
      if (typeof t.refId !== "string" || refIds.has(t.refId)) problems.push(`${name}: refId missing or repeated`);
      refIds.add(t.refId);
      if (JSON.stringify(t.datasource) !== JSON.stringify(ds)) problems.push(`${name} ${t.refId}: datasource is not the $datasource variable`);
      if (typeof t.expr !== "string" || t.expr.trim() === "") problems.push(`${name} ${t.refId}: no expr`);
    }
  }
  return problems;
}

const text = readFileSync(DASHBOARD_FILE, "utf8");
const dashboard = JSON.parse(text) as Obj;
const exposition = await exported();

describe("the Grafana dashboard", () => {
  test("the file is what scripts/grafana_dashboard.ts makes", () => {
    expect(text).toBe(dashboardText());
  });

  test("every query names only series the exporter writes, with label values it writes", () => {
    expect(queryProblems(dashboard, exposition)).toEqual([]);
    expect(queries(dashboard).length).toBeGreaterThan(30);
  });

  test("every family the exporter writes is on the dashboard", () => {
    const used = new Set(queries(dashboard).flatMap(({ expr }) => seriesOf(expr).map((s) => s.name)));
    const missing = [...exposition.families.keys()].filter((family) => ![family, `${family}_bucket`, `${family}_sum`, `${family}_count`].some((s) => used.has(s)));
    expect(missing).toEqual([]);
  });

  test("the JSON is a Grafana 10+ dashboard to import: datasource input, variables, unique ids, a grid without overlaps", () => {
    expect(shapeProblems(dashboard)).toEqual([]);
  });

  test("the checks fail on a panel that names a metric the exporter does not write, or reads a histogram badly", () => {
    const broken = JSON.parse(text) as Obj;
    const panels = broken.panels as Obj[];
    const target = (panels.find((p) => p.type === "timeseries")!.targets as Obj[])[0]!;
    target.expr = 'sum(rate(botmesh_durable_inbound_recieved_total{job=~"$job", instance=~"$instance"}[$__rate_interval]))';
    const histogram = (panels.find((p) => p.title === "Reply latency")!.targets as Obj[])[0]!;
    histogram.expr = 'histogram_quantile(0.9, sum by (le) (rate(botmesh_durable_reply_latency_seconds{job=~"$job", instance=~"$instance"}[5m])))';
    const state = (panels.find((p) => p.title === "Inbound dead letters")!.targets as Obj[])[0]!;
    state.expr = 'max(botmesh_durable_inbox_records{job=~"$job", instance=~"$instance", state="deadd"})';
    (broken.templating as { list: Obj[] }).list.find((v) => v.name === "instance")!.query = { query: "label_values(process_start_time_seconds, instance)" };
    const problems = queryProblems(broken, exposition).join("\n");
    expect(problems).toContain("the exporter writes no series botmesh_durable_inbound_recieved_total");
    expect(problems).toContain("the exporter writes no series botmesh_durable_reply_latency_seconds (a histogram: read its _bucket, _sum or _count)");
    expect(problems).toContain('never has state="deadd"');
    expect(problems).toContain("variable $instance: the exporter writes no series process_start_time_seconds");
    const shape = JSON.parse(text) as Obj;
    const [a, b] = (shape.panels as Obj[]).filter((p) => p.type === "timeseries");
    b!.id = a!.id;
    delete a!.datasource;
    (b!.gridPos as Obj).x = 20;
    expect(shapeProblems(shape).join("\n")).toMatch(/datasource is not the \$datasource variable[\s\S]*id missing or not unique[\s\S]*off the 24-column grid/);
  });
});
