/**
 * Reading an HTTP body with a size cap, for the channel providers.
 *
 * @module
 */

/**
 * Read a body to the end, or stop at `maxBytes` (the rest is cancelled).
 *
 * @param body a `Request`/`Response` body (`null`: empty)
 * @param maxBytes the largest size accepted
 * @returns the bytes, or `null` when the body is larger than `maxBytes`
 * @throws {TypeError} when the stream fails (a network error)
 *
 * @example
 * ```ts
 * import { readCapped } from "./read_capped.ts";
 * const bytes = await readCapped(new Response("hello").body, 1024);
 * console.log(bytes?.byteLength); // 5
 * ```
 */
export async function readCapped(body: ReadableStream<Uint8Array> | null, maxBytes: number): Promise<Uint8Array | null> {
  if (body === null) return new Uint8Array();
  const reader = body.getReader();
  const chunks: Uint8Array[] = [];
  let size = 0;
  try {
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      size += value.byteLength;
      if (size > maxBytes) {
        await reader.cancel().catch(() => {});
        return null;
      }
      chunks.push(value);
    }
  } finally {
    reader.releaseLock();
  }
  const out = new Uint8Array(size);
  let at = 0;
  for (const chunk of chunks) {
    out.set(chunk, at);
    at += chunk.byteLength;
  }
  return out;
}
