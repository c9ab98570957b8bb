/**
 * A scripted channel on two files, for demos and crash tests: a
 * {@link Provider} that reads inbound messages from an append-only JSON-lines
 * file and writes every send as one JSON line to another.
 *
 * Inbound file, one message per line (anything else on a line is ignored):
 *
 * ```jsonl
 * {"id":"m-1","chatId":"chat-1","text":"hello"}
 * {"id":"m-2","chatId":"chat-2","text":"hi","type":"text"}
 * ```
 *
 * Outbound file, one line per send, appended with a single `write` on a file
 * opened with `O_APPEND`, so lines of concurrent writers (several sends, or
 * several processes) never interleave and a `kill -9` can at worst leave the
 * last line torn; {@link readJsonLines} skips such a line and a writer that
 * opens the file ends it first:
 *
 * ```jsonl
 * {"key":"m-1:1","chatId":"chat-1","content":"echo: hello","messageId":"file-…","attempt":1,"by":"bot-1","at":1718000000000}
 * ```
 *
 * Acknowledgement (spec §9): the channel tails the inbound file from a byte
 * offset, hands each complete line to the bot, and acknowledges a message
 * (moves its offset past it) only once the bot admitted it (or dropped it as
 * a redelivery). A message the bot refused (`rejected`: the journal failed,
 * or the bot is stopping) is read again later. Without `offsetFile` a restart
 * reads the file from the start again and the bot's inbox drops what it has
 * already journaled; with `offsetFile` the acknowledged offset is stored there
 * (atomic rename) and a restart continues from it, so only the few messages
 * admitted but not yet acknowledged when the process died come again.
 *
 * Uses `node:fs/promises` only, so it runs on Bun, Node (20+) and Deno.
 *
 * @example
 * ```ts
 * import { Bot, MemoryDurability } from "../mod.ts";
 * import { FileChannel } from "./file_channel.ts";
 *
 * const channel = new FileChannel({ inbound: "./in.jsonl", outbound: "./out.jsonl", offsetFile: "./in.offset" });
 * const bot = new Bot({ provider: channel, durability: { backend: new MemoryDurability(), instanceId: "bot-1" } });
 * bot.when(/./, (ctx) => ctx.reply(`echo: ${ctx.message.text}`));
 * await bot.start(); // starts tailing ./in.jsonl
 * // … append lines to ./in.jsonl; replies appear in ./out.jsonl …
 * await bot.stop();
 * await channel.close();
 * ```
 *
 * @module
 */
import { open, readFile, rename, stat, writeFile } from "node:fs/promises";
import type { FileHandle } from "node:fs/promises";
import type {
  AdmitResult,
  InboundMessage,
  InboundSink,
  OutboundContent,
  Provider,
  SendConfirmation,
  SendContext,
  SendInQuestion,
  SendReceipt,
} from "../provider.ts";

/** One line of the inbound file. `id` and `chatId` are required; `type` defaults to `'text'`. */
export interface InboundLine {
  /** Stable across redeliveries: the bot's inbox dedupes on it. */
  id: string;
  chatId: string;
  text?: string;
  type?: string;
  [field: string]: unknown;
}

/** One line of the outbound file: one provider call that reached the channel. */
export interface OutboundLine {
  /** The send's idempotency key. */
  key: string;
  chatId: string;
  /** The content as JSON (binary as `{ "$base64": "…" }`). */
  content: unknown;
  /** The id this channel returned for the send. */
  messageId: string;
  /** Which attempt of the send this was (1 for the first). */
  attempt: number;
  /** The channel's `tag` (e.g. the instanceId of the process that sent it). */
  by?: string;
  /** When it was written (ms since epoch). */
  at: number;
}

/** Options of {@link FileChannel}. */
export interface FileChannelOptions {
  /** The inbound file (JSON lines). It need not exist yet; it is tailed. */
  inbound: string;
  /** The outbound file (JSON lines), created when missing. */
  outbound: string;
  /** Where the acknowledged inbound offset is kept; without it a restart reads from the start. */
  offsetFile?: string;
  /** The provider name journaled with each inbound record (default `'file'`). */
  name?: string;
  /** Part of the bot's default instanceId (default: the inbound path). */
  connectionId?: string;
  /** How often to look for new lines when the file has none (default 20 ms). */
  pollMs?: number;
  /** At most this many messages are handed to the bot at once (default 64). */
  batch?: number;
  /**
   * Simulated channel latency per send, in ms: half before the line is
   * written, half after (so a crash can land on either side of it). A
   * function is called once per send. Default 0.
   */
  sendLatencyMs?: number | (() => number);
  /** Written as `by` into every outbound line. */
  tag?: string;
  /**
   * What {@link FileChannel.confirm} answers for a send whose key is not in
   * the outbound file: `'cannot-tell'` (default: another writer's call may
   * still land) or `'never-arrived'`, for a file this process alone writes:
   * a writer that died writes nothing more, so an absent key with no call of
   * this process under way never arrived and can be sent again.
   */
  confirmAbsent?: "cannot-tell" | "never-arrived";
  /** Told about an error reading the inbound file or writing the offset (the channel tries again). */
  onError?: (error: unknown) => void;
  /** Told about inbound lines that are skipped (not JSON, or without a string `id`/`chatId`). */
  onSkip?: (reason: string, line: string, offset: number) => void;
}

/** Counters of a {@link FileChannel}. */
export interface FileChannelStats {
  /** Messages handed to the bot. */
  delivered: number;
  /** … of which it admitted. */
  admitted: number;
  /** … of which it dropped as redeliveries of known ids. */
  duplicates: number;
  /** … of which it refused (they are read again later). */
  rejected: number;
  /** Inbound lines skipped as invalid. */
  skipped: number;
  /** Sends written to the outbound file. */
  sent: number;
  /** The acknowledged inbound offset (bytes). */
  ackedOffset: number;
}

/** A complete line of the inbound file and its byte range. */
interface Line {
  text: string;
  start: number;
  end: number;
}

const NEWLINE = 0x0a;
const CHUNK = 1 << 20;

/**
 * A provider on two JSON-lines files. See the module documentation.
 */
export class FileChannel implements Provider {
  readonly name: string;
  readonly connectionId: string;
  readonly options: Readonly<FileChannelOptions>;
  #stats: FileChannelStats = { delivered: 0, admitted: 0, duplicates: 0, rejected: 0, skipped: 0, sent: 0, ackedOffset: 0 };
  #sink: InboundSink | undefined;
  #loop: Promise<void> | undefined;
  #stopped = true;
  #wake: (() => void) | undefined;
  #out: Promise<FileHandle> | undefined;
  #decoder = new TextDecoder();
  /** Keys of this process's sends under way (a send of them may still be written). */
  #sending = new Map<string, number>();

  /**
   * @param options the files and tuning
   * @throws {TypeError} when `inbound` or `outbound` is not a non-empty string
   */
  constructor(options: FileChannelOptions) {
    for (const key of ["inbound", "outbound"] as const) {
      if (typeof options?.[key] !== "string" || options[key] === "") {
        throw new TypeError(`Option "${key}" must be a non-empty path, got ${JSON.stringify(options?.[key])}`);
      }
    }
    this.options = { ...options };
    this.name = options.name ?? "file";
    this.connectionId = options.connectionId ?? options.inbound;
  }

  /** What this channel has done so far (a copy). */
  get stats(): FileChannelStats {
    return { ...this.#stats };
  }

  /**
   * Called by `bot.start()`: read the acknowledged offset (when `offsetFile`
   * is set) and start tailing the inbound file.
   *
   * @param sink where inbound messages go
   */
  async start(sink: InboundSink): Promise<void> {
    if (!this.#stopped) throw new Error("FileChannel is already started");
    this.#sink = sink;
    this.#stopped = false;
    this.#stats.ackedOffset = await this.#readOffset();
    this.#loop = this.#tail();
  }

  /**
   * Called by `bot.stop()`: stop reading. Messages already handed to the bot
   * are acknowledged (or not) first. Sends may still be written afterwards
   * (the bot finishes in-flight work); {@link close} releases the outbound file.
   */
  async stop(): Promise<void> {
    this.#stopped = true;
    this.#wake?.();
    await this.#loop;
    this.#loop = undefined;
    this.#sink = undefined;
  }

  /** Close the outbound file (after `bot.stop()`); a later send opens it again. */
  async close(): Promise<void> {
    const out = this.#out;
    this.#out = undefined;
    if (out) await (await out.catch(() => undefined))?.close();
  }

  /**
   * Write one outbound line and return its message id.
   *
   * @param chatId the chat
   * @param content what to send
   * @param context the idempotency key and attempt
   * @returns the message id
   */
  async send(chatId: string, content: OutboundContent, context: SendContext): Promise<SendReceipt> {
    const latency = typeof this.options.sendLatencyMs === "function"
      ? this.options.sendLatencyMs()
      : this.options.sendLatencyMs ?? 0;
    const key = context.idempotencyKey;
    this.#sending.set(key, (this.#sending.get(key) ?? 0) + 1);
    try {
      return await this.#send(chatId, content, context, latency);
    } finally {
      const n = this.#sending.get(key)! - 1;
      if (n > 0) this.#sending.set(key, n);
      else this.#sending.delete(key);
    }
  }

  /**
   * Whether a send reached the channel, by its key (`Provider.confirm`): its
   * line in the outbound file, with the message id it got; otherwise see
   * {@link FileChannelOptions.confirmAbsent}.
   *
   * @param send the send in question
   * @returns delivered with its message id, never arrived, or `null` (cannot tell)
   */
  async confirm(send: SendInQuestion): Promise<SendConfirmation | null> {
    const { lines } = await readJsonLines<OutboundLine>(this.options.outbound);
    let line: OutboundLine | undefined;
    for (const l of lines) if (l.key === send.idempotencyKey) line = l;
    if (line !== undefined) return { delivered: true, messageId: line.messageId };
    if (this.options.confirmAbsent !== "never-arrived" || this.#sending.has(send.idempotencyKey)) return null;
    return { delivered: false };
  }

  async #send(chatId: string, content: OutboundContent, context: SendContext, latency: number): Promise<SendReceipt> {
    if (latency > 0) await sleep(latency / 2);
    const messageId = `${this.name}-${crypto.randomUUID()}`;
    const line: OutboundLine = {
      key: context.idempotencyKey,
      chatId,
      content,
      messageId,
      attempt: context.attempt,
      ...(this.options.tag !== undefined ? { by: this.options.tag } : {}),
      at: Date.now(),
    };
    await appendLine(await this.#outbound(), JSON.stringify(line, binaryAsBase64) + "\n");
    this.#stats.sent++;
    if (latency > 0) await sleep(latency / 2);
    return { messageId };
  }

  /** Open the outbound file for appending; end a torn last line left by a killed writer. */
  #outbound(): Promise<FileHandle> {
    this.#out ??= (async () => {
      const handle = await open(this.options.outbound, "a+");
      const { size } = await handle.stat();
      if (size > 0) {
        const last = new Uint8Array(1);
        await handle.read(last, 0, 1, size - 1);
        if (last[0] !== NEWLINE) await appendLine(handle, "\n");
      }
      return handle;
    })();
    this.#out.catch(() => this.#out = undefined);
    return this.#out;
  }

  async #readOffset(): Promise<number> {
    if (this.options.offsetFile === undefined) return 0;
    try {
      const { offset } = JSON.parse(await readFile(this.options.offsetFile, "utf8"));
      return Number.isSafeInteger(offset) && offset >= 0 ? offset : 0;
    } catch {
      return 0; // missing (first start) or unreadable: read from the start, the inbox drops what it knows
    }
  }

  async #writeOffset(offset: number): Promise<void> {
    const file = this.options.offsetFile;
    if (file === undefined) return;
    const tmp = `${file}.tmp`;
    await writeFile(tmp, JSON.stringify({ offset }) + "\n");
    await rename(tmp, file);
  }

  /** The tail loop: read complete lines from the acknowledged offset, hand them to the bot, acknowledge. */
  async #tail(): Promise<void> {
    let offset = this.#stats.ackedOffset;
    const pause = this.options.pollMs ?? 20;
    while (!this.#stopped) {
      try {
        const lines = await this.#readLines(offset);
        if (lines.length === 0) {
          await this.#pause(pause);
          continue;
        }
        const batch = lines.slice(0, this.options.batch ?? 64);
        const acked = await this.#deliver(batch);
        if (acked > offset) {
          offset = acked;
          this.#stats.ackedOffset = acked;
          await this.#writeOffset(acked);
        }
        if (acked < batch[batch.length - 1]!.end) await this.#pause(pause * 5); // refused: try again later
      } catch (error) {
        if ((error as { code?: string }).code !== "ENOENT") this.options.onError?.(error);
        await this.#pause(pause * 5);
      }
    }
  }

  #pause(ms: number): Promise<void> {
    if (this.#stopped) return Promise.resolve();
    return new Promise((resolve) => {
      const timer = setTimeout(done, ms);
      function done() {
        clearTimeout(timer);
        resolve();
      }
      this.#wake = done;
    });
  }

  /** Complete lines from `offset` (at most about 1 MiB, or one longer line). */
  async #readLines(offset: number): Promise<Line[]> {
    const { size } = await stat(this.options.inbound);
    if (size <= offset) return [];
    const handle = await open(this.options.inbound, "r");
    try {
      let length = Math.min(size - offset, CHUNK);
      for (;;) {
        const buffer = new Uint8Array(length);
        const { bytesRead } = await handle.read(buffer, 0, length, offset);
        const bytes = buffer.subarray(0, bytesRead);
        const lastNewline = bytes.lastIndexOf(NEWLINE);
        if (lastNewline < 0) {
          if (bytesRead < length || offset + length >= size) return []; // a line still being written
          length *= 2; // a line longer than the chunk
          continue;
        }
        const lines: Line[] = [];
        let start = 0;
        while (start <= lastNewline) {
          const nl = bytes.indexOf(NEWLINE, start);
          lines.push({ text: this.#decoder.decode(bytes.subarray(start, nl)), start: offset + start, end: offset + nl + 1 });
          start = nl + 1;
        }
        return lines;
      }
    } finally {
      await handle.close();
    }
  }

  /**
   * Hand a batch to the bot (all at once: the bot keeps each chat's order)
   * and return the offset up to which every message was taken.
   */
  async #deliver(batch: Line[]): Promise<number> {
    const sink = this.#sink!;
    const results = await Promise.all(batch.map(async ({ text, end }): Promise<boolean> => {
      const message = this.#parse(text, end);
      if (message === null) return true; // skipped: acknowledge it, it will never be valid
      this.#stats.delivered++;
      let result: AdmitResult;
      try {
        result = await sink.receive(message);
      } catch {
        result = { status: "rejected", id: message.id, error: new Error("receive threw") };
      }
      if (result.status === "rejected") {
        this.#stats.rejected++;
        return false;
      }
      if (result.status === "duplicate") this.#stats.duplicates++;
      else this.#stats.admitted++;
      return true;
    }));
    let acked = batch[0]!.start;
    for (let i = 0; i < batch.length && results[i]; i++) acked = batch[i]!.end;
    return acked;
  }

  #parse(text: string, end: number): InboundMessage | null {
    if (text.trim() === "") return null;
    let line: InboundLine;
    try {
      line = JSON.parse(text);
    } catch {
      this.#skip("not JSON (a torn line?)", text, end);
      return null;
    }
    if (typeof line !== "object" || line === null || typeof line.id !== "string" || line.id === "" ||
      typeof line.chatId !== "string" || line.chatId === "") {
      this.#skip('no string "id" and "chatId"', text, end);
      return null;
    }
    const message: InboundMessage = { id: line.id, chatId: line.chatId, type: line.type ?? "text" };
    if (typeof line.text === "string") message.text = line.text;
    for (const field of ["media", "interaction", "from", "timestamp", "extra"] as const) {
      if (line[field] !== undefined) (message as unknown as Record<string, unknown>)[field] = line[field];
    }
    return message;
  }

  #skip(reason: string, text: string, end: number): void {
    this.#stats.skipped++;
    this.options.onSkip?.(reason, text, end);
  }
}

/**
 * Read a JSON-lines file written by a {@link FileChannel} (or any appender),
 * tolerating a torn last line (no trailing newline) and lines that are not
 * JSON (a torn line a later writer ended).
 *
 * @param path the file
 * @returns the parsed lines, and how many were skipped; a missing file has none
 */
export async function readJsonLines<T = unknown>(path: string): Promise<{ lines: T[]; skipped: number }> {
  let text: string;
  try {
    text = await readFile(path, "utf8");
  } catch (error) {
    if ((error as { code?: string }).code === "ENOENT") return { lines: [], skipped: 0 };
    throw error;
  }
  const parts = text.split("\n");
  const tail = parts.pop()!; // "" after a final newline; otherwise a torn line
  const lines: T[] = [];
  let skipped = tail === "" ? 0 : 1;
  for (const part of parts) {
    if (part.trim() === "") continue;
    try {
      lines.push(JSON.parse(part));
    } catch {
      skipped++;
    }
  }
  return { lines, skipped };
}

/**
 * An appender for a JSON-lines file: each value is written as one line with a
 * single `write` on a handle opened with `O_APPEND`.
 *
 * @param path the file (created when missing)
 * @returns `append(value)` and `close()`
 */
export async function openJsonLinesAppender(
  path: string,
): Promise<{ append(value: unknown): Promise<void>; close(): Promise<void> }> {
  const handle = await open(path, "a");
  return {
    append: (value) => appendLine(handle, JSON.stringify(value, binaryAsBase64) + "\n"),
    close: () => handle.close(),
  };
}

/** One `write` of the whole line (looping only on a short write, which regular files do not do in practice). */
async function appendLine(handle: FileHandle, line: string): Promise<void> {
  const bytes = new TextEncoder().encode(line);
  let written = 0;
  while (written < bytes.length) {
    const { bytesWritten } = await handle.write(bytes, written, bytes.length - written);
    written += bytesWritten;
  }
}

function binaryAsBase64(_key: string, value: unknown): unknown {
  if (value instanceof Uint8Array) {
    let binary = "";
    for (const byte of value) binary += String.fromCharCode(byte);
    return { $base64: btoa(binary) };
  }
  return value;
}

function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}
