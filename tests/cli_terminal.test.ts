// botmesh-durable prints journal data (ids, keys, chat ids, message and error text) without its terminal control
// characters: every C0 control (a newline inside a field too), DEL, C1, the format characters (bidi controls,
// zero-width characters) and the line and paragraph separators come out as \u escapes, in the human output and on
// stderr; --json stays valid JSON and parses back to the stored text. Run as a process, but for the last tests.
import { afterAll, expect, test } from "bun:test";
import { Database } from "bun:sqlite";
import { mkdirSync, rmSync } from "node:fs";
import { join } from "node:path";
import { MemoryDurability } from "../backends/memory/durability.ts";
import { SQLiteDurability } from "../backends/sqlite/durability.ts";
import { runCli } from "../src/ops/cli.ts";
import { escapeControls } from "../src/ops/terminal_text.ts";
import { OWNER } from "./support/cli_fill.ts";
import { runId } from "./support/services.ts";
import { type CliRun, runCliProcess } from "./support/cli_process.ts";

const root = join(import.meta.dir, "..");
const tmp = join(root, ".tmp", `cli-terminal-${runId()}`);
mkdirSync(tmp, { recursive: true });
afterAll(() => rmSync(tmp, { recursive: true, force: true }));

/** Clear the screen, retitle the window, return to the line's start, an 8-bit CSI, a right-to-left override, a newline. */
const EVIL = "a\x1b[2Jb\x1b]0;title\x07c\rd\x9b31me\u202ef\ng\x7fh\t";
/** Every character a terminal may act on, but the newline that ends the output's lines. */
const RAW_CONTROL = /[\u0000-\u0009\u000b-\u001f\u007f-\u009f\u202a-\u202e\u2066-\u2069]/;

const cli = (args: string[]): Promise<CliRun> => runCliProcess(tmp, args);

test("escapeControls: C0 (the newline too, unless kept), DEL, C1 and bidi controls as \\u escapes; other text as it is", () => {
  expect(escapeControls(EVIL)).toBe(
    "a\\u001b[2Jb\\u001b]0;title\\u0007c\\u000dd\\u009b31me\\u202ef\\u000ag\\u007fh\\u0009",
  );
  expect(escapeControls("one\ntwo\x1b", true)).toBe("one\ntwo\\u001b");
  expect(escapeControls("ünïcode … 😀 \u00a0 عربي")).toBe("ünïcode … 😀 \u00a0 عربي");
  expect(escapeControls("a\u2028b\u2029c")).toBe("a\\u2028b\\u2029c");
  // An astral format character (a tag character) as its two UTF-16 units, as JSON writes one.
  expect(escapeControls("x\u{e0041}")).toBe("x\\udb40\\udc41");
  // Inside a JSON string the escapes are JSON's own: the text parses back.
  expect(JSON.parse(escapeControls(JSON.stringify(EVIL)))).toBe(EVIL);
});

test("every command prints stored control characters escaped, on stdout and stderr; --json parses back to the stored text", async () => {
  const file = join(tmp, "evil.db");
  const backend = new SQLiteDurability({ file });
  await backend.open();
  const id = `in-${EVIL}`;
  const chatId = `chat-${EVIL}`;
  await backend.inbox.admit({ id, kind: "message", chatId, provider: "mock", payload: { text: EVIL }, receivedAt: Date.now() });
  const claim = await backend.inbox.claim(id, OWNER);
  await backend.inbox.start(id, claim!.lease!.token, 1);
  await backend.inbox.fail(id, claim!.lease!.token, { error: `Error: ${EVIL}`, dead: true });
  const key = `out-${EVIL}`;
  const reserved = await backend.outbox.reserve({ key, chatId, content: { text: EVIL }, contentHash: "h", inboundId: id }, OWNER);
  await backend.outbox.markFailed(key, reserved.entry.lease!.token, { error: `ProviderError: ${EVIL}`, ambiguous: true });
  await backend.outbox.reserve({ key: `damaged-${EVIL}`, chatId, content: { text: "x" }, contentHash: "h2", inboundId: null }, OWNER);
  await backend.close();
  const raw = new Database(file);
  raw.prepare(`UPDATE botmesh_outbox SET content = '{"text":' WHERE key = ?`).run(`damaged-${EVIL}`);
  raw.close();

  const b = ["-b", `sqlite:${file}`];
  // A read sets the damaged row aside; the damaged command lists it after that.
  expect((await cli([...b, "list", "outbox", "--json"])).code).toBe(0);
  const human = [
    ["list", "inbox"],
    ["list", "outbox"],
    ["list", "outbox", "--chat", chatId],
    ["show", "inbox", id],
    ["show", "outbox", key],
    ["damaged"],
    ["stats"],
  ];
  const refused = [
    ["show", "inbox", `missing-${EVIL}`],
    ["show", "outbox", `damaged-${EVIL}`],
    ["replay", `missing-${EVIL}`],
    ["retry", `missing-${EVIL}`],
    ["discard", `missing-${EVIL}`],
    ["list", "inbox", "--state", EVIL],
  ];
  const json = [
    ["list", "inbox", "--json"],
    ["show", "outbox", key, "--json"],
    ["damaged", "--json"],
    ["replay", `missing-${EVIL}`, "--json"],
  ];
  const runs = await Promise.all([...human, ...refused, ...json].map((args) => cli([...b, ...args])));
  for (const [i, args] of [...human, ...refused, ...json].entries()) {
    const r = runs[i]!;
    expect({ args, stdout: RAW_CONTROL.exec(r.stdout)?.[0] ?? null }).toEqual({ args, stdout: null });
    expect({ args, stderr: RAW_CONTROL.exec(r.stderr)?.[0] ?? null }).toEqual({ args, stderr: null });
  }
  const [listIn, listOut, byChat, showIn, showOut, damaged] = runs;
  const escaped = escapeControls(EVIL);
  expect([listIn!.code, listIn!.stderr]).toEqual([0, ""]);
  expect(listIn!.stdout).toContain(`in-${escaped.slice(0, 20)}`);
  expect(listOut!.stdout).toContain(`out-${escaped.slice(0, 20)}`);
  expect(listOut!.stdout).toContain("unknown");
  expect(byChat!.stdout).toContain("(1)\n");
  // show: one line per field; a journaled error keeps its own lines, indented, so none of them passes for a field.
  expect(showIn!.code).toBe(0);
  expect(showIn!.stdout.startsWith(`id: ${escapeControls(id)}\n`)).toBe(true);
  expect(showIn!.stdout).toContain(`\nchatId: ${escapeControls(chatId)}\n`);
  expect(showIn!.stdout).toContain(`\nerror: Error: ${escapeControls(EVIL.split("\n")[0]!)}\n  ${escapeControls(EVIL.split("\n")[1]!)}\n`);
  expect(showOut!.stdout).toMatch(/\nstate: unknown\n/);
  expect(damaged!.code).toBe(0);
  expect(damaged!.stdout).toContain(`outbox   damaged-${escaped.slice(0, 12)}`);

  const missing = runs.slice(human.length, human.length + refused.length);
  for (const r of missing) expect(r.code).toBeGreaterThan(0);
  expect(missing[0]!.stderr).toContain(`Inbox record "missing-a\\u001b[2Jb`);
  expect(missing[1]!.stderr).toContain("is damaged and set aside");

  const [listJson, showJson, damagedJson, replayJson] = runs.slice(human.length + refused.length);
  expect(listJson!.code).toBe(0);
  const records = JSON.parse(listJson!.stdout);
  expect([records[0].id, records[0].chatId, records[0].payload.text, records[0].error]).toEqual([id, chatId, EVIL, `Error: ${EVIL}`]);
  expect(JSON.parse(showJson!.stdout)).toMatchObject({ key, chatId, content: { text: EVIL }, error: `ProviderError: ${EVIL}` });
  // Each line of show that is not indented is one field of the entry, each field once.
  const fields = showOut!.stdout.split("\n").filter((l) => l !== "" && !l.startsWith(" ")).map((l) => l.slice(0, l.indexOf(":")));
  expect(fields).toEqual(Object.keys(JSON.parse(showJson!.stdout)));
  expect(JSON.parse(damagedJson!.stdout)).toMatchObject([{ journal: "outbox", id: `damaged-${EVIL}` }]);
  expect(replayJson!.code).toBe(1);
  expect(JSON.parse(replayJson!.stdout)).toMatchObject({ id: `missing-${EVIL}`, ok: false });
}, 60_000);

/** Format characters that a terminal shows as nothing, or that steer the bidi algorithm. */
const INVISIBLE = ["\u061c", "\u200e", "\u200f", "\u200b", "\u200c", "\u200d", "\u2060", "\u2064", "\ufeff", "\u00ad"];

/** Run the command line in this process on `backend`; everything it writes, stdout and stderr. */
async function cliOn(backend: MemoryDurability, args: string[]): Promise<string> {
  const outs: string[] = [];
  const io = { stdout: (t: string) => void outs.push(t), stderr: (t: string) => void outs.push(t) };
  await runCli(["-b", "memory:", ...args], io, { open: async () => ({ backend, description: "memory", close: async () => {} }) });
  return outs.join("");
}

test("escapeControls: every Bidi_Control and zero-width format character, so that 42 and 42\\u200b print apart", () => {
  for (const c of INVISIBLE) {
    const code = c.charCodeAt(0).toString(16).padStart(4, "0");
    expect({ code, out: escapeControls(`a${c}b`) }).toEqual({ code, out: `a\\u${code}b` });
  }
});

test("list and show print no invisible character of journal data raw: a look-alike chat id or key reads apart", async () => {
  const backend = new MemoryDurability();
  for (const c of INVISIBLE) {
    await backend.inbox.admit({ id: `in-42${c}`, kind: "message", chatId: `42${c}`, provider: "mock", payload: { text: `hi${c}` }, receivedAt: Date.now() });
  }
  await backend.outbox.reserve({ key: "out\u200f-1", chatId: "42\u200b", content: { text: "x\u200e" }, contentHash: "h", inboundId: null }, OWNER);
  const runs = [["list", "inbox"], ["list", "outbox"], ["show", "inbox", "in-42\u200f"], ["show", "outbox", "out\u200f-1"], ["list", "inbox", "--json"]];
  const outs: string[] = [];
  for (const args of runs) outs.push(await cliOn(backend, args));
  const raw = INVISIBLE.filter((c) => outs.join("").includes(c)).map((c) => c.charCodeAt(0).toString(16));
  expect(raw).toEqual([]);
  expect(outs[1]).toMatch(/\nout\\u200f-1 +sending +42\\u200b /);
  expect(outs[3]).toContain("\nchatId: 42\\u200b\n");
  expect(JSON.parse(outs[4]!).map((r: { chatId: string }) => r.chatId).sort()).toEqual(INVISIBLE.map((c) => `42${c}`).sort());
});

test("show: a long run of spaces in a field is folded, so that what follows cannot wrap to pass for another field", async () => {
  const backend = new MemoryDurability();
  const pad = " ".repeat(200);
  await backend.inbox.admit({ id: "pad", kind: "message", chatId: "c", provider: "mock", payload: { text: `hi${pad}state: done` }, receivedAt: Date.now() });
  const key = "pad-out";
  await backend.outbox.reserve({ key, chatId: `c${pad}state: sent`, content: { text: "x" }, contentHash: "h", inboundId: null }, OWNER);
  const entry = await backend.outbox.get(key);
  await backend.outbox.markFailed(key, entry!.lease!.token, { error: `Error: one\n${"\u00a0".repeat(90)}state: sent`, ambiguous: true });
  const out = await cliOn(backend, ["show", "outbox", key]);
  expect(/\p{Zs}{8,}/u.test(out)).toBe(false);
  expect(out).toContain("\nchatId: c⟨200 spaces⟩state: sent\n");
  expect(out).toContain("\nerror: Error: one\n  ⟨90 spaces⟩state: sent\n");
  // The indentation of a payload's JSON stays; a run inside one of its strings is folded.
  const inbound = await cliOn(backend, ["show", "inbox", "pad"]);
  expect(inbound).toContain(`\npayload: {\n    "text": "hi⟨200 spaces⟩state: done"\n  }\n`);
  // --json stays exact.
  expect(JSON.parse(await cliOn(backend, ["show", "outbox", key, "--json"])).chatId).toBe(`c${pad}state: sent`);
});
