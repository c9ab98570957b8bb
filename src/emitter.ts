/**
 * A small typed event emitter.
 *
 * @module
 */

/** Listener map type: event name → payload. */
export type EventMap = Record<string, unknown>;

/** Emits typed events; a throwing listener is reported through `onListenerError`, never to the emitter. */
export class Emitter<E extends EventMap> {
  #listeners = new Map<keyof E, Set<(payload: never) => void>>();
  #onListenerError: (error: unknown, event: keyof E) => void;

  constructor(onListenerError: (error: unknown, event: keyof E) => void) {
    this.#onListenerError = onListenerError;
  }

  /** Add a listener. @returns a function that removes it. */
  on<K extends keyof E>(event: K, listener: (payload: E[K]) => void): () => void {
    let set = this.#listeners.get(event);
    if (!set) this.#listeners.set(event, set = new Set());
    set.add(listener as (payload: never) => void);
    return () => this.off(event, listener);
  }

  /** Remove a listener. */
  off<K extends keyof E>(event: K, listener: (payload: E[K]) => void): void {
    this.#listeners.get(event)?.delete(listener as (payload: never) => void);
  }

  /** How many listeners `event` has. */
  listenerCount(event: keyof E): number {
    return this.#listeners.get(event)?.size ?? 0;
  }

  /** Call the listeners of `event`. */
  emit<K extends keyof E>(event: K, payload: E[K]): void {
    const set = this.#listeners.get(event);
    if (!set) return;
    for (const listener of [...set]) {
      try {
        (listener as (payload: E[K]) => void)(payload);
      } catch (error) {
        this.#onListenerError(error, event);
      }
    }
  }
}
