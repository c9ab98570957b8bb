/**
 * The `botmesh-durable` command line: inspect and repair the inbox and outbox
 * of a durability backend (list, show, replay, retry, mark-delivered, discard,
 * purge, stats, damaged).
 *
 * This module is Web-standard: {@link runCli} gets the arguments, an output
 * writer and a backend opener, and returns the exit code. The runtime entry
 * (`cli.ts` at the top level) wires it to the process.
 *
 * Exit codes: `0` done; `1` the operation failed (not found, not in a state
 * that allows it, the backend is missing or failed); `2` bad usage (unknown
 * command or flag, a bad value, a backend URL of no known form).
 *
 * The subcommands are the {@link CliCommand}s of {@link COMMANDS}: each has
 * its usage line, its help (`botmesh-durable <command> --help`) and its `run`.
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
import type { DurabilityBackend } from "../contract.ts";
import { type CliCommand, PROGRAM, UsageError, usageLine } from "./cli_command.ts";
import {
  damagedCommand,
  discardCommand,
  listCommand,
  markDeliveredCommand,
  purgeCommand,
  replayCommand,
  retryCommand,
  showCommand,
  statsCommand,
} from "./cli_commands.ts";

import { type ConsoleServe, isConsoleCommand, runConsoleCommand } from "./console_command.ts";
import { escapeControls } from "./terminal_text.ts";
import { hideCredentials } from "./url_credentials.ts";

export { type CliCommand, type CliFlag, type CommandContext, OperationError, UsageError } from "./cli_command.ts";

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

/** The environment variable read when `--backend` is not given. */
export const BACKEND_ENV: string = "BOTMESH_DURABLE_BACKEND";

const ACCEPTED_FORMS = `Accepted backend forms:
  sqlite:./data/bot.db            sqlite:///abs/path/bot.db        (?tablePrefix=…)
  file:./data/bot.json            file:///abs/path/bot.json
  ./data/bot.db | .sqlite | .sqlite3 (SQLite)   ./data/bot.json (file)
  postgres://user:pass@host:5432/db             postgresql://…   (?schema=…&tablePrefix=…; needs the "postgres" package)
  redis+upstash://<token>@host[:port]           https; ?insecure=1 or redis+upstash+http://<token>@host:port for http (needs "@upstash/redis")
  redis://[user:pass@]host:6379[/db]            rediss://…       (needs "ioredis")
  Redis forms take ?keyPrefix=…
  events+file:./data/events.json                a FileEventJournal (takes its lock: stop the bot first)
  events+shared:./data/events.json              a SharedFileEventJournal (alongside running bots)
Nothing is created: a missing file, schema, tables or key prefix is an error.
Nothing is upgraded: a SQLite file or Postgres schema of another schema version is an error
(use the botmesh-durable of the bots' version; a bot of this version upgrades it when it starts).`;

/**
 * The subcommands, in the order of the help. A subcommand in a file of its
 * own is added here (one line).
 */
export const COMMANDS: readonly CliCommand[] = [
  listCommand,
  showCommand,
  replayCommand,
  retryCommand,
  markDeliveredCommand,
  discardCommand,
  purgeCommand,
  statsCommand,
  damagedCommand,
];

const GLOBAL_OPTIONS = `  -b, --backend <url>   the backend (or set ${BACKEND_ENV})
  --json                machine output: one JSON document on stdout
  -h, --help            help (also: ${PROGRAM} help <command>, ${PROGRAM} <command> --help)
  -V, --version         the version`;

const EXIT_CODES = "Exit codes: 0 done, 1 the operation failed (not found, wrong state, backend missing or failing), 2 bad usage.";

/** The names of the commands, `console` (served by its own module) included. */
function commandNames(): string {
  return [...COMMANDS.map((c) => c.name), "console"].join(", ");
}

function commandList(): string {
  const width = Math.max(...COMMANDS.map((c) => c.name.length));
  return [
    ...COMMANDS.map((c) => `  ${c.name.padEnd(width)}  ${c.summary}`),
    `  ${"console".padEnd(width)}  serve the web console until Ctrl-C (${PROGRAM} console --help)`,
  ].join("\n");
}

/** The text printed by `botmesh-durable --help`. */
export function usage(): string {
  return `Usage: ${PROGRAM} [--backend <url>] <command> [options]

Inspect and repair the durable inbox/outbox of @botmesh/durable.

Commands:
${commandList()}

Options:
${GLOBAL_OPTIONS}

Run "${PROGRAM} <command> --help" for a command's arguments, flags and examples.
${EXIT_CODES}

${ACCEPTED_FORMS}
`;
}

/** The usage text printed by `--help` (as {@link usage} returns it for the built-in commands). */
export const USAGE: string = usage();

/**
 * The help of one command (`botmesh-durable <command> --help`).
 *
 * @param command the command
 * @returns its usage line, description, flags, examples and exit codes
 */
export function commandHelp(command: CliCommand): string {
  const rows: [string, string][] = command.flags.map((f) => [
    f.value === undefined ? `--${f.name}` : `--${f.name} <${f.value}>`,
    f.required ? `${f.help} (required)` : f.help,
  ]);
  if (command.backend !== false) rows.push(["-b, --backend <url>", `the backend (or set ${BACKEND_ENV})`]);
  if (command.json !== false) rows.push(["--json", "machine output: one JSON document on stdout"]);
  rows.push(["-h, --help", "this help"]);
  const width = Math.max(...rows.map(([a]) => a.length));
  const effect = command.backend === false
    ? ""
    : command.changes
    ? "\nChanges the backend's records. Never creates a backend: a missing file, schema or key prefix is an error.\n"
    : "\nRead-only: changes nothing and creates nothing (a missing file, schema or key prefix is an error).\n";
  const examples = command.examples?.length
    ? `\nExamples:\n${command.examples.map((e) => `  ${PROGRAM} ${command.backend === false ? "" : "-b sqlite:./data/bot.db "}${e}`).join("\n")}\n`
    : "";
  return `Usage: ${usageLine(command)}

${command.help}
${effect}
Options:
${rows.map(([a, b]) => `  ${a.padEnd(width)}  ${b}`).join("\n")}
${examples}
${EXIT_CODES}
`;
}

const SHORT: Record<string, string> = { b: "backend", h: "help", V: "version" };

/** Every flag a command line may have: `true` when it takes a value. */
function flagKinds(): Map<string, boolean> {
  const kinds = new Map<string, boolean>([["backend", true], ["json", false], ["help", false], ["version", false]]);
  for (const c of COMMANDS) for (const f of c.flags) kinds.set(f.name, f.value !== undefined);
  return kinds;
}

interface Parsed {
  command: string | undefined;
  positionals: string[];
  flags: Map<string, string>;
  json: boolean;
  help: boolean;
  version: boolean;
  /** The first problem met, thrown once the command is known (so that its usage line goes with it). */
  error: UsageError | null;
}

function parseArgs(argv: readonly string[]): Parsed {
  const kinds = flagKinds();
  const p: Parsed = { command: undefined, positionals: [], flags: new Map(), json: false, help: false, version: false, error: null };
  const problem = (message: string): void => void (p.error ??= new UsageError(message));
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i]!;
    if (arg === "--") {
      p.positionals.push(...argv.slice(i + 1));
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
      if (name === undefined) {
        problem(`Unknown flag ${JSON.stringify(arg)}`);
        continue;
      }
    } else {
      p.positionals.push(arg);
      continue;
    }
    const takesValue = kinds.get(name);
    if (takesValue === undefined) {
      problem(`Unknown flag ${JSON.stringify(arg)}`);
      continue;
    }
    if (!takesValue) {
      if (value !== undefined) problem(`Flag "--${name}" takes no value, got ${JSON.stringify(arg)}`);
      else if (name === "json") p.json = true;
      else if (name === "help") p.help = true;
      else if (name === "version") p.version = true;
      else if (p.flags.has(name)) problem(`Flag "--${name}" is given twice`);
      else p.flags.set(name, "");
      continue;
    }
    if (value === undefined) {
      value = argv[++i];
      if (value === undefined) {
        problem(`Flag "--${name}" needs a value`);
        continue;
      }
    }
    if (p.flags.has(name)) problem(`Flag "--${name}" is given twice`);
    p.flags.set(name, value);
  }
  p.command = p.positionals.shift();
  return p;
}

function findCommand(name: string): CliCommand {
  const command = COMMANDS.find((c) => c.name === name);
  if (command === undefined) {
    throw new UsageError(`Unknown command ${JSON.stringify(name)}; commands are ${commandNames()}, help`);
  }
  return command;
}

/** The help asked for (`--help`, `help [command]`), or `null`. */
function helpText(p: Parsed): string | null {
  if (p.command === "help") {
    const target = p.positionals[0];
    if (target === undefined) return usage();
    if (p.positionals.length > 1) throw new UsageError(`"help" takes one command, got ${p.positionals.length}`);
    return commandHelp(findCommand(target));
  }
  if (!p.help) return null;
  return p.command === undefined ? usage() : commandHelp(findCommand(p.command));
}

function checkCommand(command: CliCommand, p: Parsed): void {
  if (p.error !== null) throw p.error;
  if (p.json && command.json === false) throw new UsageError(`Flag "--json" does not apply to "${command.name}"`);
  for (const name of p.flags.keys()) {
    if (name !== "backend" && !command.flags.some((f) => f.name === name)) {
      throw new UsageError(`Flag "--${name}" does not apply to "${command.name}"`);
    }
  }
  if (p.positionals.length < command.args.length) {
    throw new UsageError(
      `"${command.name}" needs ${command.args.join(" ")}; missing ${command.args.slice(p.positionals.length).join(" ")}`,
    );
  }
  if (p.positionals.length > command.args.length) {
    throw new UsageError(`Unexpected argument ${JSON.stringify(p.positionals[command.args.length])} for "${command.name}"`);
  }
  for (const f of command.flags) {
    if (f.required && !p.flags.has(f.name)) {
      throw new UsageError(`"${command.name}" needs --${f.name} <${f.value ?? ""}>`);
    }
  }
  command.check?.({ positionals: p.positionals, flags: p.flags });
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
export async function runCli(argv: readonly string[], rawIo: CliIo, options: CliOptions): Promise<number> {
  // Everything written passes here: journal data never reaches the terminal with its control characters.
  const io: CliIo = {
    stdout: (text) => rawIo.stdout(escapeControls(text, true)),
    stderr: (text) => rawIo.stderr(escapeControls(text, true)),
  };
  if (isConsoleCommand(argv)) return await runConsoleCommand(argv, io, options, BACKEND_ENV);
  if (argv.length === 2 && argv[0] === "help" && argv[1] === "console") {
    return await runConsoleCommand(["console", "--help"], io, options, BACKEND_ENV);
  }
  const p = parseArgs(argv);
  let command: CliCommand | undefined;
  try {
    const help = helpText(p);
    if (help !== null) {
      await io.stdout(help);
      return 0;
    }
    if (p.version) {
      await io.stdout(`${PROGRAM} ${options.version ?? "unknown"}\n`);
      return 0;
    }
    if (p.command === undefined) throw p.error ?? new UsageError("Missing the command");
    command = findCommand(p.command);
    checkCommand(command, p);
  } catch (error) {
    return await fail(io, error, command);
  }
  const now = options.now ?? Date.now;
  if (command.backend === false) {
    try {
      await command.run({ positionals: p.positionals, flags: p.flags, json: p.json, io, now });
      return 0;
    } catch (error) {
      return await fail(io, error, command);
    }
  }
  const url = p.flags.get("backend") ?? options.env?.(BACKEND_ENV);
  if (url === undefined || url === "") {
    return await fail(io, new UsageError(`Missing the backend: give --backend <url> or set ${BACKEND_ENV}`), command);
  }
  let opened: OpenedBackend;
  try {
    opened = await options.open(url);
  } catch (error) {
    return await fail(io, error, command);
  }
  try {
    await command.run({ positionals: p.positionals, flags: p.flags, json: p.json, opened, io, now });
    return 0;
  } catch (error) {
    return await fail(io, error, command);
  } finally {
    await opened.close().catch(async (error) => {
      await io.stderr(`${PROGRAM}: warning: closing ${opened.description} failed: ${errorMessage(error)}\n`);
    });
  }
}

async function fail(io: CliIo, error: unknown, command: CliCommand | undefined): Promise<number> {
  if (error instanceof UsageError) {
    const hint = command === undefined
      ? `Usage: ${PROGRAM} [--backend <url>] <command> [options]\nCommands: ${commandNames()}\n` +
        `Run "${PROGRAM} --help" for more.`
      : `Usage: ${usageLine(command)}\nRun "${PROGRAM} ${command.name} --help" for more.`;
    // The message quotes arguments as typed: a mistyped flag or a misplaced backend URL carries its password.
    await io.stderr(`${PROGRAM}: ${hideCredentials(error.message)}\n${hint}\n`);
    return 2;
  }
  if (error instanceof BackendUrlError) {
    await io.stderr(`${PROGRAM}: ${error.message}\n`);
    return 2;
  }
  await io.stderr(`${PROGRAM}: ${errorMessage(error)}\n`);
  return 1;
}
