// A strict parser of the Prometheus text format 0.0.4 (the subset the exposition writes): throws on anything else.

export interface Sample {
  name: string;
  labels: Record<string, string>;
  value: number;
}
export interface Parsed {
  types: Map<string, string>;
  help: Map<string, string>;
  samples: Sample[];
}
export interface ParsedHistogram {
  /** Upper bound and cumulative count, the last one `Infinity`. */
  buckets: Array<[number, number]>;
  sum: number;
  count: number;
}

const NAME = "[a-zA-Z_:][a-zA-Z0-9_:]*";
const HISTOGRAM_SUFFIXES = ["_bucket", "_sum", "_count"];

function parseValue(text: string): number {
  return Number(text.replace(/Inf$/i, "Infinity"));
}

/** The family a sample name belongs to: itself, or a histogram it is a `_bucket`, `_sum` or `_count` of. */
function familyOf(name: string, types: Map<string, string>): string | undefined {
  if (types.has(name)) return types.get(name) === "histogram" ? undefined : name;
  for (const suffix of HISTOGRAM_SUFFIXES) {
    const base = name.endsWith(suffix) ? name.slice(0, -suffix.length) : "";
    if (base !== "" && types.get(base) === "histogram") return base;
  }
  return undefined;
}

/**
 * Parses and checks an exposition: HELP and TYPE once per family and before its samples, a family's samples
 * together, well-formed labels and values, no series twice, counters named `_total` and never negative, and
 * for each histogram series: `le` ascending up to `+Inf`, cumulative counts never decreasing, the `+Inf`
 * bucket equal to `_count`, and a `_sum`.
 */
export function parseExposition(text: string): Parsed {
  if (!text.endsWith("\n")) throw new Error("the exposition must end with a newline");
  const types = new Map<string, string>();
  const help = new Map<string, string>();
  const samples: Sample[] = [];
  const families: Array<{ family: string; sample: Sample }> = [];
  const seenSeries = new Set<string>();
  const finished = new Set<string>();
  let current: string | undefined;
  const lines = text.slice(0, -1).split("\n");
  for (const [i, line] of lines.entries()) {
    const where = `line ${i + 1} ${JSON.stringify(line)}`;
    let m: RegExpExecArray | null;
    if ((m = new RegExp(`^# HELP (${NAME}) (.*)$`).exec(line))) {
      if (help.has(m[1]!)) throw new Error(`${where}: second HELP`);
      if (/\\[^\\n]|\\$/.test(m[2]!.replace(/\\\\/g, ""))) throw new Error(`${where}: bad escape in HELP`);
      help.set(m[1]!, m[2]!);
      continue;
    }
    if ((m = new RegExp(`^# TYPE (${NAME}) (counter|gauge|histogram|summary|untyped)$`).exec(line))) {
      if (types.has(m[1]!)) throw new Error(`${where}: second TYPE`);
      if (m[2] === "counter" && !m[1]!.endsWith("_total")) throw new Error(`${where}: a counter's name must end in _total`);
      types.set(m[1]!, m[2]!);
      if (current !== undefined) finished.add(current);
      current = m[1]!;
      continue;
    }
    m = new RegExp(`^(${NAME})(?:\\{(.*)\\})? (\\S+)$`).exec(line);
    if (!m) throw new Error(`${where}: neither HELP, TYPE nor a sample`);
    const [, name, labelText, valueText] = m;
    const family = familyOf(name!, types);
    if (family === undefined) throw new Error(`${where}: sample of ${name} before (or without) its TYPE`);
    if (family !== current || finished.has(family)) throw new Error(`${where}: sample of ${family} outside its family's block`);
    if (!/^(?:[+-]?(?:\d+(?:\.\d+)?(?:e[+-]?\d+)?)|NaN|[+-]Inf)$/i.test(valueText!)) {
      throw new Error(`${where}: value ${valueText} is not numeric`);
    }
    const labels: Record<string, string> = {};
    if (labelText !== undefined) {
      const re = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\\\|\\"|\\n)*)"(,|$)/y;
      let pos = 0;
      while (pos < labelText.length) {
        re.lastIndex = pos;
        const l = re.exec(labelText);
        if (!l) throw new Error(`${where}: bad label syntax at ${pos}`);
        if (l[1]! in labels) throw new Error(`${where}: label ${l[1]} twice`);
        labels[l[1]!] = l[2]!.replace(/\\(\\|"|n)/g, (_, c: string) => (c === "n" ? "\n" : c));
        pos = re.lastIndex;
        if (l[3] === "," && pos === labelText.length) throw new Error(`${where}: trailing comma`);
      }
    }
    const series = `${name}${JSON.stringify(Object.entries(labels).sort())}`;
    if (seenSeries.has(series)) throw new Error(`${where}: the same series twice`);
    seenSeries.add(series);
    const sample = { name: name!, labels, value: parseValue(valueText!) };
    if (types.get(family) === "counter" && !(sample.value >= 0)) throw new Error(`${where}: a counter below 0`);
    samples.push(sample);
    families.push({ family, sample });
  }
  for (const name of types.keys()) {
    if (!help.has(name)) throw new Error(`${name} has a TYPE but no HELP`);
    if (!families.some((f) => f.family === name)) throw new Error(`${name} has a TYPE but no sample`);
  }
  for (const [name, type] of types) if (type === "histogram") checkHistogram(name, families);
  return { types, help, samples };
}

function checkHistogram(name: string, families: Array<{ family: string; sample: Sample }>): void {
  const groups = new Map<string, Sample[]>();
  for (const { family, sample } of families) {
    if (family !== name) continue;
    const { le: _le, ...rest } = sample.labels;
    const key = JSON.stringify(Object.entries(rest).sort());
    groups.set(key, [...groups.get(key) ?? [], sample]);
  }
  for (const [key, group] of groups) {
    const where = `histogram ${name} ${key}`;
    const buckets = group.filter((s) => s.name === `${name}_bucket`);
    const sums = group.filter((s) => s.name === `${name}_sum`);
    const counts = group.filter((s) => s.name === `${name}_count`);
    if (sums.length !== 1 || counts.length !== 1) throw new Error(`${where}: needs one _sum and one _count`);
    if ("le" in sums[0]!.labels || "le" in counts[0]!.labels) throw new Error(`${where}: le on _sum or _count`);
    if (buckets.length === 0) throw new Error(`${where}: no buckets`);
    let lastLe = -Infinity;
    let lastCount = 0;
    for (const b of buckets) {
      const leText = b.labels.le;
      if (leText === undefined) throw new Error(`${where}: a bucket without le`);
      const le = parseValue(leText);
      if (Number.isNaN(le) || !(le > lastLe)) throw new Error(`${where}: le ${leText} not above the previous one`);
      if (!Number.isInteger(b.value) || b.value < lastCount) throw new Error(`${where}: bucket le=${leText} decreases`);
      lastLe = le;
      lastCount = b.value;
    }
    if (lastLe !== Infinity) throw new Error(`${where}: the last bucket is not le="+Inf"`);
    if (lastCount !== counts[0]!.value) throw new Error(`${where}: the +Inf bucket (${lastCount}) is not _count (${counts[0]!.value})`);
    if (!(sums[0]!.value >= 0)) throw new Error(`${where}: _sum below 0`);
  }
}

/** The one sample of `name` with these labels (among others). */
export function value(p: Parsed, name: string, labels: Record<string, string> = {}): number {
  const found = p.samples.filter((s) => s.name === name && Object.entries(labels).every(([k, v]) => s.labels[k] === v));
  if (found.length !== 1) throw new Error(`expected one sample ${name} ${JSON.stringify(labels)}, found ${found.length}`);
  return found[0]!.value;
}

/** The histogram series `name` with these labels (among others). */
export function histogram(p: Parsed, name: string, labels: Record<string, string> = {}): ParsedHistogram {
  const matches = (s: Sample) => Object.entries(labels).every(([k, v]) => s.labels[k] === v);
  const buckets = p.samples
    .filter((s) => s.name === `${name}_bucket` && matches(s))
    .map((s): [number, number] => [parseValue(s.labels.le!), s.value]);
  return { buckets, sum: value(p, `${name}_sum`, labels), count: value(p, `${name}_count`, labels) };
}
