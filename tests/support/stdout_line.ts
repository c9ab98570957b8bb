/** One line to stdout with a blocking write, for the child processes of the real-process tests. */
import { writeSync } from "node:fs";

/**
 * Write `line` and a newline to stdout before returning, so that a SIGKILL right after never loses it.
 *
 * @param line the line, without its newline
 */
export function writeLine(line: string): void {
  const bytes = Buffer.from(line + "\n");
  let at = 0;
  while (at < bytes.length) {
    try {
      at += writeSync(1, bytes, at);
    } catch (error) {
      if ((error as NodeJS.ErrnoException).code !== "EAGAIN") throw error;
      Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, 1);
    }
  }
}
