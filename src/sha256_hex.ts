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

/**
 * `JSON.stringify(value)` of parsed JSON (`JSON.parse`'s output: a tree), without recursion: the same
 * text at any depth, where `JSON.stringify` overflows the stack some thousands of levels down. What a
 * provider hashes for the id of a payload nested too deep to be kept whole, so that two such payloads
 * get two ids (the copy it keeps, cut at a depth, may be the same for both).
 *
 * @param value parsed JSON
 * @returns the JSON text; `undefined` for `undefined`, a function or a symbol (as `JSON.stringify`)
 * @throws {TypeError} when the value refers to itself, or holds a bigint
 * @example
 * ```ts
 * import { jsonText } from "./sha256_hex.ts";
 * console.log(jsonText({ a: [1, "x", null] })); // {"a":[1,"x",null]}
 * ```
 */
export function jsonText(value: unknown): string | undefined {
  const skipped = (v: unknown) => v === undefined || typeof v === "function" || typeof v === "symbol";
  if (skipped(value)) return undefined;
  const out: string[] = [];
  const seen = new Set<object>();
  // Pending work, last first: a piece of text to write as it is, or a value to write as JSON.
  const stack: Array<{ text: string } | { value: unknown }> = [{ value }];
  while (stack.length > 0) {
    const item = stack.pop()!;
    if ("text" in item) {
      out.push(item.text);
      continue;
    }
    const v = item.value;
    if (typeof v !== "object" || v === null) {
      out.push(skipped(v) ? "null" : JSON.stringify(v));
      continue;
    }
    if (seen.has(v)) throw new TypeError("jsonText: the value refers to itself (or holds one object twice)");
    seen.add(v);
    const parts: Array<{ text: string } | { value: unknown }> = [];
    if (Array.isArray(v)) {
      parts.push({ text: "[" });
      v.forEach((element, i) => parts.push(...(i > 0 ? [{ text: "," }] : []), { value: element }));
      parts.push({ text: "]" });
    } else {
      parts.push({ text: "{" });
      let first = true;
      for (const [key, element] of Object.entries(v)) {
        if (skipped(element)) continue;
        parts.push({ text: `${first ? "" : ","}${JSON.stringify(key)}:` }, { value: element });
        first = false;
      }
      parts.push({ text: "}" });
    }
    for (let i = parts.length - 1; i >= 0; i--) stack.push(parts[i]!);
  }
  return out.join("");
}
