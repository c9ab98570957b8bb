/**
 * "Mark as delivered" on the journal alone (no bot attached: the command line,
 * the console over a bare backend): an `unknown` send written `sent` under the
 * entry's own fencing token, as a late outcome of the lost call would be. The
 * bot's `bot.durability.markDelivered` does the same write and also counts it
 * and emits `durability:resolved`; a bare backend has no bot to tell.
 *
 * @module
 */
import { type DurabilityBackend, StaleLeaseError } from "../contract.ts";
import { OUTBOX_MACHINE } from "../machine.ts";
import { stepOf, stepResultText } from "../engine/steps.ts";

/** The longest provider message id an operator may give. */
export const MAX_MESSAGE_ID_LENGTH = 512;

/**
 * Marks the `unknown` outbox entry `key` as delivered, without a new call.
 * @param backend the open backend
 * @param key the entry's key
 * @param messageId the provider's message id, `""` when not known; for a step's attempt, the step's result as JSON (`""`: none)
 * @returns `false` when the entry does not exist, is not `unknown`, or was retried or settled meanwhile
 */
export async function markDeliveredInJournal(backend: DurabilityBackend, key: string, messageId: string): Promise<boolean> {
  const entry = await backend.outbox.get(key);
  if (entry === null || !OUTBOX_MACHINE.transitions.markDelivered.from.includes(entry.state)) return false;
  try {
    await backend.outbox.markSent(key, entry.fence, stepOf(entry) === undefined ? messageId : stepResultText(messageId, key));
    return true;
  } catch (error) {
    if (error instanceof StaleLeaseError) return false;
    throw error;
  }
}
