/**
 * A grammY update as an inbox record: the id and chat the Telegram provider
 * gives it, and the update itself in `extra.update`, from which recovery runs
 * grammY's middleware again.
 *
 * @module
 */
import type { JsonValue } from "../../src/contract.ts";
import type { MediaSeal } from "../../src/media.ts";
import type { InboundMessage } from "../../src/provider.ts";
import { showValue as show } from "../../src/show.ts";
import { cutDeepNesting } from "../../src/content.ts";
import { parseTelegramUpdate, TELEGRAM_MAX_UPDATE_DEPTH, TelegramUpdateError, unreadableUpdate } from "../telegram/updates.ts";
import { asError, isObj, type Obj } from "../telegram/values.ts";

/** Where the raw update is kept in an inbox record's `extra`. */
export const UPDATE_FIELD = "update";

/** The chat an update of a kind the Telegram provider skips belongs to, for per-chat order. */
function chatOf(body: unknown): string | undefined {
  if (!isObj(body)) return undefined;
  for (const holder of [body, body.message]) {
    if (isObj(holder) && isObj(holder.chat) && (typeof holder.chat.id === "number" || typeof holder.chat.id === "string")) {
      return String(holder.chat.id);
    }
  }
  for (const who of [body.from, body.user]) {
    if (isObj(who) && (typeof who.id === "number" || typeof who.id === "string")) return String(who.id);
  }
  return undefined;
}

/**
 * Turn an update into the inbox record of its handling. A message, channel
 * post, business message or button press gets the record (id, chat, type)
 * the Telegram provider gives it (`tg:<bot id>:<update_id>:<chat id>:<message_id>`,
 * `tg:<bot id>:<update_id>:cb:<query id>`); one that provider cannot parse
 * is recorded as unreadable (dead-lettered with the update, never handed to
 * the middleware). Any other kind (an edit, an inline query, a member
 * change, …) is recorded as `tg:<bot id>:<update_id>:<kind>`, of type `<kind>`,
 * in the chat it names (else its user's, else `tg:<bot id>:<kind>`).
 *
 * @param update the update as Telegram sent it
 * @param botId the bot's id (the part of the token before `:`)
 * @param seal seals media references
 * @returns the record, the update in `extra.update`
 * @throws {TelegramUpdateError} when the update is not an object with an integer `update_id`
 */
export async function updateRecord(update: unknown, botId: string, seal: MediaSeal): Promise<InboundMessage> {
  if (!isObj(update) || !Number.isSafeInteger(update.update_id)) {
    throw new TelegramUpdateError("update_id", `A Telegram update must be an object with an integer "update_id", got ${show(update)}`);
  }
  let message: InboundMessage;
  try {
    const parsed = await parseTelegramUpdate(update, botId, seal);
    if (parsed.kind === "message") {
      message = parsed.message;
    } else {
      const kind = parsed.skipped.kind;
      message = {
        id: `tg:${botId}:${parsed.updateId}:${kind}`,
        chatId: chatOf((update as Obj)[kind]) ?? `tg:${botId}:${kind}`,
        type: kind,
        extra: { updateId: parsed.updateId },
      };
    }
  } catch (error) {
    const err = asError(error);
    const unreadable = await unreadableUpdate(update, err, botId);
    if (unreadable !== undefined) return unreadable; // the update is in extra.raw; its middleware never runs
    if (!(err instanceof TelegramUpdateError)) throw error;
    // Another kind the parser refused (nested too deep): unreadable as well, dead-lettered with the
    // update kept cut at TELEGRAM_MAX_UPDATE_DEPTH, never refused on every delivery.
    const cut = cutDeepNesting(update, TELEGRAM_MAX_UPDATE_DEPTH).value as Obj;
    const kind = Object.keys(cut).find((key) => key !== "update_id") ?? "update";
    return {
      id: `tg:${botId}:${update.update_id}:${kind}`,
      chatId: chatOf(cut[kind]) ?? `tg:${botId}:${kind}`,
      type: "unreadable",
      unreadable: err.message,
      extra: { updateKind: kind, updateId: update.update_id as number, raw: cut as JsonValue },
    };
  }
  const extra = isObj(message.extra) ? message.extra : {};
  return { ...message, extra: { ...extra, [UPDATE_FIELD]: update as JsonValue } };
}

/**
 * The update journaled in a record by {@link updateRecord}.
 *
 * @param message the record
 * @returns the update
 * @throws {TypeError} when the record holds none (it was not made by this plugin)
 */
export function journaledUpdate(message: InboundMessage): Obj {
  const update = isObj(message.extra) ? message.extra[UPDATE_FIELD] : undefined;
  if (!isObj(update)) {
    throw new TypeError(`Inbox record ${show(message.id)} holds no grammY update in extra.${UPDATE_FIELD}`);
  }
  return update;
}
