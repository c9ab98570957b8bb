// scripts/docs-snippets.ts: which fenced blocks of a markdown file are type-checked, with what
// prelude, and at which markdown line each starts (the line its errors are reported against).
import { expect, test } from "bun:test";
import { existsSync, mkdirSync, rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { extractSnippets } from "../scripts/docs-snippets.ts";

test("ts and typescript blocks are extracted with their first code line; ignore, other languages and inner fences are not", () => {
  const md = [
    "# Title", // 1
    "```ts", // 2
    'import { Bot } from "@botmesh/durable";', // 3
    "```", // 4
    "```sh", // 5
    "npm i @botmesh/durable", // 6
    "```", // 7
    "```ts ignore", // 8
    "bot.when(TEXT, handler);", // 9
    "```", // 10
    "- a list item:", // 11
    "  ```typescript", // 12
    "  const a = 1;", // 13
    "    const b = 2;", // 14
    "  ```", // 15
    "````md", // 16
    "```ts", // 17
    "not a snippet: inside another fence", // 18
    "```", // 19
    "````", // 20
  ].join("\n");
  expect(extractSnippets("docs/x.md", md)).toEqual([
    { file: "docs/x.md", line: 3, code: 'import { Bot } from "@botmesh/durable";', prelude: "" },
    { file: "docs/x.md", line: 13, code: "const a = 1;\n  const b = 2;", prelude: "" },
  ]);
});

test("a snippet-prelude comment right before the fence is the snippet's prelude", () => {
  const md = [
    "Some text.",
    '<!-- snippet-prelude: import type { Bot } from "@botmesh/durable"; declare const bot: Bot; -->',
    "```ts",
    "await bot.start();",
    "```",
    "<!-- snippet-prelude: declare const x: number; -->",
    "",
    "```ts",
    "x;",
    "```",
  ].join("\n");
  const snippets = extractSnippets("README.md", md);
  expect(snippets.map((s) => [s.line, s.prelude])).toEqual([
    [4, 'import type { Bot } from "@botmesh/durable"; declare const bot: Bot;'],
    // Not right before the fence: no prelude.
    [9, ""],
  ]);
});

const root = join(import.meta.dir, "..");
const built = existsSync(join(root, "dist", "mod.d.ts"));

// Against dist/'s declarations: needs the build (npm test runs the whole check after tsup).
test.skipIf(!built)("the check reports a broken snippet at its markdown line and passes a valid one", () => {
  const dir = join(root, ".tmp", `docs-snippets-test-${process.pid}`);
  mkdirSync(dir, { recursive: true });
  try {
    const good = ["# Good", "```ts", 'import { Bot, MemoryDurability } from "@botmesh/durable";', "const backend = new MemoryDurability();", "```", ""];
    const broken = [...good, "```ts", 'import { Bot } from "@botmesh/durable";', "new Bot({ provider: nope });", "```", ""];
    writeFileSync(join(dir, "good.md"), good.join("\n"));
    writeFileSync(join(dir, "broken.md"), broken.join("\n"));
    const run = (file: string) => Bun.spawnSync([process.execPath, join(root, "scripts", "docs-snippets.ts"), join(dir, file)], {
      cwd: root,
      env: { ...process.env, DOCS_SNIPPETS_OUT: join(dir, "out") },
    });
    const ok = run("good.md");
    expect(ok.stdout.toString()).toContain("docs snippets: 1 snippets of 1 files type-check");
    expect(ok.exitCode).toBe(0);
    const bad = run("broken.md");
    const rel = `.tmp/docs-snippets-test-${process.pid}/broken.md`;
    expect(bad.stderr.toString()).toContain(`${rel}:9: error TS2304: Cannot find name 'nope'.`);
    expect(bad.exitCode).toBe(1);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}, 60_000);
