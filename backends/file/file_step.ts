/**
 * The errors of one file-system step of a file backend's `open()` or
 * `close()`: the runtime's error, wrapped to name the backend and the file.
 *
 * Internal to the file backends: not part of the public API.
 *
 * @module
 */
import { errorMessage } from "../../src/errors.ts";

/**
 * Runs one file-system step of a backend's `open()`/`close()`; an error of the
 * runtime is wrapped to name the backend and the file (`cause` kept).
 *
 * @param label the backend named in the error (`FileDurability`)
 * @param file the file
 * @param what the step, e.g. `cannot read it`
 * @param run the step
 * @returns what `run` returns
 */
export async function fileStep<T>(label: string, file: string, what: string, run: () => Promise<T>): Promise<T> {
  try {
    return await run();
  } catch (error) {
    if (error instanceof Error && error.message.startsWith(label)) throw error;
    throw new Error(`${label}: ${file}: ${what}: ${errorMessage(error)}`, { cause: error });
  }
}
