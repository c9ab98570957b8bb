// The state table (src/machine.ts) is the one source of the journals' states: the diagrams of
// docs/architecture.md are drawn from it, and the SQL, Lua and operator sources name no state set by hand.
import { expect, test } from "bun:test";
import { readdirSync, readFileSync, statSync } from "node:fs";
import { join, relative } from "node:path";
import {
  INBOX,
  INBOX_MACHINE,
  INBOX_STATES,
  luaSet,
  mermaidDiagram,
  OUTBOX,
  OUTBOX_MACHINE,
  OUTBOX_STATES,
  sqlByDue,
  sqlIn,
  sqlNotIn,
  statesWhere,
} from "../src/machine.ts";
import { DOC, withDiagrams } from "../scripts/state_diagram.ts";

const root = join(import.meta.dir, "..");

test("the diagrams in docs/architecture.md are the ones the state table draws", () => {
  const doc = readFileSync(DOC, "utf8");
  const want = withDiagrams(doc);
  if (doc !== want) {
    const a = doc.split("\n");
    const b = want.split("\n");
    const diff: string[] = [];
    for (let i = 0; i < Math.max(a.length, b.length); i++) {
      if (a[i] !== b[i]) diff.push(`line ${i + 1}:\n  doc:   ${a[i] ?? "(none)"}\n  table: ${b[i] ?? "(none)"}`);
    }
    throw new Error(
      `docs/architecture.md: the state diagrams differ from src/machine.ts; regenerate them with ` +
        `\`node_modules/.bin/bun scripts/state_diagram.ts --write\`\n${diff.slice(0, 20).join("\n")}`,
    );
  }
  expect(mermaidDiagram(OUTBOX_MACHINE)).toContain("unknown --> sent: markSent, markDelivered");
});

test("the table is consistent: every transition's states exist, leased states are due when their lease lapses", () => {
  for (const machine of [INBOX_MACHINE, OUTBOX_MACHINE] as const) {
    const states = Object.keys(machine.states);
    for (const [name, t] of Object.entries(machine.transitions)) {
      for (const s of [...t.from, ...Object.values(t.to)]) {
        expect(s === "deleted" || states.includes(s), `${machine.journal}.${name}: state ${s}`).toBe(true);
      }
    }
    for (const [s, traits] of Object.entries(machine.states)) {
      expect(traits.leased === (traits.due === "leaseExpiry"), `${machine.journal} ${s}: leased iff due at lease expiry`).toBe(true);
      expect(traits.active !== traits.settled, `${machine.journal} ${s}: active or settled`).toBe(true);
    }
  }
  expect(Object.keys(INBOX)).toEqual([...INBOX_STATES]);
  expect(Object.keys(OUTBOX)).toEqual([...OUTBOX_STATES]);
});

test("the renderings: SQL lists and conditions, Lua tests", () => {
  expect(sqlIn("s", ["a"])).toBe("s = 'a'");
  expect(sqlIn("s", ["a", "b"])).toBe("s IN ('a', 'b')");
  expect(sqlNotIn("s", ["a"])).toBe("s <> 'a'");
  expect(luaSet(["a", "b"])).toBe("a = true, b = true");
  expect(sqlByDue(INBOX, "r.state", { always: "", nextAttemptAt: "N", leaseExpiry: "L" }))
    .toBe("(r.state = 'pending' OR (r.state IN ('scheduled', 'failed') AND N) OR (r.state = 'processing' AND L))");
  expect(statesWhere(OUTBOX, "blocksChat")).toEqual(["queued", "sending", "failed"]);
});

// ---- the guard -------------------------------------------------------------------------------------

const STATES = [...new Set<string>([...INBOX_STATES, ...OUTBOX_STATES])];
const NAMES = STATES.join("|");
const Q = `(?:'(?:${NAMES})'|"(?:${NAMES})")`;
/** Two state names in one line: a hand-written state list. */
const LIST = new RegExp(`${Q}[^\\n]*?${Q}`);
/** A state compared in a predicate: SQL (WHERE/AND/OR/WHEN/NOT/( … state = | <> 'x', IN ('x'), Lua (== ~=), TS (=== !==). */
const PREDICATE = new RegExp(
  `(?:\\b(?:WHERE|AND|OR|WHEN|NOT)\\s+|\\()\\s*[\\w.]*state\\s*(?:=|<>|!=)\\s*'|state\\s+(?:NOT\\s+)?IN\\s*\\(\\s*'|(?:==|~=)\\s*${Q}|(?:===|!==)\\s*${Q}`,
);
/**
 * A transition's target written as an assignment (`SET state = 'x'`, `h.state = 'x'`, and the admission's and
 * reservation's `THEN 'x' ELSE 'y'`, `leased ? "x" : "y"`): allowed.
 */
const TARGET = new RegExp(`THEN ${Q} ELSE ${Q}|\\? ${Q} : ${Q}`);

/**
 * Single state literals that stay, and why. Each entry must still match a line (a stale entry fails).
 * The `attempts` lines of the claim and admission statements are being changed elsewhere (when attempts
 * are counted): they are left as they are, so that the change merges.
 */
const ALLOWED: readonly { file: string; text: string; why: string }[] = [
  {
    file: "backends/postgres/sql_schema.ts",
    text: "WHERE state = 'failed' AND error LIKE '${LEGACY_TIMER_ERROR}%'",
    why: "the schema 6 migration: how versions before `scheduled` stored an armed timer (a stored format, not a rule)",
  },
  {
    file: "backends/sqlite/schema.ts",
    text: "WHERE state = 'failed' AND error LIKE '${LEGACY_TIMER_ERROR}%'",
    why: "the schema 9 migration: how versions before `scheduled` stored an armed timer (a stored format, not a rule)",
  },
  {
    file: "backends/postgres/sql_common.ts",
    text: "attempts = CASE WHEN state = 'sending' AND uncalled_fence = fence",
    why: "the outbox claim's attempt count (a lost uncalled send keeps its number): the claim statement",
  },
  {
    file: "backends/postgres/sql_common.ts",
    text: "uncalled_fence = CASE WHEN state = 'sending' AND uncalled_fence IS DISTINCT FROM fence",
    why: "the outbox claim's called flag, beside its attempt count: the claim statement",
  },
  {
    file: "backends/redis/lua/prelude.lua",
    text: "if h.state == 'dead' and type(h.error) == 'string'",
    why: "how an older version marked a damaged record (dead, with a marker in its error): a stored format, not a rule",
  },
  {
    file: "backends/redis/lua/outbox.lua",
    text: "local still_called = h.state == 'sending' and out_called(h)",
    why: "out_claim's called flag and attempt count: the claim statement",
  },
  {
    file: "backends/redis/lua/outbox.lua",
    text: "if h.state ~= 'sending' or out_called(h) then attempts = attempts + 1 end",
    why: "out_claim's attempt count: the claim statement",
  },
  {
    file: "backends/redis/lua/in_claim_due.lua",
    text: "if from == 'pending' then redis.call('ZREM', P .. 'in:st:pending', via_om)",
    why: "the name of a due window (the pending index), not a state test",
  },
  {
    file: "backends/redis/lua/out_reserve.lua",
    text: "if clear and h.state == 'queued' then",
    why: "outReserve: the entry it just wrote unleased (the admission and reservation statements)",
  },
  { file: "backends/redis/lua/in_finish.lua", text: "if mode == 'done' then", why: "inFinish: the outcome's target state, named by the caller" },
  { file: "backends/redis/lua/in_finish.lua", text: "elseif mode == 'dead' then", why: "inFinish: the outcome's target state" },
  { file: "backends/redis/lua/out_finish.lua", text: "elseif mode == 'dead' then", why: "outFinish: the outcome's target state" },
  { file: "backends/redis/lua/out_finish.lua", text: "if mode == 'sent' then", why: "outFinish: the outcome's target state" },
  { file: "backends/redis/lua/out_finish.lua", text: "elseif mode == 'unknown' then", why: "outFinish: the outcome's target state" },
  {
    file: "src/rules.ts",
    text: `const uncalled = entry.state === "sending" && !entry.called;`,
    why: "claimedOutbox's attempt count (a lost uncalled send keeps its number): the claim rule",
  },
  {
    file: "src/rules.ts",
    text: `const stillCalled = entry.state === "sending" && entry.called;`,
    why: "claimedOutbox's called flag, beside its attempt count: the claim rule",
  },
  {
    file: "src/rules.ts",
    text: `): { state: "failed" | "dead"; nextAttemptAt`,
    why: "failedFields' return type: the targets of a failure, checked by the compiler against the state type",
  },
  {
    file: "backends/redis/outbox.ts",
    text: `if (status === "leased" || status === "queued")`,
    why: "reserve's status names (ReserveResult.status), not states",
  },
  {
    file: "backends/redis/outbox.ts",
    text: `const kind = status === "leased" ? "leased" : status === "queued" ? "queued" : "exists";`,
    why: "reserve's status names (ReserveResult.status), not states",
  },
];

const GUARDED = [
  "backends/postgres",
  "backends/sqlite",
  "backends/redis",
  "backends/events",
  "backends/memory",
  "backends/kv",
  "backends/file",
  "src/ops",
  "src/stored_records.ts",
  "src/rules.ts",
];

function files(path: string): string[] {
  const full = join(root, path);
  if (!statSync(full).isDirectory()) return [full];
  // The Lua sources are guarded as files; the module generated from them (lua_files.ts) is not.
  return readdirSync(full).flatMap((name) => files(join(path, name)))
    .filter((f) => (f.endsWith(".ts") || f.endsWith(".lua")) && !f.endsWith("lua_files.ts"));
}

/** The line without its comment (`//`, `--` in Lua text, ` * ` doc lines). */
function code(line: string): string {
  if (/^\s*(\*|\/\*\*|\/\/|--)/.test(line)) return "";
  return line.replace(/\s\/\/ .*$/, "").replace(/\s-- .*$/, "");
}

test("no hand-written state list or state test in the SQL, Lua, events and operator sources", () => {
  const found: string[] = [];
  const used = new Set<(typeof ALLOWED)[number]>();
  for (const file of GUARDED.flatMap(files)) {
    const rel = relative(root, file);
    readFileSync(file, "utf8").split("\n").forEach((raw, i) => {
      const line = code(raw);
      const list = LIST.test(line) && !TARGET.test(line);
      if (!list && !PREDICATE.test(line)) return;
      const allowed = ALLOWED.find((a) => a.file === rel && raw.includes(a.text));
      if (allowed) {
        used.add(allowed);
        return;
      }
      found.push(`${rel}:${i + 1}: ${raw.trim()}`);
    });
  }
  const stale = ALLOWED.filter((a) => !used.has(a)).map((a) => `${a.file}: ${a.text}`);
  expect(stale, "allowed lines that no longer exist: drop them from ALLOWED").toEqual([]);
  if (found.length > 0) {
    throw new Error(
      `state names written by hand; derive them from src/machine.ts (statesWhere, sqlIn, sqlByDue, the Lua INM/OUTM ` +
        `tables), or add the line to ALLOWED with the reason:\n${found.join("\n")}`,
    );
  }
});

test("the guard finds what it looks for", () => {
  const flagged = (line: string) => (LIST.test(line) && !TARGET.test(line)) || PREDICATE.test(line);
  expect(flagged("WHERE o.state IN ('queued', 'failed')")).toBe(true);
  expect(flagged("AND state = 'processing' AND lease_token = $2")).toBe(true);
  expect(flagged("if h.state == 'sending' then")).toBe(true);
  expect(flagged(`if (entry.state === "unknown") return`)).toBe(true);
  expect(flagged("local S = {pending = true}; local L = {'pending', 'failed'}")).toBe(true);
  expect(flagged("CASE WHEN g.leased THEN 'processing' ELSE 'pending' END,")).toBe(false);
  expect(flagged("UPDATE t SET state = 'done', lease_owner = NULL")).toBe(false);
  expect(flagged("h.state = 'sending'; h.attempts = n2s(attempts)")).toBe(false);
  expect(flagged(`state: leased ? "sending" : "queued",`)).toBe(false);
});

test("the Redis Lua module is built from backends/redis/lua/*.lua (bun scripts/lua_build.ts --write)", async () => {
  const { renderLuaModule } = await import("../scripts/lua_build.ts");
  expect(readFileSync(join(root, "backends/redis/lua_files.ts"), "utf8") === renderLuaModule(), "lua_files.ts is current").toBe(true);
});
