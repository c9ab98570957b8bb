/**
 * Damaged storage (`DamagedStorageError`): the first one met stops the engine's intake and work, and
 * is reported once. From then on nothing is admitted, taken up or recorded: an outcome written to
 * damaged storage cannot be trusted, and none is dead-lettered for it.
 *
 * @module
 */
import { type DamagedStorageError, damagedStorageOf } from "../contract.ts";

/** The engine's damaged-storage state. */
export class StorageDamage {
  #damage: DamagedStorageError | null = null;
  /** start()'s recovery sweep is over: damage met from now on has no caller, and is told as an event. */
  #recovered = false;
  readonly #onFirst: (damage: DamagedStorageError, context: string, tell: boolean) => void;

  /** @param onFirst what the engine does at the first damage (stop its timers; `tell`: emit it as an error event) */
  constructor(onFirst: (damage: DamagedStorageError, context: string, tell: boolean) => void) {
    this.#onFirst = onFirst;
  }

  /** The damage met, or `null`. */
  get current(): DamagedStorageError | null {
    return this.#damage;
  }

  /** The recovery sweep of start() is over. */
  recovered(): void {
    this.#recovered = true;
  }

  /**
   * When `error` is (or is caused by) a `DamagedStorageError`: the first one met becomes the engine's
   * damage (`onFirst`).
   * @returns whether it was damage
   */
  note(error: unknown, context: string): boolean {
    const damage = damagedStorageOf(error);
    if (damage === undefined) return false;
    if (this.#damage === null) {
      this.#damage = damage;
      this.#onFirst(damage, context, this.#recovered);
    }
    return true;
  }
}
