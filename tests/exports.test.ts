/**
 * The export maps of package.json (npm, built files in dist/), deno.json
 * (Deno's config, which `deno publish` and Deno's `links` read) and jsr.json
 * (the JSR manifest, source files) must describe the same package.
 */
import { describe, expect, test } from "bun:test";
import { existsSync, readdirSync, readFileSync } from "node:fs";
import { fileURLToPath } from "node:url";

const root: string = fileURLToPath(new URL("..", import.meta.url));

interface Manifest {
  name?: string;
  version?: string;
  exports?: string | Record<string, unknown>;
}

function load(file: string): Manifest {
  return JSON.parse(readFileSync(root + file, "utf8")) as Manifest;
}

/** Normalizes an exports field to a subpath → target map. */
function exportMap(file: string, m: Manifest): Record<string, unknown> {
  if (m.exports === undefined) throw new Error(`${file} has no "exports"`);
  return typeof m.exports === "string" ? { ".": m.exports } : m.exports;
}

/** `./dist/testing.js` → `./testing.ts` */
function sourceOf(distPath: string): string {
  const m = /^\.\/dist\/(.+)\.js$/.exec(distPath);
  if (!m) throw new Error(`not a ./dist/*.js path: ${distPath}`);
  return `./${m[1]}.ts`;
}

const pkg = load("package.json");
const deno = load("deno.json");
const jsr = load("jsr.json");
const pkgExports = exportMap("package.json", pkg);
const others = { "deno.json": deno, "jsr.json": jsr } as const;
/** JSR-only entries: `deno run -A jsr:@botmesh/durable/cli` runs the CLI; npm users have the `bin`, and an import of it would run it. */
const JSR_ONLY: readonly string[] = ["./cli"];

describe("package manifests agree", () => {
  test("name and version agree in package.json, deno.json and jsr.json", () => {
    for (const [file, m] of Object.entries(others)) {
      expect(m.name, `${file} "name" differs from package.json`).toBe(pkg.name);
      expect(m.version, `${file} "version" differs from package.json`).toBe(pkg.version);
    }
  });

  for (const [subpath, target] of Object.entries(pkgExports)) {
    test(`package.json export "${subpath}" matches deno.json and jsr.json`, () => {
      const t = target as { import?: string; types?: string };
      expect(typeof t.import, `package.json exports["${subpath}"].import must be a string`).toBe("string");
      const source = sourceOf(t.import!);
      const types = t.import!.replace(/\.js$/, ".d.ts");
      expect(t.types, `package.json exports["${subpath}"].types should be ${types}`).toBe(types);
      for (const [file, m] of Object.entries(others)) {
        const map = exportMap(file, m);
        expect(subpath in map, `${file} is missing export "${subpath}" (package.json has it → ${source})`).toBe(true);
        expect(map[subpath], `${file} export "${subpath}" should map to ${source} (package.json: ${t.import})`).toBe(source);
      }
    });
  }

  for (const [file, m] of Object.entries(others)) {
    test(`${file} has no export missing from package.json, and its files exist`, () => {
      for (const [subpath, source] of Object.entries(exportMap(file, m))) {
        if (!JSR_ONLY.includes(subpath)) {
          expect(subpath in pkgExports, `${file} export "${subpath}" (${String(source)}) is missing from package.json`).toBe(true);
        }
        expect(existsSync(root + String(source)), `${file} export "${subpath}": file ${String(source)} does not exist`).toBe(true);
      }
    });
  }
});

describe("the export maps cover the tree", () => {
  const sources = new Set(Object.values(exportMap("deno.json", deno)).map(String));

  test("every backends/<name>/mod.ts and providers/<name>/mod.ts is exported", () => {
    const entries: string[] = [];
    for (const dir of ["backends", "providers"]) {
      for (const name of readdirSync(root + dir)) {
        if (existsSync(`${root}${dir}/${name}/mod.ts`)) entries.push(`./${dir}/${name}/mod.ts`);
      }
    }
    expect(entries.length).toBeGreaterThanOrEqual(9);
    expect(entries.filter((e) => !sources.has(e))).toEqual([]);
  });

  /** The backend opener of the CLI (exported by ./ops) and the checks it makes: the backends' loose modules. */
  const OPENER = ["./backends/open_url.ts", "./backends/open_checks.ts"];

  test("only the entries of the package sit at the top level of backends/ and providers/", () => {
    const loose = ["backends", "providers"].flatMap((dir) =>
      readdirSync(root + dir).filter((n) => n.endsWith(".ts")).map((n) => `./${dir}/${n}`).filter((p) => !sources.has(p) && !OPENER.includes(p))
    );
    expect(loose).toEqual([]);
  });

  test("deno.json publishes every exported file and package.json ships dist/", () => {
    const include = (deno as { publish?: { include?: string[] } }).publish?.include ?? [];
    for (const source of sources) {
      const file = source.slice(2);
      expect(include.some((i) => i === file || (i.endsWith("/") && file.startsWith(i))), `deno.json publish.include misses ${file}`).toBe(true);
    }
    expect((pkg as { files?: string[] }).files).toContain("dist");
  });

  test("jsr.json and deno.json agree on the whole JSR manifest (exports, license, publish include and exclude)", () => {
    const fields = (m: Manifest) => {
      const { name, version, exports, license, publish } = m as Manifest & { license?: string; publish?: unknown };
      return { name, version, exports, license, publish };
    };
    expect(fields(jsr)).toEqual(fields(deno));
    expect(Object.keys(jsr).filter((k) => !["name", "version", "exports", "license", "publish"].includes(k)), "jsr.json holds the JSR fields only").toEqual([]);
  });
});

test("the CLI: the npm bin (a file with side effects) and the JSR ./cli entry run the same cli.ts", () => {
  expect((pkg as { bin?: Record<string, string> }).bin).toEqual({ "botmesh-durable": "./dist/cli.js" });
  expect((pkg as { sideEffects?: unknown }).sideEffects).toEqual(["./dist/cli.js"]);
  expect(exportMap("deno.json", deno)["./cli"]).toBe("./cli.ts");
  expect("./cli" in pkgExports).toBe(false);
});

test("the root entry holds the bot author's API only: nothing of ./ops, ./testing or ./backend", async () => {
  const [root, ops, testing, backend] = await Promise.all([
    import("../mod.ts"),
    import("../ops.ts"),
    import("../testing.ts"),
    import("../backend.ts"),
  ]);
  const names = Object.keys(root);
  expect(names).toContain("Bot");
  expect(names).toContain("MemoryDurability");
  for (const [entry, mod] of [["./ops", ops], ["./testing", testing], ["./backend", backend]] as const) {
    expect(names.filter((name) => name in mod), `root values also exported by ${entry}`).toEqual([]);
  }
  // Values only: types vanish at run time. The root stays small enough to read in one screen.
  expect(names.length).toBeLessThanOrEqual(25);
});

test("./grammy: grammy is an optional peer dependency, imported for its types only", async () => {
  const manifest = pkg as { peerDependencies?: Record<string, string>; peerDependenciesMeta?: Record<string, { optional?: boolean }> };
  expect(manifest.peerDependencies?.grammy).toBeDefined();
  expect(manifest.peerDependenciesMeta?.grammy?.optional).toBe(true);
  expect(exportMap("deno.json", deno)["./grammy"]).toBe("./providers/grammy/mod.ts");
  const dir = root + "providers/grammy/";
  for (const name of readdirSync(dir).filter((n) => n.endsWith(".ts"))) {
    const code = readFileSync(dir + name, "utf8");
    const imports = [...code.matchAll(/^import\s+(type\s+)?[^;]*?from\s+["']([^"']+)["']/gm)];
    for (const [, isType, from] of imports) {
      if (from === "grammy" || from!.startsWith("grammy/") || from!.startsWith("@grammyjs/")) {
        expect(isType, `providers/grammy/${name} imports ${from} at run time`).toBe("type ");
      }
    }
  }
  const entry = await import("../providers/grammy/mod.ts");
  expect(Object.keys(entry).sort()).toEqual(["DurableGrammy", "classifyGrammyError", "durable", "durableConversations", "durableStorage", "isJournaledMethod"]);
});

test("./telegraf: telegraf is an optional peer dependency, imported for its types only", async () => {
  const manifest = pkg as { peerDependencies?: Record<string, string>; peerDependenciesMeta?: Record<string, { optional?: boolean }> };
  expect(manifest.peerDependencies?.telegraf).toBeDefined();
  expect(manifest.peerDependenciesMeta?.telegraf?.optional).toBe(true);
  expect(exportMap("deno.json", deno)["./telegraf"]).toBe("./providers/telegraf/mod.ts");
  const dir = root + "providers/telegraf/";
  for (const name of readdirSync(dir).filter((n) => n.endsWith(".ts"))) {
    const code = readFileSync(dir + name, "utf8");
    expect(code, `providers/telegraf/${name} loads a module at run time`).not.toMatch(/import\(/);
    const imports = [...code.matchAll(/^import\s+(type\s+)?[^;]*?from\s+["']([^"']+)["']/gm)];
    for (const [, isType, from] of imports) {
      if (from === "telegraf" || from!.startsWith("telegraf/") || from!.startsWith("@telegraf/")) {
        expect(isType, `providers/telegraf/${name} imports ${from} at run time`).toBe("type ");
      }
    }
  }
  const entry = await import("../providers/telegraf/mod.ts");
  expect(Object.keys(entry).sort()).toEqual(["DurableTelegraf", "TelegrafApiError", "classifyTelegrafError", "durable", "durableStorage", "isJournaledMethod"]);
});

test("./builderbot: @builderbot/bot is an optional peer dependency, loaded by the provider module alone (its ProviderClass)", async () => {
  const manifest = pkg as { peerDependencies?: Record<string, string>; peerDependenciesMeta?: Record<string, { optional?: boolean }> };
  expect(manifest.peerDependencies?.["@builderbot/bot"]).toBeDefined();
  expect(manifest.peerDependenciesMeta?.["@builderbot/bot"]?.optional).toBe(true);
  expect(exportMap("deno.json", deno)["./builderbot"]).toBe("./providers/builderbot/mod.ts");
  const dir = root + "providers/builderbot/";
  for (const name of readdirSync(dir).filter((n) => n.endsWith(".ts"))) {
    const code = readFileSync(dir + name, "utf8");
    expect(code, `providers/builderbot/${name} loads a module at run time`).not.toMatch(/import\(/);
    const imports = [...code.matchAll(/^import\s+(type\s+)?([^;]*?)from\s+["']([^"']+)["']/gm)];
    for (const [, isType, what, from] of imports) {
      if (from!.startsWith("@builderbot/")) {
        // Only ProviderClass, which BuilderBot's createBot needs its provider to extend, and utils (its custom events).
        if (isType !== "type ") expect([name, what!.trim()]).toEqual(["provider.ts", "{ ProviderClass, utils }"]);
      }
    }
  }
  // Nothing else of the package loads BuilderBot.
  for (const dir of ["src", "providers/whatsapp", "providers/grammy", "providers/telegraf", "providers/telegram", "backends"]) {
    for (const name of readdirSync(root + dir, { recursive: true }).map(String).filter((n) => n.endsWith(".ts"))) {
      expect(readFileSync(`${root}${dir}/${name}`, "utf8"), `${dir}/${name} mentions @builderbot`).not.toMatch(/from\s+["']@builderbot/);
    }
  }
  const entry = await import("../providers/builderbot/mod.ts");
  expect(Object.keys(entry).sort()).toEqual(["DurableBuilderBotDatabase", "DurableBuilderBotState", "DurableMetaProvider", "bodyOf", "whatsAppContent"]);
});

test("./baileys: baileys is an optional peer dependency, and nothing of it is imported (the socket is typed structurally)", async () => {
  const manifest = pkg as { peerDependencies?: Record<string, string>; peerDependenciesMeta?: Record<string, { optional?: boolean }> };
  expect(manifest.peerDependencies?.baileys).toBeDefined();
  expect(manifest.peerDependenciesMeta?.baileys?.optional).toBe(true);
  expect(exportMap("deno.json", deno)["./baileys"]).toBe("./providers/baileys/mod.ts");
  const dir = root + "providers/baileys/";
  for (const name of readdirSync(dir).filter((n) => n.endsWith(".ts"))) {
    const code = readFileSync(dir + name, "utf8");
    expect(code, `providers/baileys/${name} loads a module at run time`).not.toMatch(/import\(/);
    const imports = [...code.matchAll(/^import\s+(?:type\s+)?[^;]*?from\s+["']([^"']+)["']/gm)].map((m) => m[1]!);
    expect(imports.filter((from) => !from.startsWith(".")), `providers/baileys/${name} imports a package`).toEqual([]);
  }
  const entry = await import("../providers/baileys/mod.ts");
  expect(Object.keys(entry).sort()).toEqual(["BAILEYS_STATUS", "BaileysProvider", "baileysMessageIdFor", "classifyBaileysError", "messageKeyId"]);
});
