const mod = await import(process.argv[2]);
const t = mod.tables("s", "p_");
const out: Record<string, string> = { migration: mod.migrationSql(t) };
const walk = (prefix: string, o: Record<string, unknown>) => {
  for (const [k, v] of Object.entries(o)) {
    if (typeof v === "string") out[prefix + k] = v;
    else if (typeof v === "function") {
      for (const args of [[false, false], [false, true], [true, false], [true, true], [true, 2], [false, 0]]) {
        try { const r = (v as any)(...args); if (typeof r === "string") out[`${prefix}${k}(${args})`] = r; } catch {}
      }
    }
  }
};
walk("in.", mod.inboxSql(t)); walk("out.", mod.outboxSql(t));
for (const k of Object.keys(out).sort()) console.log(`=== ${k}\n${out[k].replace(/\s+/g, " ")}`);
