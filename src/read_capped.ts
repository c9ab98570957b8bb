/**
 * Reading an HTTP body with a size cap and a time limit, for the channel providers.
 *
 * @module
 */
import { type Clock, systemClock } from "./clock.ts";

/** The body was not read to its end within the time allowed (a client that sends slowly or never ends). */
export class ReadTimeoutError extends Error {
  /** The time allowed, in ms. */
  readonly timeoutMs: number;
  /**
   * @param timeoutMs the time allowed, in ms
   */
  constructor(timeoutMs: number) {
    super(`The body was not read to its end within ${timeoutMs} ms`);
    this.name = "ReadTimeoutError";
    this.timeoutMs = timeoutMs;
  }
}

/** The time limit of {@link readCapped}. */
export interface ReadDeadline {
  /** The most time the whole read may take, in ms. */
  timeoutMs: number;
  /** The clock of the timer (default the system's). */
  clock?: Clock;
}

/**
 * Read a body to the end, or stop at `maxBytes` (the rest is cancelled), or at the deadline.
 *
 * @param body a `Request`/`Response` body (`null`: empty)
 * @param maxBytes the largest size accepted
 * @param deadline when given, the whole read must end within `timeoutMs` (the body is cancelled then)
 * @returns the bytes, or `null` when the body is larger than `maxBytes`
 * @throws {ReadTimeoutError} when the deadline passed before the body ended
 * @throws {TypeError} when the stream fails (a network error)
 *
 * @example
 * ```ts
 * import { readCapped } from "./read_capped.ts";
 * const bytes = await readCapped(new Response("hello").body, 1024, { timeoutMs: 10_000 });
 * console.log(bytes?.byteLength); // 5
 * ```
 */
export async function readCapped(
  body: ReadableStream<Uint8Array> | null,
  maxBytes: number,
  deadline?: ReadDeadline,
): Promise<Uint8Array | null> {
  if (body === null) return new Uint8Array();
  const reader = body.getReader();
  const chunks: Uint8Array[] = [];
  let size = 0;
  let timer: unknown;
  let expired: Promise<never> | undefined;
  const clock = deadline?.clock ?? systemClock;
  if (deadline !== undefined) {
    expired = new Promise<never>((_, reject) => {
      timer = clock.setTimeout(() => reject(new ReadTimeoutError(deadline.timeoutMs)), deadline.timeoutMs);
    });
    expired.catch(() => {}); // handled below, by the race it ends
  }
  try {
    for (;;) {
      const { done, value } = await (expired === undefined ? reader.read() : Promise.race([reader.read(), expired]));
      if (done) break;
      size += value.byteLength;
      if (size > maxBytes) {
        // Not awaited, as after the deadline: a source whose cancel never settles must not hold the answer.
        reader.cancel().catch(() => {});
        return null;
      }
      chunks.push(value);
    }
  } catch (error) {
    if (error instanceof ReadTimeoutError) reader.cancel(error).catch(() => {});
    throw error;
  } finally {
    clock.clearTimeout(timer);
    try {
      reader.releaseLock();
    } catch {
      // a read still pending after a cancel (runtimes before the spec let releaseLock reject it)
    }
  }
  const out = new Uint8Array(size);
  let at = 0;
  for (const chunk of chunks) {
    out.set(chunk, at);
    at += chunk.byteLength;
  }
  return out;
}
