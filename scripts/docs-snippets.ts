/**
 * Type-checks every ```ts / ```typescript snippet of README.md, docs/*.md and docs/<language>/*.md against the package as
 * users get it: the declarations tsup built in dist/, resolved by the subpaths of package.json's
 * "exports" (`@botmesh/durable`, `@botmesh/durable/sqlite`, …); grammy, telegraf, postgres and the
 * other clients resolve from node_modules. Run it after `tsup`:
 *
 *   bun scripts/docs-snippets.ts            # every snippet, one tsc run
 *   bun scripts/docs-snippets.ts docs/x.md  # the snippets of some files only
 *
 * Each snippet is its own module (strict, top-level await allowed), written to
 * .tmp/snippets/<file>_<n>.ts; a failure is reported as `docs/x.md:<line>: <tsc message>`, the line
 * being the markdown line tsc points into.
 *
 * Two explicit markers, to be used sparingly:
 * - ```ts ignore: a fragment that cannot stand alone is not checked (the marker `deno check
 *   --doc-only` honours in the JSDoc examples).
 * - `<!-- snippet-prelude: … -->` on the line right before the fence: declarations the snippet
 *   assumes from the text around it (e.g. `declare const bot: Bot;`), prepended to it for the
 *   check only. Lines of the prelude are not counted in the reported line numbers.
 *
 * The globals of Deno, Cloudflare Workers and Vercel that snippets for those platforms call are
 * declared, minimally, in scripts/.docs-snippets/platform.d.ts.
 *
 * Exits 0 when every snippet checks, 1 otherwise (2 on a bad setup).
 *
 * @module
 */
import { existsSync, mkdirSync, readdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { spawnSync } from "node:child_process";
import { basename, join, relative, resolve } from "node:path";

const root = resolve(import.meta.dirname ?? new URL(".", import.meta.url).pathname, "..");
/** Where the snippets and their tsconfig are written (`DOCS_SNIPPETS_OUT` for another folder). */
const out = process.env.DOCS_SNIPPETS_OUT ? resolve(process.env.DOCS_SNIPPETS_OUT) : join(root, ".tmp", "snippets");

/** One snippet of a markdown file. */
export interface Snippet {
  /** The markdown file, relative to the repository. */
  file: string;
  /** The markdown line of the snippet's first code line (1-based). */
  line: number;
  /** The snippet's code. */
  code: string;
  /** Declarations prepended for the check (`<!-- snippet-prelude: … -->`), or "". */
  prelude: string;
}

const FENCE = /^(\s*)(`{3,}|~{3,})\s*([^`\s]*)(.*)$/;
const PRELUDE = /^\s*<!--\s*snippet-prelude:\s*([\s\S]*?)\s*-->\s*$/;

/**
 * The TypeScript snippets of a markdown text, without those marked `ignore`.
 * @param file the file's name, for the report
 * @param text the markdown
 * @returns the snippets, in order
 */
export function extractSnippets(file: string, text: string): Snippet[] {
  const lines = text.split("\n");
  const snippets: Snippet[] = [];
  for (let i = 0; i < lines.length; i++) {
    const open = FENCE.exec(lines[i]!);
    if (!open) continue;
    const [, indent, fence, lang, rest] = open;
    // The closing fence: the same characters, at least as many, nothing after them.
    let end = i + 1;
    while (end < lines.length) {
      const close = /^\s*(`{3,}|~{3,})\s*$/.exec(lines[end]!);
      if (close && close[1]![0] === fence![0] && close[1]!.length >= fence!.length) break;
      end++;
    }
    const flags = rest!.trim().split(/\s+/).filter(Boolean);
    if ((lang === "ts" || lang === "typescript") && !flags.includes("ignore")) {
      const body = lines.slice(i + 1, end).map((l) => (l.startsWith(indent!) ? l.slice(indent!.length) : l.trimStart()));
      const prelude = i > 0 ? PRELUDE.exec(lines[i - 1]!)?.[1] ?? "" : "";
      snippets.push({ file, line: i + 2, code: body.join("\n"), prelude });
    }
    i = end;
  }
  return snippets;
}

/** `./dist/backends/sqlite/mod.d.ts` for the export `./sqlite`: the module paths tsc maps. */
function exportPaths(): Record<string, string[]> {
  const pkg = JSON.parse(readFileSync(join(root, "package.json"), "utf8")) as {
    name: string;
    exports: Record<string, { types?: string }>;
  };
  const paths: Record<string, string[]> = {};
  for (const [subpath, target] of Object.entries(pkg.exports)) {
    if (typeof target.types !== "string") throw new Error(`package.json exports["${subpath}"] has no "types"`);
    const types = join(root, target.types);
    if (!existsSync(types)) {
      console.error(`docs snippets: ${relative(root, types)} does not exist: build dist/ first (node_modules/.bin/tsup)`);
      process.exit(2);
    }
    paths[pkg.name + subpath.slice(1)] = [types];
  }
  return paths;
}

function markdownFiles(args: string[]): string[] {
  if (args.length > 0) return args.map((a) => relative(root, resolve(a)));
  const docs = readdirSync(join(root, "docs")).filter((n) => n.endsWith(".md")).sort().map((n) => `docs/${n}`);
  // The translations (docs/es/) hold the same kind of snippets.
  const translated = readdirSync(join(root, "docs"), { withFileTypes: true }).filter((d) => d.isDirectory() && d.name !== "grafana")
    .flatMap((d) => readdirSync(join(root, "docs", d.name)).filter((n) => n.endsWith(".md")).sort().map((n) => `docs/${d.name}/${n}`));
  return ["README.md", ...docs, ...translated];
}

function main(): number {
  const files = markdownFiles(process.argv.slice(2));
  const snippets = files.flatMap((file) => extractSnippets(file, readFileSync(join(root, file), "utf8")));
  rmSync(out, { recursive: true, force: true });
  mkdirSync(out, { recursive: true });
  /** The generated file's name → its snippet and the lines added before its code. */
  const sources = new Map<string, { snippet: Snippet; offset: number }>();
  const counts = new Map<string, number>();
  for (const snippet of snippets) {
    const n = (counts.get(snippet.file) ?? 0) + 1;
    counts.set(snippet.file, n);
    const name = `${snippet.file.replace(/\.md$/, "").replace(/[^A-Za-z0-9]+/g, "_")}_${n}.ts`;
    const head = snippet.prelude === "" ? [] : [`// prelude (${snippet.file}): ${snippet.prelude}`, snippet.prelude];
    writeFileSync(join(out, name), [...head, snippet.code, ""].join("\n"));
    sources.set(name, { snippet, offset: head.length });
  }
  const tsconfig = {
    compilerOptions: {
      target: "es2022",
      module: "esnext",
      moduleResolution: "bundler",
      lib: ["es2022", "dom", "dom.iterable"],
      types: ["bun"],
      strict: true,
      noEmit: true,
      isolatedModules: true,
      moduleDetection: "force",
      allowImportingTsExtensions: true,
      // The package's own declarations are checked by the build and the pack smoke; here, the snippets.
      skipLibCheck: true,
      baseUrl: root,
      paths: exportPaths(),
    },
    files: [join(root, "scripts", ".docs-snippets", "platform.d.ts"), ...sources.keys()],
  };
  writeFileSync(join(out, "tsconfig.json"), JSON.stringify(tsconfig, null, 2));
  const tsc = spawnSync(join(root, "node_modules", ".bin", "tsc"), ["-p", join(out, "tsconfig.json"), "--pretty", "false"], {
    cwd: root,
    encoding: "utf8",
  });
  if (tsc.error) throw tsc.error;
  const output = `${tsc.stdout}${tsc.stderr}`;
  const failures: string[] = [];
  // `.tmp/snippets/docs_api_1.ts(12,5): error TS2304: Cannot find name 'x'.` and its continuation lines.
  for (const entry of output.split(/\n(?=\S)/)) {
    if (entry.trim() === "") continue;
    const m = /^(.*?)\((\d+),(\d+)\): (error TS\d+: [\s\S]*)$/.exec(entry.trim());
    const source = m ? sources.get(basename(m[1]!)) : undefined;
    if (!m || !source) {
      failures.push(entry.trim());
      continue;
    }
    const codeLine = Number(m[2]) - source.offset;
    const where = codeLine >= 1 ? source.snippet.line + codeLine - 1 : source.snippet.line;
    failures.push(`${source.snippet.file}:${where}: ${codeLine >= 1 ? "" : "(in its prelude) "}${m[4]!.trim()}`);
  }
  if (tsc.status !== 0 && failures.length === 0) failures.push(`tsc exited with ${tsc.status}`);
  if (failures.length > 0) {
    console.error(failures.join("\n"));
    console.error(`\ndocs snippets: ${failures.length} error(s) in ${snippets.length} snippets of ${files.length} files (sources in ${relative(root, out)}/)`);
    return 1;
  }
  console.log(`docs snippets: ${snippets.length} snippets of ${files.length} files type-check against dist/`);
  return 0;
}

if (import.meta.main) process.exit(main());
