/**
 * The registry of the files open in this process, one per process (shared
 * by every copy of this module): every file backend, of any kind, registers
 * its file at `open()`, so that a second backend on the same file in the same
 * process is refused.
 *
 * Internal to the file backends: not part of the public API.
 *
 * @module
 */
import { processGlobal } from "./process_global.ts";

/** Files open in this process (absolute real path → the backend that has it), shared by every copy of this module. */
const OPEN_FILES: Map<string, object> = processGlobal("@botmesh/durable/file:open-files", () => new Map<string, object>());
/** The kind of each registered backend (`'FileDurability'`, `'FileEventJournal'`, …), for messages. */
const OPEN_LABELS: WeakMap<object, string> = processGlobal(
  "@botmesh/durable/file:open-labels",
  () => new WeakMap<object, string>(),
);

/**
 * Register `owner` as the one backend of this process that has `file` open.
 * Every file backend (of any kind) registers its file at `open()`, so two
 * backends on one file in one process refuse each other. Registering the
 * same owner again does nothing.
 *
 * @param file the absolute real path (symlinks resolved) of the file
 * @param owner the backend opening it
 * @param label its kind, named in the error (`'FileDurability'`, `'FileEventJournal'`, …)
 * @throws {Error} when another backend of this process has `file` open; the
 *   message starts with `<label>: <file> is already open in this process`
 */
export function claimOpenFile(file: string, owner: object, label: string): void {
  const current = OPEN_FILES.get(file);
  if (current !== undefined && current !== owner) {
    const other = OPEN_LABELS.get(current) ?? "another backend";
    const through = other === label ? `another ${label}` : `a ${other}`;
    throw new Error(
      `${label}: ${file} is already open in this process through ${through}; close that one first` +
        (other === label ? " (or share one instance between your bots)" : ""),
    );
  }
  OPEN_FILES.set(file, owner);
  OPEN_LABELS.set(owner, label);
}

/**
 * Undo {@link claimOpenFile}: only when `owner` is the one registered for `file`.
 *
 * @param file the absolute real path given to {@link claimOpenFile}
 * @param owner the backend that registered it
 * @returns whether a registration was removed
 */
export function releaseOpenFile(file: string, owner: object): boolean {
  if (OPEN_FILES.get(file) !== owner) return false;
  OPEN_FILES.delete(file);
  return true;
}

/**
 * The backend of this process that has `file` open, if any.
 *
 * @param file an absolute real path
 * @returns the registered backend, or `undefined`
 */
export function openFileOwner(file: string): object | undefined {
  return OPEN_FILES.get(file);
}
