/**
 * The SHA-256 of a text as hex, with Web Crypto: a stable id for a payload
 * that carries none of its own (a provider's unreadable message).
 *
 * @module
 */

const encoder = new TextEncoder();

/**
 * The SHA-256 digest of `text` (UTF-8), as 64 lowercase hex digits.
 *
 * @param text the text to hash
 * @returns the digest in hex
 * @example
 * ```ts
 * import { sha256Hex } from "./sha256_hex.ts";
 * console.log(await sha256Hex("abc")); // "ba7816bf…"
 * ```
 */
export async function sha256Hex(text: string): Promise<string> {
  const digest = new Uint8Array(await crypto.subtle.digest("SHA-256", encoder.encode(text)));
  let hex = "";
  for (const byte of digest) hex += byte.toString(16).padStart(2, "0");
  return hex;
}
