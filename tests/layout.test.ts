// The layers point one way: runtime shim ← core (src/) ← backends, providers ← the package entries.
// Only src/runtime/ may touch node:*, Deno.*, Bun.* or process; nothing in src/ imports a backend or a provider.
import { expect, test } from "bun:test";
import { readdirSync, readFileSync, statSync } from "node:fs";
import { join, relative, resolve } from "node:path";

const root = join(import.meta.dir, "..");

function tsFiles(dir: string): string[] {
  return readdirSync(dir).flatMap((name) => {
    const path = join(dir, name);
    if (statSync(path).isDirectory()) return tsFiles(path);
    return path.endsWith(".ts") ? [path] : [];
  });
}

function code(file: string): string {
  return readFileSync(file, "utf8").replace(/\/\*[\s\S]*?\*\/|\/\/.*$/gm, ""); // comments may mention anything
}

/** The relative specifiers a file imports or re-exports, resolved to paths under the root. */
function importsOf(file: string): string[] {
  const out: string[] = [];
  for (const m of code(file).matchAll(/(?:from|import)\s*\(?\s*["'](\.{1,2}\/[^"']+)["']/g)) {
    out.push(relative(root, resolve(file, "..", m[1]!)));
  }
  return out;
}

const ENTRIES = ["mod.ts", "backend.ts", "provider.ts", "ops.ts", "testing.ts", "cli.ts"].map((f) => join(root, f));

const FORBIDDEN = [
  { what: "a node: import", pattern: /from\s+["']node:|import\(\s*["']node:/ },
  { what: "the Deno global", pattern: /\bDeno\s*\./ },
  { what: "the Bun global", pattern: /\bBun\s*\./ },
  { what: "the process global", pattern: /\bprocess\s*\.\s*(env|pid|argv|exit|on|hrtime|nextTick)\b/ },
  { what: "a bare Node built-in import", pattern: /from\s+["'](fs|os|path|crypto|events|child_process)["']/ },
];

test("only src/runtime/ touches runtime-specific APIs", () => {
  const offenders: string[] = [];
  const files = [...ENTRIES, ...tsFiles(join(root, "src")), ...tsFiles(join(root, "backends")), ...tsFiles(join(root, "providers"))];
  expect(files.length).toBeGreaterThan(10);
  for (const file of files) {
    if (file.startsWith(join(root, "src", "runtime"))) continue;
    const text = code(file);
    for (const { what, pattern } of FORBIDDEN) {
      if (pattern.test(text)) offenders.push(`${relative(root, file)} uses ${what}`);
    }
  }
  expect(offenders).toEqual([]);
});

test("nothing published imports @opentelemetry: the user passes a tracer in (durability.tracer)", () => {
  const files = [...ENTRIES, ...tsFiles(join(root, "src")), ...tsFiles(join(root, "backends")), ...tsFiles(join(root, "providers"))];
  const pattern = /from\s+["']@opentelemetry\/|import\(\s*["']@opentelemetry\//;
  expect(files.filter((file) => pattern.test(code(file))).map((file) => relative(root, file))).toEqual([]);
});

test("the core (src/) imports no backend, no provider and no package entry", () => {
  const offenders: string[] = [];
  const files = tsFiles(join(root, "src"));
  expect(files.length).toBeGreaterThan(30);
  for (const file of files) {
    for (const target of importsOf(file)) {
      if (!target.startsWith("src/")) offenders.push(`${relative(root, file)} imports ${target}`);
    }
  }
  expect(offenders).toEqual([]);
});

test("providers import no backend, and backends import no provider", () => {
  const offenders: string[] = [];
  for (const [dir, other] of [["providers", "backends/"], ["backends", "providers/"]] as const) {
    for (const file of tsFiles(join(root, dir))) {
      for (const target of importsOf(file)) {
        if (target.startsWith(other)) offenders.push(`${relative(root, file)} imports ${target}`);
      }
    }
  }
  expect(offenders).toEqual([]);
});

test("a backend folder's internals are imported only through its mod.ts from outside the backends", () => {
  // Tests and benches may reach into internals; the package's other code goes through the entry.
  const offenders: string[] = [];
  for (const file of [...tsFiles(join(root, "providers")), ...ENTRIES.filter((f) => !f.endsWith("testing.ts") && !f.endsWith("cli.ts") && !f.endsWith("ops.ts"))]) {
    for (const target of importsOf(file)) {
      if (/^backends\/[^/]+\/(?!mod\.ts$)/.test(target)) offenders.push(`${relative(root, file)} imports ${target}`);
    }
  }
  expect(offenders).toEqual([]);
});

test("the runtime shim is where they live", () => {
  const shim = readFileSync(join(root, "src", "runtime", "mod.ts"), "utf8");
  expect(shim).toMatch(/node:os/);
  expect(shim).toMatch(/Deno/);
});
