/**
 * The changes of a webhook POST: whose each one is (by its phone number id),
 * and the message entries, statuses and errors they hold.
 *
 * @module
 */
import { cutDeepNesting, MAX_CONTENT_DEPTH } from "../../src/content.ts";
import { showValue as show } from "../../src/show.ts";
import { contactsOf, type MessageEntry, parseMessage, soleContactUserId } from "./messages.ts";
import { PHONE_NUMBER_ID } from "./options.ts";
import { WhatsAppChangeError, WhatsAppPayloadError } from "./payloads.ts";
import { parseStatus, type WhatsAppStatus } from "./statuses.ts";
import { brief, isObject } from "./values.ts";

/**
 * The deepest nesting of objects and arrays a message may have (the message object itself is level 1);
 * a deeper one is journaled as unreadable (the reason names where), kept cut at this depth, as is any
 * unreadable part of a payload. Meta's messages nest a few levels; a record keeps an unreadable one two
 * levels down (`extra.raw`), well within the journal's bound ({@link MAX_CONTENT_DEPTH}, 64), which keeps
 * a `[[[[…]]]]` some thousands of levels deep from overflowing the stack where the journal encodes it.
 * A status, and a change-level error, deeper than this reaches `onStatus` (`onError`) cut at this depth.
 */
export const WHATSAPP_MAX_MESSAGE_DEPTH = 32;

/** What the reader says about a payload while it reads it. */
export interface PayloadProblems {
  /** A problem of the payload (reported, and listed in the answer). */
  fail(error: Error): void;
  /** A change that is not for this provider, or holds nothing to admit. */
  ignore(): void;
}

/** What a webhook POST holds: its message entries, in payload order, and its statuses. */
export interface PayloadContents {
  /** The message entries, parsed or to be journaled as unreadable. */
  entries: MessageEntry[];
  /** The statuses, with where each is in the payload. */
  statuses: { status: WhatsAppStatus; path: string }[];
}

/** Reads the `entry` array of webhook POSTs for one phone number id. */
export class PayloadReader {
  readonly #phoneNumberId: string;
  readonly #report: (error: Error) => void;
  /** Other phone number ids whose messages were reported as ignored. */
  readonly #otherNumbers = new Set<string>();
  /** Whether a numeric `phone_number_id` equal to ours was reported (once). */
  #numericIdReported = false;

  /**
   * Make the reader of one provider.
   *
   * @param phoneNumberId the provider's phone number id
   * @param report reports what is worth saying once (not listed in the answer)
   */
  constructor(phoneNumberId: string, report: (error: Error) => void) {
    this.#phoneNumberId = phoneNumberId;
    this.#report = report;
  }

  /**
   * Read the `entry` array of one POST. A part that may hold a user message
   * but cannot be read becomes an entry to journal as unreadable.
   *
   * @param entryList the payload's `entry`
   * @param problems where the problems go
   * @returns the message entries and statuses
   */
  read(entryList: unknown[], problems: PayloadProblems): PayloadContents {
    const entries: MessageEntry[] = [];
    const statuses: { status: WhatsAppStatus; path: string }[] = [];
    /** A part of the payload that may hold a user message but cannot be read: journaled as unreadable. */
    const unreadable = (raw: unknown, error: WhatsAppPayloadError) => {
      problems.fail(error);
      entries.push({ raw: cutDeepNesting(raw, WHATSAPP_MAX_MESSAGE_DEPTH).value, received: raw, error });
    };
    entryList.forEach((entry, e) => {
      const ePath = `entry[${e}]`;
      if (!isObject(entry) || !Array.isArray(entry.changes)) {
        unreadable(
          entry,
          new WhatsAppPayloadError(ePath, "changes", `field "changes" must be an array, got ${brief(isObject(entry) ? entry.changes : entry)}`),
        );
        return;
      }
      entry.changes.forEach((change, c) => {
        const cPath = `${ePath}.changes[${c}]`;
        if (!isObject(change)) {
          unreadable(change, new WhatsAppPayloadError(cPath, "", `a change must be an object, got ${brief(change)}`));
          return;
        }
        if (change.field !== "messages") {
          problems.ignore(); // another subscription (templates, account updates, calls, echoes, …): never a user message
          return;
        }
        if (!isObject(change.value)) {
          unreadable(change, new WhatsAppPayloadError(cPath, "value", `field "value" must be an object, got ${brief(change.value)}`));
          return;
        }
        const value = change.value;
        const vPath = `${cPath}.value`;
        const owner = ownerOf(value, vPath, this.#phoneNumberId);
        if (owner.kind === "other") {
          problems.ignore();
          // Reported once per number: a mistyped phoneNumberId would otherwise drop every message silently.
          if (Array.isArray(value.messages) && value.messages.length > 0 && !this.#otherNumbers.has(owner.id)) {
            this.#otherNumbers.add(owner.id);
            this.#report(
              new Error(
                `WhatsApp webhook: messages for phone number id ${show(owner.id)} were ignored: this provider is for ` +
                  `${show(this.#phoneNumberId)} (the business phone number id, not the phone number). Give each number ` +
                  `its own provider and webhook URL`,
              ),
            );
          }
          return;
        }
        if (owner.kind === "unknown") {
          // No usable phone number id: the change may well be ours, so its messages are journaled as
          // unreadable (never acknowledged unseen); its statuses and errors, which are no user
          // messages and may be another number's, are skipped.
          const messages = value.messages;
          if (messages === undefined || (Array.isArray(messages) && messages.length === 0)) {
            problems.ignore();
            return;
          }
          if (!Array.isArray(messages)) {
            unreadable(messages, new WhatsAppPayloadError(`${vPath}.messages`, owner.field, owner.message));
          } else {
            messages.forEach((m, i) => unreadable(m, new WhatsAppPayloadError(`${vPath}.messages[${i}]`, owner.field, owner.message)));
          }
          return;
        }
        if (owner.numeric !== undefined && !this.#numericIdReported) {
          this.#numericIdReported = true;
          this.#report(
            new Error(
              `WhatsApp webhook ${vPath}.metadata.phone_number_id: the phone number id is the number ${owner.numeric}, ` +
                `not a string; taken as this provider's ${show(this.#phoneNumberId)} (reported once)`,
            ),
          );
        }
        const contacts = contactsOf(value);
        const soleUserId = soleContactUserId(value);
        const metaFailed = Array.isArray(value.errors) && value.errors.length > 0;
        if (value.messages !== undefined) {
          if (!Array.isArray(value.messages)) {
            unreadable(
              value.messages,
              new WhatsAppPayloadError(`${cPath}.value`, "messages", `field "messages" must be an array, got ${brief(value.messages)}`),
            );
          } else {
            value.messages.forEach((m, i) => {
              const mPath = `${cPath}.value.messages[${i}]`;
              const { cutAt } = cutDeepNesting(m, WHATSAPP_MAX_MESSAGE_DEPTH);
              if (cutAt !== undefined) {
                unreadable(
                  m,
                  new WhatsAppPayloadError(
                    mPath,
                    cutAt,
                    `field "${cutAt}" nests deeper than ${WHATSAPP_MAX_MESSAGE_DEPTH} levels of objects and arrays ` +
                      `(WHATSAPP_MAX_MESSAGE_DEPTH): the message is kept cut at that depth`,
                  ),
                );
                return;
              }
              try {
                entries.push({ parsed: parseMessage(m, mPath, contacts, soleUserId) });
              } catch (error) {
                if (!(error instanceof WhatsAppPayloadError)) throw error;
                if (metaFailed && isBodyless(m)) {
                  // Meta could not read it either (its change carries errors, e.g. 131000 "Unsupported webhook
                  // payload"): a message of a type without its body holds nothing to keep or handle. Reported, not journaled.
                  problems.fail(
                    new WhatsAppPayloadError(mPath, error.field, `${error.reason}; Meta reported the change as failed, so the message is skipped`, true),
                  );
                  return;
                }
                unreadable(m, error);
              }
            });
          }
        }
        if (value.statuses !== undefined) {
          if (!Array.isArray(value.statuses)) {
            problems.fail(new WhatsAppPayloadError(`${cPath}.value`, "statuses", `field "statuses" must be an array, got ${brief(value.statuses)}`));
          } else {
            value.statuses.forEach((s, i) => {
              const path = `${cPath}.value.statuses[${i}]`;
              // Cut as a message is, before it reaches onStatus (which may well log or store it).
              const { value: status, cutAt } = cutDeepNesting(s, WHATSAPP_MAX_MESSAGE_DEPTH);
              if (cutAt !== undefined) {
                problems.fail(
                  new WhatsAppPayloadError(
                    path,
                    cutAt,
                    `field "${cutAt}" nests deeper than ${WHATSAPP_MAX_MESSAGE_DEPTH} levels of objects and arrays ` +
                      `(WHATSAPP_MAX_MESSAGE_DEPTH): the status is kept cut at that depth`,
                  ),
                );
              }
              try {
                statuses.push({ status: parseStatus(status, path), path });
              } catch (error) {
                problems.fail(error as Error);
              }
            });
          }
        }
        if (value.errors !== undefined) {
          // Errors of the app, the account or the platform, not tied to a message (130429, 131000, …).
          if (!Array.isArray(value.errors)) {
            problems.fail(new WhatsAppPayloadError(`${cPath}.value`, "errors", `field "errors" must be an array, got ${brief(value.errors)}`));
          } else {
            value.errors.forEach((raw, i) =>
              problems.fail(new WhatsAppChangeError(`${cPath}.value.errors[${i}]`, cutDeepNesting(raw, WHATSAPP_MAX_MESSAGE_DEPTH).value))
            );
          }
        }
      });
    });
    return { entries, statuses };
  }
}

/** Whether a message names a type whose body (the field of that name) is absent: `{ type: "interactive" }` without `interactive`. */
function isBodyless(m: unknown): boolean {
  if (!isObject(m) || typeof m.type !== "string" || m.type === "") return false;
  return m[m.type] === undefined || m[m.type] === null;
}

/**
 * Whose change a `messages` change is, by `value.metadata.phone_number_id`:
 * - `ours`: our id, or (`numeric`) a JSON number whose decimal form is our id
 *   (a safe integer, so it is exactly what was sent: it can only mean our id);
 * - `other`: another well-formed phone number id (a string);
 * - `unknown`: `metadata` or `phone_number_id` missing or malformed (another
 *   number, our id spelt badly, ...): it may be ours; `field` is the full
 *   path of the field at fault and `message` says what is wrong with it.
 */
type ChangeOwner =
  | { kind: "ours"; numeric?: number }
  | { kind: "other"; id: string }
  | { kind: "unknown"; field: string; message: string };

function ownerOf(value: Record<string, unknown>, path: string, ours: string): ChangeOwner {
  const metadata = value.metadata;
  const mPath = `${path}.metadata`;
  if (metadata === undefined) return { kind: "unknown", field: mPath, message: `field "${mPath}" is missing` };
  if (!isObject(metadata)) {
    return { kind: "unknown", field: mPath, message: `field "${mPath}" must be an object, got ${brief(metadata)}` };
  }
  const id = metadata.phone_number_id;
  const iPath = `${mPath}.phone_number_id`;
  if (id === ours) return { kind: "ours" };
  if (id === undefined) return { kind: "unknown", field: iPath, message: `field "${iPath}" is missing` };
  if (typeof id === "number" && Number.isSafeInteger(id) && String(id) === ours) return { kind: "ours", numeric: id };
  if (typeof id !== "string") {
    return { kind: "unknown", field: iPath, message: `field "${iPath}" must be a string, got ${brief(id)}` };
  }
  if (!PHONE_NUMBER_ID.test(id)) {
    return {
      kind: "unknown",
      field: iPath,
      message: `field "${iPath}" must be a phone number id (1 to 64 letters, digits, "_" or "-"), got ${brief(id)}`,
    };
  }
  return { kind: "other", id };
}
