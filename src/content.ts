/**
 * Outbound content as JSON for the outbox: binary (`Uint8Array`, Node's
 * `Buffer`, `ArrayBuffer`) becomes base64; anything that is not plain data
 * (a stream, a Blob, a function, a class instance) cannot be journaled.
 *
 * @module
 */
import type { JsonValue } from "./contract.ts";
import { escapeControls } from "./controls.ts";
import { setOwn } from "./rules.ts";

const BYTES = "$bytes";

/**
 * The deepest nesting of objects and arrays the journal takes (the value itself is level 1). Encoding,
 * decoding, hashing and the backends' `JSON.stringify` all recurse once per level: without a bound, a
 * value nested some thousands of levels deep (a 40 KB `[[[[…]]]]`) overflows the stack on the way in,
 * so that its admission fails the same way on every redelivery. Real content nests a dozen levels at
 * most; 64 leaves room to spare and stays far below any runtime's stack.
 */
export const MAX_CONTENT_DEPTH = 64;

/**
 * The deepest nesting a payload or content read back from a journal may have: {@link MAX_CONTENT_DEPTH}, and
 * one level more for the `{ "$bytes": … }` object that binary at the deepest level is journaled as. A stored
 * value nested deeper was not written by the journal (a hand edit, another writer, a row older than the
 * bound): its record is set aside as damaged, since decoding or printing it would overflow the stack.
 */
export const MAX_STORED_DEPTH: number = MAX_CONTENT_DEPTH + 1;

/**
 * Whether `value` nests objects and arrays deeper than `maxDepth` levels (the value itself is level 1),
 * found without recursion, so that a value nested hundreds of thousands of levels deep is checked in
 * bounded stack.
 *
 * @param value parsed JSON
 * @param maxDepth the deepest nesting allowed
 * @returns whether some object or array lies deeper
 */
export function nestsDeeperThan(value: unknown, maxDepth: number): boolean {
  if (typeof value !== "object" || value === null) return false;
  const stack: Array<[object, number]> = [[value, 1]];
  while (stack.length > 0) {
    const [item, depth] = stack.pop()!;
    if (depth > maxDepth) return true;
    for (const child of Array.isArray(item) ? item : Object.values(item)) {
      if (typeof child === "object" && child !== null) stack.push([child, depth + 1]);
    }
  }
  return false;
}

/** What {@link cutDeepNesting} puts in place of an object or array nested too deep. */
export const CUT_NESTING_MARK = "[cut: nested too deep]";

/**
 * The path of field `key` of the value at `parent` (`""`: the top): `a.b`
 * for a name, `a["two words"]` for any other key. The key comes from the
 * data and the path goes into error messages and logs: quoted, it cannot
 * pass for other fields, and it carries no control or invisible character.
 * @param parent the value's path
 * @param key the field
 * @returns the path
 */
export function fieldPath(parent: string, key: string): string {
  if (/^[A-Za-z_$][\w$]*$/.test(key)) return parent === "" ? key : `${parent}.${key}`;
  return `${parent}[${escapeControls(JSON.stringify(key))}]`;
}

/** Content that cannot be journaled, and why (names the field). */
export class UnencodableContentError extends TypeError {
  /** The path of the offending field, such as `content.media.data`. */
  readonly field: string;
  constructor(field: string, reason: string) {
    super(`Field "${field}" cannot be journaled: ${reason}`);
    this.name = "UnencodableContentError";
    this.field = field;
  }
}

function toBase64(bytes: Uint8Array): string {
  let binary = "";
  for (let i = 0; i < bytes.length; i += 0x8000) {
    binary += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  }
  return btoa(binary);
}

function fromBase64(text: string): Uint8Array {
  const binary = atob(text);
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
  return bytes;
}

function isPlainObject(value: object): boolean {
  const proto = Object.getPrototypeOf(value);
  return proto === Object.prototype || proto === null;
}

function encodeValue(value: unknown, path: string, seen: Set<object>, depth: number): JsonValue {
  switch (typeof value) {
    case "string":
    case "boolean":
      return value;
    case "number":
      if (!Number.isFinite(value)) throw new UnencodableContentError(path, `${value} is not a finite number`);
      return value;
    case "undefined":
      return null;
    case "object":
      break;
    default:
      throw new UnencodableContentError(path, `a ${typeof value} is not data`);
  }
  if (value === null) return null;
  if (value instanceof Uint8Array) return { [BYTES]: toBase64(value) };
  if (value instanceof ArrayBuffer) return { [BYTES]: toBase64(new Uint8Array(value)) };
  if (value instanceof Date) return value.toISOString();
  if (seen.has(value)) throw new UnencodableContentError(path, "it refers to itself");
  if (depth > MAX_CONTENT_DEPTH) {
    throw new UnencodableContentError(path, `it nests deeper than ${MAX_CONTENT_DEPTH} levels of objects and arrays (MAX_CONTENT_DEPTH)`);
  }
  seen.add(value);
  try {
    if (Array.isArray(value)) return value.map((item, i) => encodeValue(item, `${path}[${i}]`, seen, depth + 1));
    if (!isPlainObject(value)) {
      const kind = (value as { constructor?: { name?: string } }).constructor?.name ?? "object";
      throw new UnencodableContentError(path, `a ${kind} is not plain data (send large or streamed media by URL or path)`);
    }
    const out: { [key: string]: JsonValue } = {};
    for (const [key, item] of Object.entries(value)) {
      if (item === undefined) continue;
      // Escape user keys that start with "$" so that they never collide with the binary marker.
      setOwn(out, key.startsWith("$") ? `$${key}` : key, encodeValue(item, fieldPath(path, key), seen, depth + 1));
    }
    return out;
  } finally {
    seen.delete(value);
  }
}

/**
 * Encode content for the journal.
 *
 * @param content a string or a plain object (binary as `Uint8Array`)
 * @param root the name of the value in error messages
 * @returns the JSON form
 * @throws {UnencodableContentError} naming the field that is not data, or the first one nested deeper
 *   than {@link MAX_CONTENT_DEPTH} levels
 */
export function encodeContent(content: unknown, root = "content"): JsonValue {
  return encodeValue(content, root, new Set(), 1);
}

/**
 * A copy of parsed JSON (`JSON.parse`'s output: a tree) whose objects and arrays nested deeper than
 * `maxDepth` levels are replaced by {@link CUT_NESTING_MARK}, without recursion (a value nested
 * hundreds of thousands of levels deep is copied in bounded stack). The providers keep what they cannot
 * read of an update this way, so that it can be journaled.
 *
 * @param value parsed JSON
 * @param maxDepth the deepest nesting kept (the value itself is level 1), a positive integer
 * @param root how `cutAt` names the value itself (`""`: paths start at its fields)
 * @returns the copy, and the path of the first object or array cut (in document order), `undefined` when none was
 * @example
 * ```ts
 * import { cutDeepNesting } from "./content.ts";
 * cutDeepNesting({ a: [[1]] }, 2); // { value: { a: ["[cut: nested too deep]"] }, cutAt: "a[0]" }
 * ```
 */
export function cutDeepNesting(value: unknown, maxDepth: number, root = ""): { value: unknown; cutAt: string | undefined } {
  if (typeof value !== "object" || value === null) return { value, cutAt: undefined };
  if (maxDepth < 1) return { value: CUT_NESTING_MARK, cutAt: root };
  type Frame = { from: object; into: Record<string, unknown> | unknown[]; depth: number; path: string };
  const top: Record<string, unknown> | unknown[] = Array.isArray(value) ? [] : {};
  const stack: Frame[] = [{ from: value, into: top, depth: 1, path: root }];
  let cutAt: string | undefined;
  while (stack.length > 0) {
    const frame = stack.pop()!;
    const children: Frame[] = [];
    const items: Array<[string | number, unknown]> = Array.isArray(frame.from)
      ? frame.from.map((item, i) => [i, item])
      : Object.entries(frame.from);
    for (const [key, item] of items) {
      const path = typeof key === "number" ? `${frame.path}[${key}]` : fieldPath(frame.path, key);
      let copy: unknown = item;
      if (typeof item === "object" && item !== null) {
        if (frame.depth >= maxDepth) {
          cutAt ??= path;
          copy = CUT_NESTING_MARK;
        } else {
          copy = Array.isArray(item) ? [] : {};
          children.push({ from: item, into: copy as Frame["into"], depth: frame.depth + 1, path });
        }
      }
      if (Array.isArray(frame.into)) frame.into.push(copy);
      else setOwn(frame.into, key as string, copy);
    }
    // Depth first, in document order: the first child is taken next.
    for (let i = children.length - 1; i >= 0; i--) stack.push(children[i]!);
  }
  return { value: top, cutAt };
}

/**
 * Decode journaled content: the inverse of {@link encodeContent}.
 *
 * @param json the JSON form
 * @param root the name of the value in error messages
 * @returns the content, binary as `Uint8Array`
 * @throws {TypeError} when it nests deeper than {@link MAX_STORED_DEPTH} levels (the journal writes none such)
 */
export function decodeContent(json: JsonValue, root = "content"): unknown {
  if (nestsDeeperThan(json, MAX_STORED_DEPTH)) {
    throw new TypeError(`Field "${root}" cannot be decoded: it nests deeper than ${MAX_STORED_DEPTH} levels of objects and arrays (MAX_STORED_DEPTH)`);
  }
  return decodeValue(json);
}

function decodeValue(json: JsonValue): unknown {
  if (json === null || typeof json !== "object") return json;
  if (Array.isArray(json)) return json.map(decodeValue);
  const keys = Object.keys(json);
  if (keys.length === 1 && keys[0] === BYTES && typeof json[BYTES] === "string") return fromBase64(json[BYTES]);
  const out: Record<string, unknown> = {};
  for (const key of keys) setOwn(out, key.startsWith("$$") ? key.slice(1) : key, decodeValue(json[key]!));
  return out;
}

/**
 * A 53-bit hash of a string (cyrb53), as hex. Used to tell whether a reused
 * idempotency key carries different content; not a security measure.
 *
 * @param text the text
 * @param seed another seed gives another hash of the same text (default 0)
 * @returns 14 hex digits
 */
export function hashText(text: string, seed = 0): string {
  let h1 = 0xdeadbeef ^ seed;
  let h2 = 0x41c6ce57 ^ seed;
  for (let i = 0; i < text.length; i++) {
    const ch = text.charCodeAt(i);
    h1 = Math.imul(h1 ^ ch, 2654435761);
    h2 = Math.imul(h2 ^ ch, 1597334677);
  }
  h1 = Math.imul(h1 ^ (h1 >>> 16), 2246822507) ^ Math.imul(h2 ^ (h2 >>> 13), 3266489909);
  h2 = Math.imul(h2 ^ (h2 >>> 16), 2246822507) ^ Math.imul(h1 ^ (h1 >>> 13), 3266489909);
  return (4294967296 * (2097151 & h2) + (h1 >>> 0)).toString(16).padStart(14, "0");
}

const encoder = new TextEncoder();

/**
 * Whether the UTF-8 form of `text` is larger than `limit` bytes, without
 * encoding it when its length alone decides.
 *
 * @param text the text
 * @param limit the size limit in bytes
 * @returns whether it is over the limit
 */
export function isOverUtf8Limit(text: string, limit: number): boolean {
  if (text.length * 3 <= limit) return false;
  if (text.length > limit) return true;
  return encoder.encode(text).length > limit;
}
