/**
 * The `botmesh-durable` command line: inspect and repair the inbox and outbox
 * of a durability backend (list, show, replay, retry, discard, purge, stats).
 *
 * This module is Web-standard: {@link runCli} gets the arguments, an output
 * writer and a backend opener, and returns the exit code. The runtime entry
 * (`cli.ts` at the top level) wires it to the process.
 *
 * Exit codes: `0` done; `1` the operation failed (not found, not in a state
 * that allows it, the backend failed); `2` bad usage (unknown command or flag,
 * a bad value, a backend URL of no known form).
 *
 * @example
 * ```sh
 * botmesh-durable -b sqlite:./data/bot.db list inbox --state dead
 * botmesh-durable -b postgres://postgres@db:5432/app?schema=bots replay 9f1c…
 * botmesh-durable -b redis+upstash://$TOKEN@eu1-foo.upstash.io purge --older-than 7d --json
 * ```
 *
 * @module
 */
import { errorMessage } from "../errors.ts";
import type {
  DurabilityBackend,
  InboundRecord,
  InboundState,
  ListOptions,
  OutboxEntry,
  OutboxState,
} from "../contract.ts";
import { parseDuration } from "../config.ts";
import { listDamaged } from "../engine.ts";
import { countRecords, INBOX_STATES, OUTBOX_STATES } from "./prometheus.ts";
import { type ConsoleServe, isConsoleCommand, runConsoleCommand } from "./console_command.ts";

/** Where {@link runCli} writes. Each call gets whole lines. */
export interface CliIo {
  /** Standard output: the command's result. */
  stdout(text: string): void | Promise<void>;
  /** Standard error: progress, warnings and errors. */
  stderr(text: string): void | Promise<void>;
}

/** An open backend, and how to let it go (ends the client the opener created). */
export interface OpenedBackend {
  /** The opened (`open()` already called) backend. */
  backend: DurabilityBackend;
  /** What it is, for messages, without credentials (`sqlite ./data/bot.db`). */
  description: string;
  /** Closes the backend and the client. */
  close(): Promise<void>;
}

/** Opens a backend from a URL or path (`openBackend` of `@botmesh/durable/ops` is the one for this package's backends). */
export type BackendOpener = (url: string) => Promise<OpenedBackend>;

/** Options of {@link runCli}. */
export interface CliOptions {
  /** Opens the backend: `openBackend` of `@botmesh/durable/ops` knows every backend of this package. */
  open: BackendOpener;
  /** Printed by `--version` (default `"unknown"`). */
  version?: string;
  /** Reads an environment variable (for `BOTMESH_DURABLE_BACKEND`); none by default. */
  env?: (name: string) => string | undefined;
  /** The clock, ms since epoch (default `Date.now`). */
  now?: () => number;
  /** Serves HTTP, for the `console` command (the command line's entry gives the runtime's server). */
  serve?: ConsoleServe;
  /** Resolves when the `console` command should stop (the command line's entry: SIGINT or SIGTERM). */
  untilShutdown?: () => Promise<unknown>;
}

/** The backend URL does not have any form the opener knows, or one of its parameters is bad. */
export class BackendUrlError extends TypeError {
  /** The URL as given (credentials hidden). */
  readonly url: string;
  /**
   * @param url the URL (credentials hidden)
   * @param reason what is wrong with it
   */
  constructor(url: string, reason: string) {
    super(`${reason}\n${ACCEPTED_FORMS}`);
    this.name = "BackendUrlError";
    this.url = url;
  }
}

/** A bad command line: usage is printed and the exit code is 2. */
class UsageError extends Error {
  override name = "UsageError";
}

/** The operation could not be done: exit code 1. */
export class OperationError extends Error {
  override name = "OperationError";
}

/** The environment variable read when `--backend` is not given. */
export const BACKEND_ENV: string = "BOTMESH_DURABLE_BACKEND";

const ACCEPTED_FORMS = `Accepted backend forms:
  sqlite:./data/bot.db            sqlite:///abs/path/bot.db        (?tablePrefix=…)
  file:./data/bot.json            file:///abs/path/bot.json
  ./data/bot.db | .sqlite | .sqlite3 (SQLite)   ./data/bot.json (file)
  postgres://user:pass@host:5432/db             postgresql://…   (?schema=…&tablePrefix=…; needs the "postgres" package)
  redis+upstash://<token>@host[:port]           https; ?insecure=1 or redis+upstash+http://<token>@host:port for http (needs "@upstash/redis")
  redis://[user:pass@]host:6379[/db]            rediss://…       (needs "ioredis")
  Redis forms take ?keyPrefix=…`;

/** The usage text printed by `--help`. */
export const USAGE: string = `Usage: botmesh-durable [--backend <url>] <command> [options]

Inspect and repair the durable inbox/outbox of @botmesh/durable.

Commands:
  list <inbox|outbox> [--state s[,s…]] [--chat id] [--limit n]   list records (default limit 100)
  show <inbox|outbox> <id>          one record in full
  replay <id>                       make an inbound record (done, failed, dead) pending again
  retry <key>                       requeue an outbox entry (dead, failed, unknown)
  discard <key>                     forget an outbox entry (not while it is being sent)
  purge --older-than <7d|12h|30m|ms>  delete inbox "done" and outbox "sent" records older than that
  stats [--limit n]                 records per state (counted up to n, default 10000)
  damaged [--limit n]               records the backend could not read and set aside (kept, never deleted)
  console [--port n] [--host h]     serve the web console until Ctrl-C (botmesh-durable console --help)

Options:
  -b, --backend <url>   the backend (or set ${BACKEND_ENV})
  --json                machine output: one JSON document on stdout
  -h, --help            this help
  -V, --version         the version

Inbox states: ${INBOX_STATES.join(", ")}
Outbox states: ${OUTBOX_STATES.join(", ")}
Exit codes: 0 done, 1 the operation failed, 2 bad usage.

${ACCEPTED_FORMS}
`;

const COMMANDS: Record<string, { args: string[]; flags: string[] }> = {
  list: { args: ["<inbox|outbox>"], flags: ["state", "chat", "limit"] },
  show: { args: ["<inbox|outbox>", "<id>"], flags: [] },
  replay: { args: ["<id>"], flags: [] },
  retry: { args: ["<key>"], flags: [] },
  discard: { args: ["<key>"], flags: [] },
  purge: { args: [], flags: ["older-than"] },
  stats: { args: [], flags: ["limit"] },
  damaged: { args: [], flags: ["limit"] },
};

const VALUE_FLAGS = new Set(["backend", "state", "chat", "limit", "older-than"]);
const BOOLEAN_FLAGS = new Set(["json", "help", "version"]);
const SHORT: Record<string, string> = { b: "backend", h: "help", V: "version" };

interface Parsed {
  command: string | undefined;
  positionals: string[];
  flags: Map<string, string>;
  json: boolean;
  help: boolean;
  version: boolean;
}

function parseArgs(argv: readonly string[]): Parsed {
  const positionals: string[] = [];
  const flags = new Map<string, string>();
  let json = false;
  let help = false;
  let version = false;
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i]!;
    if (arg === "--") {
      positionals.push(...argv.slice(i + 1));
      break;
    }
    let name: string | undefined;
    let value: string | undefined;
    if (arg.startsWith("--")) {
      const eq = arg.indexOf("=");
      name = eq === -1 ? arg.slice(2) : arg.slice(2, eq);
      if (eq !== -1) value = arg.slice(eq + 1);
    } else if (/^-[a-zA-Z]$/.test(arg)) {
      name = SHORT[arg[1]!];
      if (name === undefined) throw new UsageError(`Unknown flag ${JSON.stringify(arg)}`);
    } else {
      positionals.push(arg);
      continue;
    }
    if (BOOLEAN_FLAGS.has(name)) {
      if (value !== undefined) throw new UsageError(`Flag "--${name}" takes no value, got ${JSON.stringify(arg)}`);
      if (name === "json") json = true;
      else if (name === "help") help = true;
      else version = true;
      continue;
    }
    if (!VALUE_FLAGS.has(name)) throw new UsageError(`Unknown flag ${JSON.stringify(arg)}`);
    if (value === undefined) {
      value = argv[++i];
      if (value === undefined) throw new UsageError(`Flag "--${name}" needs a value`);
    }
    if (flags.has(name)) throw new UsageError(`Flag "--${name}" is given twice`);
    flags.set(name, value);
  }
  return { command: positionals.shift(), positionals, flags, json, help, version };
}

/**
 * Runs the `botmesh-durable` command line.
 *
 * @param argv the arguments after the program name, e.g. `["list", "inbox", "--state", "dead"]`
 * @param io where the output and errors go
 * @param options `open` (the backend opener), `version`, `env`, `now`
 * @returns the exit code: 0 done, 1 the operation failed, 2 bad usage
 * @example
 * ```ts
 * import { openBackend, runCli } from "@botmesh/durable/ops";
 *
 * const out: string[] = [];
 * const code = await runCli(["-b", "sqlite:./data/bot.db", "stats", "--json"], {
 *   stdout: (t) => void out.push(t),
 *   stderr: (t) => void out.push(t),
 * }, { open: openBackend });
 * ```
 */
export async function runCli(argv: readonly string[], io: CliIo, options: CliOptions): Promise<number> {
  if (isConsoleCommand(argv)) return await runConsoleCommand(argv, io, options, BACKEND_ENV);
  let parsed: Parsed;
  try {
    parsed = parseArgs(argv);
    if (parsed.help) {
      await io.stdout(USAGE);
      return 0;
    }
    if (parsed.version) {
      await io.stdout(`botmesh-durable ${options.version ?? "unknown"}\n`);
      return 0;
    }
    checkCommand(parsed);
  } catch (error) {
    return await fail(io, error);
  }
  const url = parsed.flags.get("backend") ?? options.env?.(BACKEND_ENV);
  if (url === undefined || url === "") {
    return await fail(io, new UsageError(`Missing the backend: give --backend <url> or set ${BACKEND_ENV}`));
  }
  let opened: OpenedBackend;
  try {
    opened = await options.open(url);
  } catch (error) {
    return await fail(io, error);
  }
  try {
    await run(parsed, opened, io, options.now ?? Date.now);
    return 0;
  } catch (error) {
    return await fail(io, error);
  } finally {
    await opened.close().catch(async (error) => {
      await io.stderr(`botmesh-durable: warning: closing ${opened.description} failed: ${errorMessage(error)}\n`);
    });
  }
}


async function fail(io: CliIo, error: unknown): Promise<number> {
  if (error instanceof UsageError) {
    await io.stderr(`botmesh-durable: ${error.message}\n\n${USAGE}`);
    return 2;
  }
  if (error instanceof BackendUrlError) {
    await io.stderr(`botmesh-durable: ${error.message}\n`);
    return 2;
  }
  await io.stderr(`botmesh-durable: ${errorMessage(error)}\n`);
  return 1;
}

function checkCommand(p: Parsed): void {
  if (p.command === undefined) throw new UsageError("Missing the command");
  const spec = COMMANDS[p.command];
  if (!spec) {
    throw new UsageError(
      `Unknown command ${JSON.stringify(p.command)}; commands are ${Object.keys(COMMANDS).join(", ")}`,
    );
  }
  for (const name of p.flags.keys()) {
    if (name !== "backend" && !spec.flags.includes(name)) {
      throw new UsageError(`Flag "--${name}" does not apply to "${p.command}"`);
    }
  }
  if (p.positionals.length < spec.args.length) {
    throw new UsageError(
      `"${p.command}" needs ${spec.args.join(" ")}; missing ${spec.args.slice(p.positionals.length).join(" ")}`,
    );
  }
  if (p.positionals.length > spec.args.length) {
    throw new UsageError(
      `Unexpected argument ${JSON.stringify(p.positionals[spec.args.length])} for "${p.command}"`,
    );
  }
  if ((p.command === "list" || p.command === "show") && p.positionals[0] !== "inbox" && p.positionals[0] !== "outbox") {
    throw new UsageError(`"${p.command}" takes "inbox" or "outbox", got ${JSON.stringify(p.positionals[0])}`);
  }
  if (p.command === "purge" && !p.flags.has("older-than")) {
    throw new UsageError(`"purge" needs --older-than <duration> (e.g. 7d, 12h, 30m, or ms)`);
  }
}

function positiveInt(text: string, flag: string): number {
  if (!/^\d+$/.test(text) || Number(text) < 1 || !Number.isSafeInteger(Number(text))) {
    throw new UsageError(`Flag "--${flag}" must be a positive integer, got ${JSON.stringify(text)}`);
  }
  return Number(text);
}

function states<S extends string>(text: string, allowed: readonly S[], journal: string): S[] {
  const list = text.split(",").map((s) => s.trim());
  for (const s of list) {
    if (!allowed.includes(s as S)) {
      throw new UsageError(`Flag "--state" has ${JSON.stringify(s)}, not a ${journal} state; use ${allowed.join(", ")}`);
    }
  }
  return list as S[];
}

function olderThan(text: string): number {
  if (/^\d+$/.test(text)) return Number(text);
  try {
    return parseDuration(text, "--older-than");
  } catch {
    throw new UsageError(`Flag "--older-than" must be a duration like 7d, 12h, 30m or a number of ms, got ${JSON.stringify(text)}`);
  }
}

async function run(p: Parsed, opened: OpenedBackend, io: CliIo, now: () => number): Promise<void> {
  const { backend } = opened;
  const out = (value: unknown): void | Promise<void> => io.stdout(JSON.stringify(value, null, 2) + "\n");
  switch (p.command) {
    case "list": {
      const journal = p.positionals[0] as "inbox" | "outbox";
      const limit = p.flags.has("limit") ? positiveInt(p.flags.get("limit")!, "limit") : 100;
      const chatId = p.flags.get("chat");
      const stateText = p.flags.get("state");
      if (journal === "inbox") {
        const opts: ListOptions<InboundState> = { limit };
        if (stateText !== undefined) opts.state = states(stateText, INBOX_STATES, "inbox");
        if (chatId !== undefined) opts.chatId = chatId;
        const records = await backend.inbox.list(opts);
        if (p.json) return void (await out(records));
        await io.stdout(
          records.length === 0 ? "No inbox records match.\n" : table(
            ["ID", "STATE", "CHAT", "KIND", "ATTEMPTS", "RECEIVED", "ERROR"],
            records.map((r) => [r.id, r.state, r.chatId, r.kind, String(r.attempts), iso(r.receivedAt), r.error ?? ""]),
          ) + footer(records.length, limit),
        );
      } else {
        const opts: ListOptions<OutboxState> = { limit };
        if (stateText !== undefined) opts.state = states(stateText, OUTBOX_STATES, "outbox");
        if (chatId !== undefined) opts.chatId = chatId;
        const entries = await backend.outbox.list(opts);
        if (p.json) return void (await out(entries));
        await io.stdout(
          entries.length === 0 ? "No outbox entries match.\n" : table(
            ["KEY", "STATE", "CHAT", "ATTEMPTS", "CREATED", "MESSAGE ID", "ERROR"],
            entries.map((e) => [
              e.key,
              e.state,
              e.chatId,
              String(e.attempts),
              iso(e.createdAt),
              e.messageId ?? "",
              e.error ?? "",
            ]),
          ) + footer(entries.length, limit),
        );
      }
      return;
    }
    case "show": {
      const journal = p.positionals[0] as "inbox" | "outbox";
      const id = p.positionals[1]!;
      const record = journal === "inbox" ? await backend.inbox.get(id) : await backend.outbox.get(id);
      if (record === null) {
        throw new OperationError(
          journal === "inbox" ? `Inbox record ${JSON.stringify(id)} not found` : `Outbox entry ${JSON.stringify(id)} not found`,
        );
      }
      if (p.json) return void (await out(record));
      await io.stdout(describe(record));
      return;
    }
    case "replay": {
      const id = p.positionals[0]!;
      const replayed = await backend.inbox.replay(id);
      const record = await backend.inbox.get(id);
      const why = replayed ? null : record === null
        ? `Inbox record ${JSON.stringify(id)} not found`
        : `Inbox record ${JSON.stringify(id)} is ${record.state}: only done, failed and dead records can be replayed`;
      if (p.json) await out({ command: "replay", id, ok: replayed, state: record?.state ?? null, error: why });
      if (why !== null) throw new OperationError(why);
      if (!p.json) {
        await io.stdout(
          `Inbox record ${JSON.stringify(id)} is pending again: a running bot processes it on its next sweep.\n`,
        );
      }
      return;
    }
    case "retry": {
      const key = p.positionals[0]!;
      const requeued = await backend.outbox.retry(key);
      const entry = await backend.outbox.get(key);
      const why = requeued ? null : entry === null
        ? `Outbox entry ${JSON.stringify(key)} not found`
        : `Outbox entry ${JSON.stringify(key)} is ${entry.state}: only dead, failed and unknown entries can be retried`;
      if (p.json) await out({ command: "retry", key, ok: requeued, state: entry?.state ?? null, error: why });
      if (why !== null) throw new OperationError(why);
      if (!p.json) {
        await io.stdout(`Outbox entry ${JSON.stringify(key)} is queued again: a running bot sends it on its next sweep.\n`);
      }
      return;
    }
    case "discard": {
      const key = p.positionals[0]!;
      const before = await backend.outbox.get(key);
      const discarded = before !== null && await backend.outbox.discard(key);
      const why = discarded ? null : before === null
        ? `Outbox entry ${JSON.stringify(key)} not found`
        : `Outbox entry ${JSON.stringify(key)} is being sent: it cannot be discarded now`;
      if (p.json) await out({ command: "discard", key, ok: discarded, state: before?.state ?? null, error: why });
      if (why !== null) throw new OperationError(why);
      if (!p.json) await io.stdout(`Outbox entry ${JSON.stringify(key)} (${before!.state}) discarded.\n`);
      return;
    }
    case "purge": {
      const ms = olderThan(p.flags.get("older-than")!);
      let inbox = 0;
      let outbox = 0;
      const progress = (): void | Promise<void> =>
        io.stderr(`purging: ${inbox} inbox records, ${outbox} outbox entries so far\n`);
      for (let n = await backend.inbox.purge(ms); n > 0; n = await backend.inbox.purge(ms)) {
        inbox += n;
        await progress();
      }
      for (let n = await backend.outbox.purge(ms); n > 0; n = await backend.outbox.purge(ms)) {
        outbox += n;
        await progress();
      }
      if (p.json) return void (await out({ command: "purge", olderThanMs: ms, inbox, outbox }));
      await io.stdout(
        `Purged ${inbox} inbox record${inbox === 1 ? "" : "s"} (done) and ${outbox} outbox entr${
          outbox === 1 ? "y" : "ies"
        } (sent) last changed more than ${duration(ms)} ago.\n`,
      );
      return;
    }
    case "damaged": {
      const limit = p.flags.has("limit") ? positiveInt(p.flags.get("limit")!, "limit") : 100;
      const records = await listDamaged(backend, { limit });
      const truncated = (["inbox", "outbox"] as const).some((j) => records.filter((d) => d.journal === j).length >= limit);
      if (p.json) return void (await out(records));
      await io.stdout(
        records.length === 0 ? "No damaged records.\n" : table(
          ["JOURNAL", "ID", "SET ASIDE", "REPORTED", "PROBLEM"],
          records.map((d) => [d.journal, d.id, iso(d.setAsideAt), d.reported ? "yes" : "no", d.problem]),
        ) + (truncated ? `(first ${limit} per journal; raise --limit to see more)\n` : `(${records.length})\n`) +
          "Damaged records are kept as they were stored: repair or remove them with the backend's own tools.\n",
      );
      return;
    }
    case "stats": {
      const cap = p.flags.has("limit") ? positiveInt(p.flags.get("limit")!, "limit") : 10_000;
      const counts = await countRecords(backend, cap);
      const t = now();
      const oldest = counts.oldestPendingReceivedAt;
      const ageSeconds = oldest === null ? null : Math.max(0, (t - oldest) / 1000);
      const note = "A bare backend has no counters: the counters of bot.durability.metrics() live in the bot " +
        "process (expose them with prometheusMetrics(bot))";
      if (p.json) {
        return void (await out({
          backend: backend.name,
          inbox: counts.inbox,
          outbox: counts.outbox,
          countCap: cap,
          oldestPendingReceivedAt: oldest,
          oldestPendingAgeSeconds: ageSeconds,
          counters: null,
          note,
        }));
      }
      const show = (n: number): string => (n >= cap ? `>=${n}` : String(n));
      const lines = [
        `Backend: ${opened.description}`,
        "",
        table(["INBOX", "RECORDS"], INBOX_STATES.map((s) => [s, show(counts.inbox[s])])).trimEnd(),
        "",
        table(["OUTBOX", "ENTRIES"], OUTBOX_STATES.map((s) => [s, show(counts.outbox[s])])).trimEnd(),
        "",
        oldest === null
          ? "Oldest pending inbound record: none"
          : `Oldest pending inbound record: received ${iso(oldest)} (${duration(ageSeconds! * 1000)} ago)`,
        `Counts stop at ${cap} per state (--limit).`,
        `Counters: none. ${note}.`,
      ];
      await io.stdout(lines.join("\n") + "\n");
      return;
    }
  }
}

function iso(ms: number | null): string {
  if (ms === null || !Number.isFinite(ms)) return "";
  return new Date(ms).toISOString();
}

function duration(ms: number): string {
  const s = Math.round(ms / 1000);
  if (ms < 1000) return `${Math.round(ms)}ms`;
  const parts: string[] = [];
  const d = Math.floor(s / 86400), h = Math.floor((s % 86400) / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
  if (d) parts.push(`${d}d`);
  if (h) parts.push(`${h}h`);
  if (m) parts.push(`${m}m`);
  if (sec || parts.length === 0) parts.push(`${sec}s`);
  return parts.join(" ");
}

function cell(text: string, max = 60): string {
  const flat = text.replace(/[\r\n\t]+/g, " ");
  return flat.length > max ? flat.slice(0, max - 1) + "…" : flat;
}

function table(headers: string[], rows: string[][]): string {
  const cells = rows.map((r) => r.map((c) => cell(c)));
  const widths = headers.map((h, i) => Math.max(h.length, ...cells.map((r) => r[i]!.length)));
  const line = (r: string[]): string => r.map((c, i) => (i === r.length - 1 ? c : c.padEnd(widths[i]!))).join("  ").trimEnd();
  return [line(headers), ...cells.map(line)].join("\n") + "\n";
}

function footer(count: number, limit: number): string {
  return count >= limit ? `(first ${limit}; raise --limit to see more)\n` : `(${count})\n`;
}

function describe(record: InboundRecord | OutboxEntry): string {
  const lines: string[] = [];
  for (const [key, value] of Object.entries(record)) {
    let text: string;
    if (value === null || value === undefined) text = "-";
    else if ((key.endsWith("At") || key === "receivedAt") && typeof value === "number") text = `${iso(value)} (${value})`;
    else if (typeof value === "object") text = JSON.stringify(value, null, 2).replace(/\n/g, "\n  ");
    else text = String(value);
    lines.push(`${key}: ${text}`);
  }
  return lines.join("\n") + "\n";
}
