/**
 * The built-in subcommands of `botmesh-durable`: list, show, replay, retry,
 * mark-delivered, discard, purge, stats, damaged (each a {@link CliCommand}).
 *
 * @module
 */
import type { InboundRecord, InboundState, ListOptions, OutboxEntry, OutboxState } from "../contract.ts";
import { parseDuration } from "../config.ts";
import { listDamaged } from "../engine.ts";
import { errorOneLine } from "./console_error.ts";
import { cutForShow } from "./console_render.ts";
import { INBOX_MACHINE, OUTBOX_MACHINE } from "../machine.ts";
import { MAX_MESSAGE_ID_LENGTH, markDeliveredInJournal } from "./mark_delivered.ts";
import { escapeControls, foldSpaces } from "./terminal_text.ts";
import { countRecords, INBOX_STATES, OUTBOX_STATES } from "./prometheus.ts";

/** `"a"`, `"a" or "b"`: states for a help line. */
function quoted(states: readonly string[]): string {
  return states.map((s) => JSON.stringify(s)).join(" or ");
}
import {
  backendOf,
  type CliCommand,
  type CommandContext,
  OperationError,
  positiveIntFlag,
  UsageError,
} from "./cli_command.ts";

const out = (c: CommandContext, value: unknown): void | Promise<void> => c.io.stdout(JSON.stringify(value, null, 2) + "\n");

function journalArg(command: string, value: string | undefined): void {
  if (value !== "inbox" && value !== "outbox") {
    throw new UsageError(`"${command}" takes "inbox" or "outbox", got ${JSON.stringify(value)}`);
  }
}

function states<S extends string>(text: string, allowed: readonly S[], journal: string): S[] {
  const list = text.split(",").map((s) => s.trim());
  for (const s of list) {
    if (!allowed.includes(s as S)) {
      throw new UsageError(`Flag "--state" has ${JSON.stringify(s)}, not a ${journal} state; use ${allowed.join(", ")}`);
    }
  }
  return list as S[];
}

function olderThan(text: string): number {
  if (/^\d+$/.test(text)) return Number(text);
  try {
    return parseDuration(text, "--older-than");
  } catch {
    throw new UsageError(`Flag "--older-than" must be a duration like 7d, 12h, 30m or a number of ms, got ${JSON.stringify(text)}`);
  }
}

/** `list <inbox|outbox>`. */
export const listCommand: CliCommand = {
  name: "list",
  args: ["<inbox|outbox>"],
  flags: [
    { name: "state", value: "s[,s…]", help: "only records in these states" },
    { name: "chat", value: "id", help: "only records of this chat" },
    { name: "limit", value: "n", help: "at most n records (default 100)" },
  ],
  summary: "list inbox records or outbox entries",
  help: `Lists inbox records or outbox entries, oldest first, as a table (or a JSON array with --json).
The ERROR column has the last error's message and causes on one line, shortened, without its stack
frames ("show" and --json give all of it).
Inbox states: ${INBOX_STATES.join(", ")}
Outbox states: ${OUTBOX_STATES.join(", ")}`,
  examples: ["list inbox --state dead", "list outbox --state dead,unknown --chat 42 --json"],
  check({ positionals, flags }) {
    journalArg("list", positionals[0]);
    positiveIntFlag(flags, "limit", 100);
    const text = flags.get("state");
    if (text === undefined) return;
    if (positionals[0] === "inbox") states(text, INBOX_STATES, "inbox");
    else states(text, OUTBOX_STATES, "outbox");
  },
  async run(c) {
    const backend = backendOf(c);
    const limit = positiveIntFlag(c.flags, "limit", 100);
    const chatId = c.flags.get("chat");
    const stateText = c.flags.get("state");
    if (c.positionals[0] === "inbox") {
      const opts: ListOptions<InboundState> = { limit };
      if (stateText !== undefined) opts.state = states(stateText, INBOX_STATES, "inbox");
      if (chatId !== undefined) opts.chatId = chatId;
      const records = await backend.inbox.list(opts);
      if (c.json) return void (await out(c, records));
      await c.io.stdout(
        records.length === 0 ? "No inbox records match.\n" : table(
          ["ID", "STATE", "CHAT", "KIND", "ATTEMPTS", "RECEIVED", "ERROR"],
          records.map((r) => [r.id, r.state, r.chatId, r.kind, String(r.attempts), iso(r.receivedAt), errorCell(r.error)]),
        ) + footer(records.length, limit),
      );
      return;
    }
    const opts: ListOptions<OutboxState> = { limit };
    if (stateText !== undefined) opts.state = states(stateText, OUTBOX_STATES, "outbox");
    if (chatId !== undefined) opts.chatId = chatId;
    const entries = await backend.outbox.list(opts);
    if (c.json) return void (await out(c, entries));
    await c.io.stdout(
      entries.length === 0 ? "No outbox entries match.\n" : table(
        ["KEY", "STATE", "CHAT", "ATTEMPTS", "CREATED", "MESSAGE ID", "ERROR"],
        entries.map((e) => [e.key, e.state, e.chatId, String(e.attempts), iso(e.createdAt), e.messageId ?? "", errorCell(e.error)]),
      ) + footer(entries.length, limit),
    );
  },
};

/** `show <inbox|outbox> <id>`. */
export const showCommand: CliCommand = {
  name: "show",
  args: ["<inbox|outbox>", "<id>"],
  flags: [],
  summary: "one record in full",
  help: "Shows one inbox record (by id) or outbox entry (by key) with every field, its payload or content included.",
  examples: ["show inbox 9f1c2a", "show outbox 9f1c2a:0 --json"],
  check({ positionals }) {
    journalArg("show", positionals[0]);
  },
  async run(c) {
    const backend = backendOf(c);
    const [journal, id] = c.positionals as [string, string];
    const record = journal === "inbox" ? await backend.inbox.get(id) : await backend.outbox.get(id);
    if (record === null) {
      throw new OperationError(
        journal === "inbox" ? `Inbox record ${JSON.stringify(id)} not found` : `Outbox entry ${JSON.stringify(id)} not found`,
      );
    }
    const [field, value] = "payload" in record ? ["payload", record.payload] as const : ["content", record.content] as const;
    const { value: shown, note } = cutForShow(value, field);
    const cut = { ...record, [field]: shown };
    if (c.json) return void (await out(c, cut));
    await c.io.stdout(describe(cut as InboundRecord | OutboxEntry) + (note === "" ? "" : `${note}\n`));
  },
};

/** `replay <id>`. */
export const replayCommand: CliCommand = {
  name: "replay",
  args: ["<id>"],
  flags: [],
  changes: true,
  summary: "make an inbound record (done, failed, dead) pending again",
  help: `Makes an inbox record that is done, failed or dead pending again: a running bot processes it on its
next sweep. Exits 1 when the record does not exist or is pending or processing.`,
  examples: ["replay 9f1c2a"],
  async run(c) {
    const backend = backendOf(c);
    const id = c.positionals[0]!;
    const replayed = await backend.inbox.replay(id);
    const record = await backend.inbox.get(id);
    const why = replayed ? null : record === null
      ? `Inbox record ${JSON.stringify(id)} not found`
      : `Inbox record ${JSON.stringify(id)} is ${record.state}: only done, failed and dead records can be replayed`;
    if (c.json) await out(c, { command: "replay", id, ok: replayed, state: record?.state ?? null, error: why });
    if (why !== null) throw new OperationError(why);
    if (!c.json) {
      await c.io.stdout(`Inbox record ${JSON.stringify(id)} is pending again: a running bot processes it on its next sweep.\n`);
    }
  },
};

/** `retry <key>`. */
export const retryCommand: CliCommand = {
  name: "retry",
  args: ["<key>"],
  flags: [],
  changes: true,
  summary: "requeue an outbox entry (dead, failed, unknown)",
  help: `Queues an outbox entry that is dead, failed or unknown again (attempts reset): a running bot sends it
on its next sweep. An "unknown" entry may have been delivered already: retrying it can send it twice.
Exits 1 when the entry does not exist or is in another state.`,
  examples: ["retry 9f1c2a:0", "retry 9f1c2a:0 --json"],
  async run(c) {
    const backend = backendOf(c);
    const key = c.positionals[0]!;
    const requeued = await backend.outbox.retry(key);
    const entry = await backend.outbox.get(key);
    const why = requeued ? null : entry === null
      ? `Outbox entry ${JSON.stringify(key)} not found`
      : `Outbox entry ${JSON.stringify(key)} is ${entry.state}: only dead, failed and unknown entries can be retried`;
    if (c.json) await out(c, { command: "retry", key, ok: requeued, state: entry?.state ?? null, error: why });
    if (why !== null) throw new OperationError(why);
    if (!c.json) await c.io.stdout(`Outbox entry ${JSON.stringify(key)} is queued again: a running bot sends it on its next sweep.\n`);
  },
};

/** `mark-delivered <key>`. */
export const markDeliveredCommand: CliCommand = {
  name: "mark-delivered",
  args: ["<key>"],
  flags: [{ name: "message-id", value: "id", help: "the provider's message id, if you know it" }],
  changes: true,
  summary: "record an unknown send as delivered, without sending it again",
  help: `Records an outbox entry that is unknown (the send may or may not have arrived) as sent, without calling
the provider again: for when you checked the chat and the message is there. --message-id gives the
provider's message id, if you know it. The entry is written under its own fencing token, as a late
outcome of the lost call would be: if it was retried or settled meanwhile, nothing changes. It acts
on the journal alone: a running bot counts nothing and emits no event for it.
Exits 1 when the entry does not exist or is in another state than unknown.`,
  examples: ["mark-delivered 9f1c2a:0", "mark-delivered 9f1c2a:0 --message-id 4711 --json"],
  check({ flags }) {
    messageIdFlag(flags);
  },
  async run(c) {
    const backend = backendOf(c);
    const key = c.positionals[0]!;
    const messageId = messageIdFlag(c.flags);
    const marked = await markDeliveredInJournal(backend, key, messageId);
    const entry = await backend.outbox.get(key);
    const why = marked ? null : entry === null
      ? `Outbox entry ${JSON.stringify(key)} not found`
      : `Outbox entry ${JSON.stringify(key)} is ${entry.state}: only ${
        quoted(OUTBOX_MACHINE.transitions.markDelivered.from)
      } entries can be marked as delivered`;
    if (c.json) {
      await out(c, { command: "mark-delivered", key, ok: marked, state: entry?.state ?? null, messageId, error: why });
    }
    if (why !== null) throw new OperationError(why);
    if (!c.json) {
      await c.io.stdout(
        `Outbox entry ${JSON.stringify(key)} is marked as delivered (sent${
          messageId === "" ? "" : `, message id ${JSON.stringify(messageId)}`
        }): it is not sent again.\n`,
      );
    }
  },
};

/** `--message-id`, trimmed (`""` when not given). */
function messageIdFlag(flags: Map<string, string>): string {
  const id = (flags.get("message-id") ?? "").trim();
  if (id.length > MAX_MESSAGE_ID_LENGTH) {
    throw new UsageError(`Flag "--message-id" is too long: ${id.length} characters, at most ${MAX_MESSAGE_ID_LENGTH}`);
  }
  return id;
}

/** `discard <key>`. */
export const discardCommand: CliCommand = {
  name: "discard",
  args: ["<key>"],
  flags: [],
  changes: true,
  summary: "forget an outbox entry (not while it is being sent)",
  help: "Deletes an outbox entry in any state but sending. Exits 1 when it does not exist or is being sent.",
  examples: ["discard 9f1c2a:0"],
  async run(c) {
    const backend = backendOf(c);
    const key = c.positionals[0]!;
    const before = await backend.outbox.get(key);
    const discarded = before !== null && await backend.outbox.discard(key);
    const why = discarded ? null : before === null
      ? `Outbox entry ${JSON.stringify(key)} not found`
      : `Outbox entry ${JSON.stringify(key)} is being sent: it cannot be discarded now`;
    if (c.json) await out(c, { command: "discard", key, ok: discarded, state: before?.state ?? null, error: why });
    if (why !== null) throw new OperationError(why);
    if (!c.json) await c.io.stdout(`Outbox entry ${JSON.stringify(key)} (${before!.state}) discarded.\n`);
  },
};

/** `purge --older-than <d>`. */
export const purgeCommand: CliCommand = {
  name: "purge",
  args: [],
  flags: [{ name: "older-than", value: "7d|12h|30m|ms", help: "records last changed more than this long ago", required: true }],
  changes: true,
  summary: `delete inbox ${quoted(INBOX_MACHINE.transitions.purge.from)} and outbox ${
    quoted(OUTBOX_MACHINE.transitions.purge.from)
  } records older than that`,
  help: `Deletes inbox records that are done and outbox entries that are sent, last changed more than
--older-than ago, in batches (progress on stderr). Nothing else is ever purged.`,
  examples: ["purge --older-than 7d", "purge --older-than 3600000 --json"],
  check({ flags }) {
    olderThan(flags.get("older-than")!);
  },
  async run(c) {
    const backend = backendOf(c);
    const ms = olderThan(c.flags.get("older-than")!);
    let inbox = 0;
    let outbox = 0;
    const progress = (): void | Promise<void> => c.io.stderr(`purging: ${inbox} inbox records, ${outbox} outbox entries so far\n`);
    for (let n = await backend.inbox.purge(ms); n > 0; n = await backend.inbox.purge(ms)) {
      inbox += n;
      await progress();
    }
    for (let n = await backend.outbox.purge(ms); n > 0; n = await backend.outbox.purge(ms)) {
      outbox += n;
      await progress();
    }
    if (c.json) return void (await out(c, { command: "purge", olderThanMs: ms, inbox, outbox }));
    await c.io.stdout(
      `Purged ${inbox} inbox record${inbox === 1 ? "" : "s"} (done) and ${outbox} outbox entr${
        outbox === 1 ? "y" : "ies"
      } (sent) last changed more than ${duration(ms)} ago.\n`,
    );
  },
};

/** `damaged`. */
export const damagedCommand: CliCommand = {
  name: "damaged",
  args: [],
  flags: [{ name: "limit", value: "n", help: "at most n per journal (default 100)" }],
  summary: "records the backend could not read and set aside (kept, never deleted)",
  help: `Lists the records the backend could not read back (a payload that is not JSON, an unknown state…)
and set aside: they are kept as stored, never deleted; repair or remove them with the backend's own tools.`,
  examples: ["damaged", "damaged --json"],
  check({ flags }) {
    positiveIntFlag(flags, "limit", 100);
  },
  async run(c) {
    const limit = positiveIntFlag(c.flags, "limit", 100);
    const records = await listDamaged(backendOf(c), { limit });
    const truncated = (["inbox", "outbox"] as const).some((j) => records.filter((d) => d.journal === j).length >= limit);
    if (c.json) return void (await out(c, records));
    await c.io.stdout(
      records.length === 0 ? "No damaged records.\n" : table(
        ["JOURNAL", "ID", "SET ASIDE", "REPORTED", "PROBLEM"],
        records.map((d) => [d.journal, d.id, iso(d.setAsideAt), d.reported ? "yes" : "no", d.problem]),
      ) + (truncated ? `(first ${limit} per journal; raise --limit to see more)\n` : `(${records.length})\n`) +
        "Damaged records are kept as they were stored: repair or remove them with the backend's own tools.\n",
    );
  },
};

/** `stats`. */
export const statsCommand: CliCommand = {
  name: "stats",
  args: [],
  flags: [{ name: "limit", value: "n", help: "count up to n per state (default 10000)" }],
  summary: "records per state",
  help: `Counts the inbox records and outbox entries per state (up to --limit per state) and gives the age
of the oldest pending inbound record. The bot's counters live in the bot process: expose them with
prometheusMetrics(bot).`,
  examples: ["stats", "stats --json"],
  check({ flags }) {
    positiveIntFlag(flags, "limit", 10_000);
  },
  async run(c) {
    const backend = backendOf(c);
    const cap = positiveIntFlag(c.flags, "limit", 10_000);
    const counts = await countRecords(backend, cap);
    const oldest = counts.oldestPendingReceivedAt;
    const ageSeconds = oldest === null ? null : Math.max(0, (c.now() - oldest) / 1000);
    const note = "A bare backend has no counters: the counters of bot.durability.metrics() live in the bot " +
      "process (expose them with prometheusMetrics(bot))";
    if (c.json) {
      return void (await out(c, {
        backend: backend.name,
        inbox: counts.inbox,
        outbox: counts.outbox,
        countCap: cap,
        oldestPendingReceivedAt: oldest,
        oldestPendingAgeSeconds: ageSeconds,
        counters: null,
        note,
      }));
    }
    const capped = (n: number): string => (n >= cap ? `>=${n}` : String(n));
    const lines = [
      `Backend: ${c.opened!.description}`,
      "",
      table(["INBOX", "RECORDS"], INBOX_STATES.map((s) => [s, capped(counts.inbox[s])])).trimEnd(),
      "",
      table(["OUTBOX", "ENTRIES"], OUTBOX_STATES.map((s) => [s, capped(counts.outbox[s])])).trimEnd(),
      "",
      oldest === null
        ? "Oldest pending inbound record: none"
        : `Oldest pending inbound record: received ${iso(oldest)} (${duration(ageSeconds! * 1000)} ago)`,
      `Counts stop at ${cap} per state (--limit).`,
      `Counters: none. ${note}.`,
    ];
    await c.io.stdout(lines.join("\n") + "\n");
  },
};

function iso(ms: number | null): string {
  if (ms === null || !Number.isFinite(ms)) return "";
  return new Date(ms).toISOString();
}

function duration(ms: number): string {
  const s = Math.round(ms / 1000);
  if (ms < 1000) return `${Math.round(ms)}ms`;
  const parts: string[] = [];
  const d = Math.floor(s / 86400), h = Math.floor((s % 86400) / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
  if (d) parts.push(`${d}d`);
  if (h) parts.push(`${h}h`);
  if (m) parts.push(`${m}m`);
  if (sec || parts.length === 0) parts.push(`${sec}s`);
  return parts.join(" ");
}

function cell(text: string, max = 60): string {
  const flat = escapeControls(text);
  if (flat.length <= max) return flat;
  const kept = flat.slice(0, max - 1);
  return kept.replace(/\\u[0-9a-f]{0,3}$/, "") + "…"; // no escape cut in two
}

function table(headers: string[], rows: string[][]): string {
  const cells = rows.map((r) => r.map((c) => cell(c)));
  const widths = headers.map((h, i) => Math.max(h.length, ...cells.map((r) => r[i]!.length)));
  const line = (r: string[]): string => r.map((c, i) => (i === r.length - 1 ? c : c.padEnd(widths[i]!))).join("  ").trimEnd();
  return [line(headers), ...cells.map(line)].join("\n") + "\n";
}

/** A journaled error in a table: its message and causes on one line, without the stack frames (`show` has them). */
function errorCell(error: string | null): string {
  return error === null ? "" : errorOneLine(error);
}

function footer(count: number, limit: number): string {
  return count >= limit ? `(first ${limit}; raise --limit to see more)\n` : `(${count})\n`;
}

function describe(record: InboundRecord | OutboxEntry): string {
  const lines: string[] = [];
  for (const [key, value] of Object.entries(record)) {
    let text: string;
    if (value === null || value === undefined) text = "-";
    else if (key.endsWith("At") && typeof value === "number") text = `${iso(value)} (${value})`;
    else if (typeof value === "object") text = foldSpaces(JSON.stringify(value, null, 2), true).replace(/\n/g, "\n  ");
    // A journaled error keeps its lines (causes, stack frames), indented so that none passes for a field.
    else if (key === "error") text = foldSpaces(String(value)).replace(/\n/g, "\n  ");
    else text = foldSpaces(escapeControls(String(value)));
    lines.push(`${key}: ${text}`);
  }
  return lines.join("\n") + "\n";
}
