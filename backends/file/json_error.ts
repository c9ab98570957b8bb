/**
 * Where a file stops being UTF-8 JSON ({@link findJsonSyntaxError}): the
 * failure path of a snapshot read only, since `JSON.parse` does not say
 * where, on every runtime.
 *
 * Internal to the file backends: not part of the public API.
 *
 * @module
 */

/**
 * The first encoding or JSON syntax error of `bytes`: its byte offset and
 * what is wrong, or `null` when the bytes are valid UTF-8 JSON (a leading
 * BOM is skipped). Iterative: any nesting depth.
 *
 * @param bytes the content of a file (or of one line of a log)
 * @returns the offset and the reason, or `null`
 */
export function findJsonSyntaxError(bytes: Uint8Array): { offset: number; reason: string } | null {
  return findUtf8Error(bytes) ?? findJsonError(bytes);
}
/** The offset of the first byte of an invalid UTF-8 sequence. */
function findUtf8Error(b: Uint8Array): { offset: number; reason: string } | null {
  const n = b.length;
  let i = 0;
  while (i < n) {
    const c = b[i];
    if (c < 0x80) {
      i++;
      continue;
    }
    let need: number;
    let lo = 0x80;
    let hi = 0xbf;
    if (c >= 0xc2 && c <= 0xdf) need = 1;
    else if (c >= 0xe0 && c <= 0xef) {
      need = 2;
      if (c === 0xe0) lo = 0xa0; // no overlong forms
      if (c === 0xed) hi = 0x9f; // no surrogates
    } else if (c >= 0xf0 && c <= 0xf4) {
      need = 3;
      if (c === 0xf0) lo = 0x90;
      if (c === 0xf4) hi = 0x8f; // at most U+10FFFF
    } else {
      return { offset: i, reason: `invalid UTF-8 (byte 0x${hex(c)} cannot start a character)` };
    }
    for (let k = 1; k <= need; k++) {
      if (i + k >= n) return { offset: i, reason: "invalid UTF-8 (a character is cut off by the end of the file: truncated?)" };
      const d = b[i + k];
      const min = k === 1 ? lo : 0x80;
      const max = k === 1 ? hi : 0xbf;
      if (d < min || d > max) {
        return { offset: i, reason: `invalid UTF-8 (byte 0x${hex(d)} at ${i + k} does not continue the character)` };
      }
    }
    i += need + 1;
  }
  return null;
}

function hex(byte: number): string {
  return byte.toString(16).toUpperCase().padStart(2, "0");
}

/** Describes the byte at `i` for a syntax message. */
function describeAt(b: Uint8Array, i: number): string {
  if (i >= b.length) return "the end of the file (truncated?)";
  const c = b[i];
  return c >= 0x20 && c < 0x7f ? `${JSON.stringify(String.fromCharCode(c))}` : `byte 0x${hex(c)}`;
}

/** Scanner modes: a value is expected, an object key is expected, a value just ended. */
const Mode = { Value: 0, Key: 1, After: 2 } as const;

/** A JSON syntax checker over bytes (iterative: any nesting depth). */
function findJsonError(b: Uint8Array): { offset: number; reason: string } | null {
  const n = b.length;
  let i = b[0] === 0xef && b[1] === 0xbb && b[2] === 0xbf ? 3 : 0;
  const stack: number[] = []; // 0: array, 1: object
  let mode: number = Mode.Value;
  const err = (reason: string) => ({ offset: i, reason });
  const isDigit = (c: number) => c >= 0x30 && c <= 0x39;
  const skipSpace = () => {
    while (i < n && (b[i] === 0x20 || b[i] === 0x0a || b[i] === 0x0d || b[i] === 0x09)) i++;
  };
  const scanString = (): { offset: number; reason: string } | null => {
    i++; // the opening quote
    for (;;) {
      if (i >= n) return err("unterminated string: the end of the file (truncated?)");
      const c = b[i];
      if (c === 0x22) {
        i++;
        return null;
      }
      if (c === 0x5c) {
        const e = b[i + 1];
        if (e === 0x75) {
          for (let k = 2; k < 6; k++) {
            const h = b[i + k];
            const ok = h !== undefined && (isDigit(h) || (h >= 0x41 && h <= 0x46) || (h >= 0x61 && h <= 0x66));
            if (!ok) {
              i += k;
              return err(`invalid \\u escape: expected a hex digit, found ${describeAt(b, i)}`);
            }
          }
          i += 6;
          continue;
        }
        if (e === undefined || !'"\\/bfnrt'.includes(String.fromCharCode(e))) {
          i++;
          return err(`invalid escape in a string: ${describeAt(b, i)}`);
        }
        i += 2;
        continue;
      }
      if (c < 0x20) return err(`control character 0x${hex(c)} in a string (must be escaped)`);
      i++;
    }
  };
  const scanNumber = (): { offset: number; reason: string } | null => {
    if (b[i] === 0x2d) i++;
    if (b[i] === 0x30) i++;
    else if (i < n && isDigit(b[i])) while (i < n && isDigit(b[i])) i++;
    else return err(`invalid number: expected a digit, found ${describeAt(b, i)}`);
    if (b[i] === 0x2e) {
      i++;
      if (!(i < n && isDigit(b[i]))) return err(`invalid number: expected a digit after ".", found ${describeAt(b, i)}`);
      while (i < n && isDigit(b[i])) i++;
    }
    if (b[i] === 0x65 || b[i] === 0x45) {
      i++;
      if (b[i] === 0x2b || b[i] === 0x2d) i++;
      if (!(i < n && isDigit(b[i]))) return err(`invalid number: expected an exponent digit, found ${describeAt(b, i)}`);
      while (i < n && isDigit(b[i])) i++;
    }
    return null;
  };
  const scanWord = (word: string): { offset: number; reason: string } | null => {
    for (let k = 0; k < word.length; k++, i++) {
      if (b[i] !== word.charCodeAt(k)) return err(`invalid literal (expected ${JSON.stringify(word)}), found ${describeAt(b, i)}`);
    }
    return null;
  };
  for (;;) {
    skipSpace();
    if (mode === Mode.Value) {
      const c = b[i];
      let problem: { offset: number; reason: string } | null = null;
      if (c === 0x5b || c === 0x7b) {
        stack.push(c === 0x5b ? 0 : 1);
        i++;
        skipSpace();
        if (b[i] === (c === 0x5b ? 0x5d : 0x7d)) {
          i++;
          stack.pop();
          mode = Mode.After;
        } else {
          mode = c === 0x5b ? Mode.Value : Mode.Key;
        }
        continue;
      }
      if (c === 0x22) problem = scanString();
      else if (c === 0x2d || (c !== undefined && isDigit(c))) problem = scanNumber();
      else if (c === 0x74) problem = scanWord("true");
      else if (c === 0x66) problem = scanWord("false");
      else if (c === 0x6e) problem = scanWord("null");
      else return err(`expected a value, found ${describeAt(b, i)}`);
      if (problem) return problem;
      mode = Mode.After;
    } else if (mode === Mode.Key) {
      if (b[i] !== 0x22) return err(`expected a string key, found ${describeAt(b, i)}`);
      const problem = scanString();
      if (problem) return problem;
      skipSpace();
      if (b[i] !== 0x3a) return err(`expected ":" after a key, found ${describeAt(b, i)}`);
      i++;
      mode = Mode.Value;
    } else {
      if (stack.length === 0) return i >= n ? null : err(`unexpected ${describeAt(b, i)} after the end of the JSON value`);
      const inObject = stack[stack.length - 1] === 1;
      if (b[i] === 0x2c) {
        i++;
        mode = inObject ? Mode.Key : Mode.Value;
      } else if (b[i] === (inObject ? 0x7d : 0x5d)) {
        i++;
        stack.pop();
      } else {
        return err(`expected "," or "${inObject ? "}" : "]"}", found ${describeAt(b, i)}`);
      }
    }
  }
}
