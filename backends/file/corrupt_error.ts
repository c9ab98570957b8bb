/**
 * {@link FileCorruptError}: a file of a file backend (a snapshot, a log)
 * cannot be used, with the byte offset of the first problem when known.
 *
 * @module
 */

/** The message of a {@link FileCorruptError}. */
function corruptMessage(file: string, offset: number | null, detail: string, label: string): string {
  const where = offset === null ? "" : ` at byte ${offset}`;
  return `${label}: ${file} is damaged${where}: ${detail}. The file was left untouched; ` +
    `restore it from a backup or move it away to start empty.`;
}

/** A snapshot file cannot be used: damaged JSON, invalid UTF-8, or an invalid structure. */
export class FileCorruptError extends Error {
  /** The snapshot file (absolute path). */
  readonly file: string;
  /** Byte offset of the first problem (syntax and encoding errors), or `null` for a structure error. */
  readonly offset: number | null;

  /**
   * @param file the snapshot file
   * @param offset the byte offset, or `null`
   * @param detail what is wrong
   * @param label the backend named at the start of the message (default `'FileDurability'`)
   */
  constructor(file: string, offset: number | null, detail: string, label: string = "FileDurability") {
    super(corruptMessage(file, offset, detail, label));
    this.name = "FileCorruptError";
    this.file = file;
    this.offset = offset;
  }
}
