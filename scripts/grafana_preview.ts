// A preview of the Grafana dashboard (docs/grafana/botmesh-durable.json) drawn from real metrics: two replicas of a
// bot (memory backend, mock channel) take messages for a while, their `prometheusMetrics` are scraped every 500 ms,
// each panel's queries are evaluated over the scrapes (the PromQL the dashboard uses: rate, increase, sum/max by,
// histogram_quantile, /), laid out on the dashboard's grid as HTML and photographed in headless Chromium.
// Not Grafana's own rendering: the same panels, queries and thresholds.
//
//   bun scripts/grafana_preview.ts [seconds=40] [out=docs/grafana/preview.png]
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { chromium } from "playwright-core";
import { Bot, MemoryDurability, ProviderError } from "../mod.ts";
import { prometheusMetrics } from "../ops.ts";
import { MockProvider } from "../testing.ts";
import { parseExposition } from "../tests/support/prometheus_parser.ts";
import { DASHBOARD_FILE } from "./grafana_dashboard.ts";

type Labels = Record<string, string>;
interface Point { t: number; v: number }
interface Series { name: string; labels: Labels; points: Point[] }
type Vector = Array<{ labels: Labels; value: number }>;

const SECONDS = Number(process.argv[2] ?? 40);
const OUT = process.argv[3] ?? join(import.meta.dir, "..", "docs", "grafana", "preview.png");
const JOB = "support-bot";
const RATE_WINDOW = 4; // seconds: the preview's $__rate_interval

// ---- the bots and the scrapes ----------------------------------------------------------------

const store = new Map<string, Series>();
function record(t: number, name: string, labels: Labels, v: number): void {
  const key = `${name}${JSON.stringify(Object.entries(labels).sort())}`;
  let s = store.get(key);
  if (!s) store.set(key, (s = { name, labels, points: [] }));
  s.points.push({ t, v });
}

async function run(): Promise<{ start: number; end: number }> {
  const backend = new MemoryDurability();
  const bots: Array<{ bot: Bot; provider: MockProvider; instance: string }> = [];
  const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
  for (const instance of ["bot-1:9464", "bot-2:9464"]) {
    const provider = new MockProvider({ sendDelayMs: 20 });
    const bot = new Bot({
      provider,
      durability: {
        backend,
        instanceId: instance,
        inbox: { retries: 0 },
        outbox: { retries: 2, backoff: { baseMs: 50, capMs: 200 }, rateLimit: { perChat: { count: 4, perMs: 1000 } } },
      },
    });
    bot.on("error", () => {});
    bot.on("warning", () => {});
    bot.when(/^boom/, () => {
      throw new Error("handler failed");
    });
    bot.when(/.*/, async (ctx) => {
      await sleep(30 + Math.random() * (ctx.message.text?.startsWith("slow") ? 1500 : 250));
      await ctx.reply(`ok ${ctx.message.text}`);
      if (Math.random() < 0.3) await ctx.reply("and one more");
    });
    await bot.start();
    bots.push({ bot, provider, instance });
  }
  const start = Date.now();
  const end = start + SECONDS * 1000;
  let n = 0;
  const scrape = async () => {
    const t = Date.now();
    for (const { bot, instance } of bots) {
      const p = parseExposition(await prometheusMetrics(bot, { countCap: 1000 }));
      for (const s of p.samples) record(t, s.name, { ...s.labels, job: JOB, instance }, s.value);
    }
  };
  const scraper = setInterval(() => void scrape(), 500);
  while (Date.now() < end) {
    const phase = (Date.now() - start) / (SECONDS * 1000);
    const burst = phase > 0.45 && phase < 0.6 ? 6 : 1; // a burst of traffic in the middle
    for (let i = 0; i < burst; i++) {
      const { bot: _bot, provider } = bots[n % 2]!;
      const chat = `c${n % (burst > 1 ? 3 : 12)}`;
      const text = n % 97 === 0 ? `boom ${n}` : n % 13 === 0 ? `slow ${n}` : `hi ${n}`;
      if (n % 41 === 0) provider.failNext(1, new ProviderError("Too many requests", { retryable: true, status: 429 }));
      if (n % 131 === 0) provider.failNext(3, new ProviderError("Forbidden: bot was blocked by the user", { retryable: false, status: 403 }));
      void provider.receive({ id: `m${n}`, chatId: chat, text });
      if (n % 17 === 0) void provider.receive({ id: `m${n}`, chatId: chat, text }); // a redelivery
      n++;
    }
    await sleep(120 + Math.random() * 120);
  }
  clearInterval(scraper);
  await scrape();
  for (const { bot } of bots) await bot.stop();
  return { start, end: Date.now() };
}

// ---- the PromQL the dashboard uses --------------------------------------------------------------

type Node =
  | { kind: "num"; value: number }
  | { kind: "sel"; name: string; matchers: Array<[string, string, string]>; range?: number }
  | { kind: "call"; fn: string; args: Node[] }
  | { kind: "agg"; op: string; by: string[] | null; arg: Node }
  | { kind: "div"; left: Node; right: Node };

function parse(expr: string): Node {
  let i = 0;
  const ws = () => {
    while (/\s/.test(expr[i] ?? "")) i++;
  };
  const word = () => {
    ws();
    const m = /^[a-zA-Z_:][a-zA-Z0-9_:]*/.exec(expr.slice(i));
    if (!m) throw new Error(`a name expected at ${i} in ${expr}`);
    i += m[0].length;
    return m[0];
  };
  const eat = (c: string) => {
    ws();
    if (expr[i] !== c) throw new Error(`${c} expected at ${i} in ${expr}`);
    i++;
  };
  const peek = () => {
    ws();
    return expr[i];
  };
  const labelList = () => {
    eat("(");
    const out: string[] = [];
    while (peek() !== ")") {
      out.push(word());
      if (peek() === ",") i++;
    }
    eat(")");
    return out;
  };
  const primary = (): Node => {
    ws();
    const num = /^\d+(\.\d+)?/.exec(expr.slice(i));
    if (num) {
      i += num[0].length;
      return { kind: "num", value: Number(num[0]) };
    }
    const name = word();
    if (name === "sum" || name === "max") {
      let by: string[] | null = null;
      if (/^\s*by\b/.test(expr.slice(i))) {
        word();
        by = labelList();
      }
      eat("(");
      const arg = expression();
      eat(")");
      return { kind: "agg", op: name, by, arg };
    }
    if (peek() === "(") {
      i++;
      const args: Node[] = [expression()];
      while (peek() === ",") {
        i++;
        args.push(expression());
      }
      eat(")");
      return { kind: "call", fn: name, args };
    }
    const matchers: Array<[string, string, string]> = [];
    if (peek() === "{") {
      i++;
      while (peek() !== "}") {
        const label = word();
        ws();
        const op = /^(=~|!~|!=|=)/.exec(expr.slice(i))![0];
        i += op.length;
        ws();
        const str = /^"((?:[^"\\]|\\.)*)"/.exec(expr.slice(i))!;
        i += str[0].length;
        matchers.push([label, op, JSON.parse(`"${str[1]}"`)]);
        if (peek() === ",") i++;
      }
      eat("}");
    }
    let range: number | undefined;
    if (peek() === "[") {
      const end = expr.indexOf("]", i);
      const text = expr.slice(i + 1, end);
      range = text === "$__rate_interval" ? RATE_WINDOW : text.endsWith("h") ? Number(text.slice(0, -1)) * 3600 : Number(text.slice(0, -1));
      i = end + 1;
    }
    return { kind: "sel", name, matchers, ...(range !== undefined ? { range } : {}) };
  };
  const expression = (): Node => {
    let left = primary();
    while (peek() === "/") {
      i++;
      left = { kind: "div", left, right: primary() };
    }
    return left;
  };
  const node = expression();
  ws();
  if (i !== expr.length) throw new Error(`unparsed rest at ${i} in ${expr}`);
  return node;
}

function matches(labels: Labels, matchers: Array<[string, string, string]>): boolean {
  return matchers.every(([label, op, raw]) => {
    const value = raw.replace(/\$(job|instance)/g, ".*");
    const have = labels[label] ?? "";
    if (op === "=") return have === value;
    if (op === "!=") return have !== value;
    const re = new RegExp(`^(?:${value})$`);
    return op === "=~" ? re.test(have) : !re.test(have);
  });
}

function evaluate(node: Node, t: number): Vector {
  switch (node.kind) {
    case "num":
      return [{ labels: {}, value: node.value }];
    case "sel": {
      const out: Vector = [];
      for (const s of store.values()) {
        if (s.name !== node.name || !matches(s.labels, node.matchers)) continue;
        const at = s.points.filter((p) => p.t <= t && p.t > t - 5000);
        if (at.length > 0) out.push({ labels: { ...s.labels, __name__: s.name }, value: at[at.length - 1]!.v });
      }
      return out;
    }
    case "call": {
      if (node.fn === "rate" || node.fn === "increase") {
        const sel = node.args[0] as Extract<Node, { kind: "sel" }>;
        const out: Vector = [];
        for (const s of store.values()) {
          if (s.name !== sel.name || !matches(s.labels, sel.matchers)) continue;
          const win = s.points.filter((p) => p.t <= t && p.t > t - sel.range! * 1000);
          if (win.length < 2) continue;
          const delta = win[win.length - 1]!.v - win[0]!.v;
          const span = (win[win.length - 1]!.t - win[0]!.t) / 1000;
          const rate = span > 0 ? delta / span : 0;
          out.push({ labels: { ...s.labels }, value: node.fn === "rate" ? rate : rate * sel.range! });
        }
        return out;
      }
      if (node.fn === "histogram_quantile") {
        const q = evaluate(node.args[0]!, t)[0]!.value;
        const groups = new Map<string, { labels: Labels; buckets: Array<[number, number]> }>();
        for (const s of evaluate(node.args[1]!, t)) {
          const { le, ...rest } = s.labels;
          const key = JSON.stringify(rest);
          if (!groups.has(key)) groups.set(key, { labels: rest, buckets: [] });
          groups.get(key)!.buckets.push([le === "+Inf" ? Infinity : Number(le), s.value]);
        }
        const out: Vector = [];
        for (const { labels, buckets } of groups.values()) {
          buckets.sort((a, b) => a[0] - b[0]);
          const total = buckets[buckets.length - 1]![1];
          if (!(total > 0)) continue;
          const rank = q * total;
          const k = buckets.findIndex(([, c]) => c >= rank);
          if (buckets[k]![0] === Infinity) {
            out.push({ labels, value: buckets[buckets.length - 2]![0] });
            continue;
          }
          const [upper, count] = buckets[k]!;
          const [lower, below] = k > 0 ? buckets[k - 1]! : [0, 0];
          out.push({ labels, value: lower + (upper - lower) * ((rank - below) / Math.max(count - below, 1e-12)) });
        }
        return out;
      }
      throw new Error(`function ${node.fn} not in the preview`);
    }
    case "agg": {
      const groups = new Map<string, { labels: Labels; value: number }>();
      for (const s of evaluate(node.arg, t)) {
        const labels: Labels = {};
        for (const l of node.by ?? []) if (s.labels[l] !== undefined) labels[l] = s.labels[l]!;
        const key = JSON.stringify(labels);
        const g = groups.get(key);
        if (!g) groups.set(key, { labels, value: s.value });
        else g.value = node.op === "sum" ? g.value + s.value : Math.max(g.value, s.value);
      }
      return [...groups.values()];
    }
    case "div": {
      const right = evaluate(node.right, t);
      return evaluate(node.left, t).flatMap((l) => {
        const r = right.find((x) => JSON.stringify(x.labels) === JSON.stringify(l.labels));
        return r && r.value !== 0 ? [{ labels: l.labels, value: l.value / r.value }] : [];
      });
    }
  }
}

// ---- the page ---------------------------------------------------------------------------------

const COLORS = ["#73bf69", "#f2cc0c", "#8ab8ff", "#ff780a", "#f2495c", "#5794f2", "#b877d9", "#705da0"];
const esc = (s: string) => s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/"/g, "&quot;");

function format(v: number, unit: string): string {
  if (!Number.isFinite(v)) return "No data";
  if (unit === "s") return v >= 60 ? `${(v / 60).toFixed(1)} min` : v >= 1 ? `${v.toFixed(2)} s` : `${Math.round(v * 1000)} ms`;
  if (unit === "reqps") return `${v.toFixed(2)} req/s`;
  return Number.isInteger(v) ? String(v) : v.toFixed(2);
}

type PanelJson = {
  id: number;
  type: string;
  title: string;
  gridPos: { x: number; y: number; w: number; h: number };
  targets?: Array<{ expr: string; legendFormat: string }>;
  fieldConfig?: { defaults: { unit?: string; thresholds?: { steps: Array<{ color: string; value: number | null }> } } };
};

function legendOf(format: string, labels: Labels): string {
  return format.replace(/\{\{(\w+)\}\}/g, (_, l: string) => labels[l] ?? "");
}

function render(dashboard: { panels: PanelJson[]; title: string }, times: number[]): string {
  const UNIT_H = 30;
  const WIDTH = 1600;
  const col = WIDTH / 24;
  const stateColor: Record<string, string> = { green: "#1a7f37", yellow: "#b78a00", orange: "#c4571a", red: "#b3202f" };
  const out: string[] = [];
  for (const p of dashboard.panels) {
    const { x, y, w, h } = p.gridPos;
    const box = `left:${x * col + 4}px;top:${y * UNIT_H + 50}px;width:${w * col - 8}px;height:${h * UNIT_H - 8}px`;
    if (p.type === "row") {
      out.push(`<div class="row" style="${box}">${esc(p.title)}</div>`);
      continue;
    }
    const unit = p.fieldConfig?.defaults.unit ?? "none";
    if (p.type === "stat") {
      const value = evaluate(parse(p.targets![0]!.expr), times[times.length - 1]!)[0]?.value ?? NaN;
      let color = "green";
      for (const step of p.fieldConfig?.defaults.thresholds?.steps ?? []) if (step.value === null || value >= step.value) color = step.color;
      out.push(`<div class="panel stat" style="${box};background:${stateColor[color] ?? "#1a7f37"}"><div class="title">${esc(p.title)}</div><div class="big">${esc(format(value, unit))}</div></div>`);
      continue;
    }
    const pw = w * col - 8;
    const ph = h * UNIT_H - 8 - 48;
    const t0 = times[0]!;
    const t1 = times[times.length - 1]!;
    const sx = (t: number) => 40 + ((t - t0) / (t1 - t0)) * (pw - 50);
    if (p.type === "heatmap") {
      const target = p.targets![0]!;
      const cols = times.map((t) => {
        const v = evaluate(parse(target.expr), t).map((s) => [s.labels.le === "+Inf" ? Infinity : Number(s.labels.le), s.value] as [number, number]);
        v.sort((a, b) => a[0] - b[0]);
        return v.map(([le, c], i) => [le, Math.max(0, c - (i > 0 ? v[i - 1]![1] : 0))] as [number, number]);
      });
      const bounds = cols.find((c) => c.length > 0)?.map(([le]) => le) ?? [];
      const max = Math.max(1e-9, ...cols.flat().map(([, c]) => c));
      const cellH = ph / Math.max(bounds.length, 1);
      const rects: string[] = [];
      cols.forEach((c, ti) => {
        if (ti === 0) return;
        c.forEach(([, n], bi) => {
          if (n <= 0) return;
          const a = 0.15 + 0.85 * Math.sqrt(n / max);
          rects.push(`<rect x="${sx(times[ti - 1]!)}" y="${ph - (bi + 1) * cellH}" width="${Math.max(1, sx(times[ti]!) - sx(times[ti - 1]!))}" height="${cellH - 1}" fill="rgba(255,120,10,${a.toFixed(2)})"/>`);
        });
      });
      const labels = bounds.map((le, bi) => bi % 3 === 0 ? `<text x="2" y="${ph - bi * cellH - 2}" class="axis">${le === Infinity ? "+Inf" : format(le, "s")}</text>` : "").join("");
      out.push(`<div class="panel" style="${box}"><div class="title">${esc(p.title)}</div><svg width="${pw}" height="${ph}">${rects.join("")}${labels}</svg></div>`);
      continue;
    }
    const lines: Array<{ legend: string; points: Array<[number, number]> }> = [];
    for (const target of p.targets ?? []) {
      const node = parse(target.expr);
      const bySeries = new Map<string, { legend: string; points: Array<[number, number]> }>();
      for (const t of times) {
        for (const s of evaluate(node, t)) {
          const legend = legendOf(target.legendFormat, s.labels);
          const key = `${target.expr}|${legend}`;
          if (!bySeries.has(key)) bySeries.set(key, { legend, points: [] });
          if (Number.isFinite(s.value)) bySeries.get(key)!.points.push([t, s.value]);
        }
      }
      lines.push(...bySeries.values());
    }
    const top = Math.max(0, ...lines.flatMap((l) => l.points.map(([, v]) => v)));
    const ymax = (top > 0 ? top : 1) * 1.1;
    const sy = (v: number) => ph - 14 - (v / ymax) * (ph - 24);
    const grid = [0, 0.5, 1].map((f) => `<line x1="40" x2="${pw - 10}" y1="${sy(ymax * f / 1.1)}" y2="${sy(ymax * f / 1.1)}" class="grid"/><text x="2" y="${sy(ymax * f / 1.1) + 4}" class="axis">${esc(format(ymax * f / 1.1, unit))}</text>`).join("");
    const paths = lines.map((l, k) => l.points.length < 2 ? "" : `<polyline fill="none" stroke="${COLORS[k % COLORS.length]}" stroke-width="1.5" points="${l.points.map(([t, v]) => `${sx(t).toFixed(1)},${sy(v).toFixed(1)}`).join(" ")}"/>`).join("");
    const legend = lines.map((l, k) => `<span><i style="background:${COLORS[k % COLORS.length]}"></i>${esc(l.legend)}</span>`).join("");
    out.push(`<div class="panel" style="${box}"><div class="title">${esc(p.title)}</div><svg width="${pw}" height="${ph}">${grid}${paths}</svg><div class="legend">${legend}</div></div>`);
  }
  const height = Math.max(...dashboard.panels.map((p) => (p.gridPos.y + p.gridPos.h) * UNIT_H)) + 60;
  return `<!doctype html><html><head><meta charset="utf-8"><style>
    body { margin: 0; background: #111217; color: #ccccdc; font: 12px Inter, "Helvetica Neue", Arial, sans-serif; width: ${WIDTH}px; height: ${height}px; position: relative; }
    header { position: absolute; left: 8px; top: 10px; font-size: 16px; color: #fff; }
    header small { color: #8e8e9e; font-size: 12px; margin-left: 12px; }
    .row { position: absolute; font-size: 14px; font-weight: 600; color: #fff; padding-top: 6px; }
    .panel { position: absolute; background: #181b1f; border: 1px solid #2c3235; border-radius: 2px; overflow: hidden; }
    .title { padding: 6px 8px; font-weight: 600; color: #d8d9da; white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
    .stat .big { font-size: 26px; font-weight: 600; color: #fff; padding: 4px 8px; }
    .stat .title { color: #fff; }
    .grid { stroke: #2c3235; } .axis { fill: #8e8e9e; font-size: 10px; }
    .legend { position: absolute; bottom: 4px; left: 8px; right: 8px; white-space: nowrap; overflow: hidden; font-size: 11px; }
    .legend span { margin-right: 10px; } .legend i { display: inline-block; width: 10px; height: 3px; margin-right: 4px; vertical-align: middle; }
  </style></head><body><header>${esc(dashboard.title)}<small>job = ${JOB}, instance = All · preview drawn from ${SECONDS} s of two replicas' real metrics (not Grafana's rendering)</small></header>${out.join("")}</body></html>`;
}

if (import.meta.main) {
  const dashboard = JSON.parse(readFileSync(DASHBOARD_FILE, "utf8")) as { panels: PanelJson[]; title: string };
  const { start, end } = await run();
  const times: number[] = [];
  for (let t = start + 1000; t <= end; t += 500) times.push(t);
  const html = render(dashboard, times);
  const browser = await chromium.launch({ executablePath: process.env.BOTMESH_CHROMIUM ?? "/usr/bin/chromium", args: ["--no-sandbox", "--headless", "--disable-gpu"] });
  try {
    const page = await browser.newPage({ viewport: { width: 1600, height: 900 } });
    await page.setContent(html);
    await page.screenshot({ path: OUT, fullPage: true });
  } finally {
    await browser.close();
  }
  console.log(`wrote ${OUT}`);
}
