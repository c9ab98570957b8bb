/**
 * The framed append log (`FileDurability`'s `<file>.log`): one record per
 * line, `R <length> <crc32> <json>\n` ({@link frameLogRecord}); reading it
 * back ({@link scanLogRecords}) tells a torn last write, cut off, from
 * damage.
 *
 * Internal to the file backends: not part of the public API.
 *
 * @module
 */
import { FileCorruptError } from "./corrupt_error.ts";

const CRC_TABLE = (() => {
  const table = new Uint32Array(256);
  for (let n = 0; n < 256; n++) {
    let c = n;
    for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
    table[n] = c >>> 0;
  }
  return table;
})();

/**
 * The CRC-32 (IEEE) of `bytes`.
 *
 * @param bytes the data
 * @returns the checksum, an unsigned 32-bit integer
 */
export function crc32(bytes: Uint8Array): number {
  let c = 0xffffffff;
  for (let i = 0; i < bytes.length; i++) c = CRC_TABLE[(c ^ bytes[i]) & 0xff] ^ (c >>> 8);
  return (c ^ 0xffffffff) >>> 0;
}

const logEncoder = new TextEncoder();

/**
 * One record of a framed log: `R <byte length> <crc32, 8 hex digits> <json>\n`.
 *
 * @param json the record's JSON text (no raw newline: `JSON.stringify` never writes one)
 * @returns its bytes
 */
export function frameLogRecord(json: string): Uint8Array {
  const payload = logEncoder.encode(json);
  const header = logEncoder.encode(`R ${payload.length} ${crc32(payload).toString(16).padStart(8, "0")} `);
  const out = new Uint8Array(header.length + payload.length + 1);
  out.set(header, 0);
  out.set(payload, header.length);
  out[out.length - 1] = 10;
  return out;
}

/** The records of a framed log as read by {@link scanLogRecords}. */
export interface ScannedLog {
  /** Each whole record: its byte offset and its parsed JSON. */
  records: { offset: number; value: unknown }[];
  /** The length of the log's whole records: what follows is a torn last write, to be cut off. */
  end: number;
}

/**
 * The record at `pos`, or `null` when there is no whole, intact record there; `"whole"` when a whole
 * frame is there (header, length and final newline all in place) but its payload fails the checksum
 * or is not JSON.
 */
function recordAt(bytes: Uint8Array, pos: number): { value: unknown; next: number } | "whole" | null {
  const n = bytes.length;
  if (bytes[pos] !== 0x52 || bytes[pos + 1] !== 0x20) return null; // "R "
  let i = pos + 2;
  let length = 0;
  const digits = i;
  while (i < n && bytes[i] >= 0x30 && bytes[i] <= 0x39 && i - digits < 12) length = length * 10 + (bytes[i++] - 0x30);
  if (i === digits || bytes[i] !== 0x20) return null;
  i++;
  if (i + 9 > n || bytes[i + 8] !== 0x20) return null;
  const hexText = String.fromCharCode(...bytes.subarray(i, i + 8));
  if (!/^[0-9a-f]{8}$/.test(hexText)) return null;
  const crc = Number.parseInt(hexText, 16);
  i += 9;
  const end = i + length;
  if (end >= n || bytes[end] !== 10) return null;
  const payload = bytes.subarray(i, end);
  if (crc32(payload) !== crc) return "whole";
  try {
    return { value: JSON.parse(new TextDecoder("utf-8", { fatal: true }).decode(payload)), next: end + 1 };
  } catch {
    return "whole";
  }
}

/** Whether an intact record starts after `pos`, at the start of a line. */
function intactRecordAfter(bytes: Uint8Array, pos: number): boolean {
  for (let nl = bytes.indexOf(10, pos); nl >= 0 && nl + 1 < bytes.length; nl = bytes.indexOf(10, nl + 1)) {
    const next = recordAt(bytes, nl + 1);
    if (next !== null && next !== "whole") return true;
  }
  return false;
}

/**
 * Reads a framed log (see {@link frameLogRecord}). A record with no intact
 * record after it that is cut off, or whole but failing its checksum, is
 * the torn last write of a process or machine that died mid-append (never
 * acknowledged: page writeback can leave a whole frame whose middle never
 * reached the disk): it ends the log ({@link ScannedLog.end}). A damaged
 * record with intact records after it is damage.
 *
 * @param file the log file, named in errors
 * @param bytes its content
 * @param label the backend named in errors
 * @returns the intact records and where they end
 * @throws {FileCorruptError} at the offset of a damaged record that intact records follow
 */
export function scanLogRecords(file: string, bytes: Uint8Array, label: string): ScannedLog {
  const records: { offset: number; value: unknown }[] = [];
  let pos = 0;
  while (pos < bytes.length) {
    const found = recordAt(bytes, pos);
    if (found !== null && found !== "whole") {
      records.push({ offset: pos, value: found.value });
      pos = found.next;
      continue;
    }
    if (intactRecordAfter(bytes, pos)) {
      const what = found === "whole" ? "a whole record whose checksum does not match" : "cut short, or its checksum does not match";
      throw new FileCorruptError(file, pos, `log record ${records.length + 1} is damaged (${what}) and intact records follow it`, label);
    }
    break; // a torn last write
  }
  return { records, end: pos };
}
