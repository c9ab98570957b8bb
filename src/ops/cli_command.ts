/**
 * What a `botmesh-durable` subcommand is ({@link CliCommand}): its name,
 * usage line, help, flags and `run`. The command table of `./cli.ts` lists
 * them; a subcommand in a file of its own exports one of these and is added
 * to that table.
 *
 * @module
 */
import type { DurabilityBackend } from "../contract.ts";
import type { CliIo, OpenedBackend } from "./cli.ts";

/** The program's name, in messages. */
export const PROGRAM: string = "botmesh-durable";

/** A bad command line: exit code 2, with the command's usage line. */
export class UsageError extends Error {
  override name = "UsageError";
}

/** The operation could not be done: exit code 1. */
export class OperationError extends Error {
  override name = "OperationError";
}

/** A flag of a command. */
export interface CliFlag {
  /**
   * Its long name, without `--`. A name used by several commands takes a
   * value in all of them or in none (the parser knows it before the command).
   */
  name: string;
  /** The placeholder of its value (`"n"`, `"s[,s…]"`); absent for a flag that takes no value. */
  value?: string;
  /** One line: what it does. */
  help: string;
  /** The command needs it (the usage line shows it without brackets; checked before `run`). */
  required?: boolean;
}

/** What a command's `run` gets. */
export interface CommandContext {
  /** The positional arguments after the command's name (as many as `args`). */
  positionals: string[];
  /** The command's flags that were given (value flags: their value; flags without value: `""`). */
  flags: Map<string, string>;
  /** `--json`: write one JSON document on stdout. */
  json: boolean;
  /** The open backend (absent for a command with `backend: false`). */
  opened?: OpenedBackend;
  /** Where to write. */
  io: CliIo;
  /** The clock, ms since epoch. */
  now: () => number;
}

/** A subcommand of `botmesh-durable`. */
export interface CliCommand {
  /** Its name (`"retry"`). */
  name: string;
  /** Its positional arguments, as shown in the usage line (`["<key>"]`). */
  args: string[];
  /** Its flags (`--backend`, `--json`, `--help` apply to every command and are not listed here). */
  flags: CliFlag[];
  /** One line for the list of commands. */
  summary: string;
  /** Paragraphs shown by `botmesh-durable <name> --help`, after the usage line. */
  help: string;
  /** Examples shown by its help (command lines without the program name). */
  examples?: string[];
  /** Whether it changes the backend's records (shown in its help; default `false`). */
  changes?: boolean;
  /** Whether it needs a backend (default `true`: `run` gets it open). */
  backend?: boolean;
  /** Whether it takes `--json` (default `true`). */
  json?: boolean;
  /**
   * Checks what the parser cannot (a positional's value, a required flag):
   * throws a {@link UsageError}. Runs before the backend is opened.
   */
  check?(context: Pick<CommandContext, "positionals" | "flags">): void;
  /**
   * Does the work. Throws an {@link OperationError} (exit 1) when it cannot, a
   * {@link UsageError} (exit 2) for a bad value.
   */
  run(context: CommandContext): Promise<void>;
}

/** The backend of a context (for commands that need one). */
export function backendOf(context: CommandContext): DurabilityBackend {
  if (context.opened === undefined) throw new OperationError("This command has no backend");
  return context.opened.backend;
}

/** `--flag`'s value as a positive integer, or `fallback` when the flag is not given. */
export function positiveIntFlag(flags: Map<string, string>, flag: string, fallback: number): number {
  const text = flags.get(flag);
  if (text === undefined) return fallback;
  if (!/^\d+$/.test(text) || Number(text) < 1 || !Number.isSafeInteger(Number(text))) {
    throw new UsageError(`Flag "--${flag}" must be a positive integer, got ${JSON.stringify(text)}`);
  }
  return Number(text);
}

/** The usage line of a command: `botmesh-durable [-b <url>] retry <key> [--json]`. */
export function usageLine(command: CliCommand): string {
  const flags = command.flags.map((f) => {
    const text = f.value === undefined ? `--${f.name}` : `--${f.name} <${f.value}>`;
    return f.required ? text : `[${text}]`;
  });
  return [
    PROGRAM,
    ...(command.backend === false ? [] : ["[-b <url>]"]),
    command.name,
    ...command.args,
    ...flags,
    ...(command.json === false ? [] : ["[--json]"]),
  ].join(" ");
}
