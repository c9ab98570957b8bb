// The series names a PromQL expression (or a Grafana variable query) reads, and the label matchers it puts on
// each: enough of PromQL to check a dashboard's queries against what an exporter writes.

/** Words of PromQL that are no series: aggregations, keywords and operators written as words. */
const NOT_SERIES = new Set([
  "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk", "quantile",
  "limitk", "limit_ratio", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
  "unless", "offset", "atan2", "inf", "nan",
]);

/** A selector's label matcher: `label op "value"`. */
export interface Matcher {
  label: string;
  op: "=" | "!=" | "=~" | "!~";
  value: string;
}

/** The expression of a Grafana variable query: the series argument of `label_values(…)` / `query_result(…)`, else the query. */
export function variableExpr(query: string): string {
  const labelValues = /^\s*label_values\(\s*(.*),\s*[a-zA-Z_][a-zA-Z0-9_]*\s*\)\s*$/s.exec(query);
  if (labelValues) return labelValues[1]!;
  const result = /^\s*query_result\((.*)\)\s*$/s.exec(query);
  return result ? result[1]! : query;
}

/**
 * The series an expression reads, each with the matchers of its selector.
 * @param expr a PromQL expression
 * @returns one entry per series selector, in order
 */
export function seriesOf(expr: string): Array<{ name: string; matchers: Matcher[] }> {
  // Strings out first (a label value may hold any character), kept aside by index.
  const strings: string[] = [];
  let s = expr.replace(/"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`/g, (m) => `"${strings.push(JSON.parse(m.startsWith("'") ? `"${m.slice(1, -1)}"` : m.startsWith("`") ? JSON.stringify(m.slice(1, -1)) : m)) - 1}"`);
  // Ranges and subqueries, and the label lists of by/without/on/ignoring/group_left/group_right.
  s = s.replace(/\[[^\]]*\]/g, " ").replace(/\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)/g, " ");
  const out: Array<{ name: string; matchers: Matcher[] }> = [];
  const word = /[a-zA-Z_:][a-zA-Z0-9_:]*/g;
  for (let m = word.exec(s); m !== null; m = word.exec(s)) {
    const name = m[0];
    const before = s[m.index - 1] ?? "";
    const rest = s.slice(m.index + name.length);
    const selector = /^\s*\{([^}]*)\}/.exec(rest);
    if (selector) word.lastIndex = m.index + name.length + selector[0].length; // its matchers are no series
    if (/[0-9.$"]/.test(before)) continue; // part of a number (1e9), a variable ($job) or a string
    if (/^\s*\(/.test(rest) || NOT_SERIES.has(name.toLowerCase())) continue; // a function or a keyword
    const matchers: Matcher[] = [];
    for (const part of (selector?.[1] ?? "").split(",").map((p) => p.trim()).filter((p) => p !== "")) {
      const mm = /^([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"(\d+)"$/.exec(part);
      if (!mm) throw new Error(`Unreadable label matcher ${JSON.stringify(part)} in ${JSON.stringify(expr)}`);
      matchers.push({ label: mm[1]!, op: mm[2] as Matcher["op"], value: strings[Number(mm[3])]! });
    }
    out.push({ name, matchers });
  }
  // A bare selector with no name: {__name__="…"} is not used by the dashboard; refuse it rather than miss it.
  if (s.replace(/[a-zA-Z0-9_:]\s*\{/g, "").includes("{")) {
    throw new Error(`A selector without a metric name in ${JSON.stringify(expr)}`);
  }
  return out;
}
