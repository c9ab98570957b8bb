// The core, the backends and the providers are Web-standard: only src/runtime/ may touch node:*, Deno.*, Bun.* or process.
import { expect, test } from "bun:test";
import { readdirSync, readFileSync, statSync } from "node:fs";
import { join } from "node:path";

const root = join(import.meta.dir, "..");

function tsFiles(dir: string): string[] {
  return readdirSync(dir).flatMap((name) => {
    const path = join(dir, name);
    if (statSync(path).isDirectory()) return tsFiles(path);
    return path.endsWith(".ts") ? [path] : [];
  });
}

const FORBIDDEN = [
  { what: "a node: import", pattern: /from\s+["']node:|import\(\s*["']node:/ },
  { what: "the Deno global", pattern: /\bDeno\s*\./ },
  { what: "the Bun global", pattern: /\bBun\s*\./ },
  { what: "the process global", pattern: /\bprocess\s*\.\s*(env|pid|argv|exit|on|hrtime|nextTick)\b/ },
  { what: "a bare Node built-in import", pattern: /from\s+["'](fs|os|path|crypto|events|child_process)["']/ },
];

test("only src/runtime/ touches runtime-specific APIs", () => {
  const offenders: string[] = [];
  const files = [join(root, "mod.ts"), join(root, "testing.ts"), ...tsFiles(join(root, "src")), ...tsFiles(join(root, "backends")), ...tsFiles(join(root, "providers"))];
  expect(files.length).toBeGreaterThan(10);
  for (const file of files) {
    if (file.includes(`${join("src", "runtime")}`)) continue;
    const text = readFileSync(file, "utf8").replace(/\/\*[\s\S]*?\*\/|\/\/.*$/gm, ""); // comments may mention them
    for (const { what, pattern } of FORBIDDEN) {
      if (pattern.test(text)) offenders.push(`${file.slice(root.length + 1)} uses ${what}`);
    }
  }
  expect(offenders).toEqual([]);
});

test("the runtime shim is where they live", () => {
  const shim = readFileSync(join(root, "src", "runtime", "mod.ts"), "utf8");
  expect(shim).toMatch(/node:os/);
  expect(shim).toMatch(/Deno/);
});
