/** A durability backend whose journal refuses updates on demand, for the tests of refused updates. */
import type { DurabilityBackend } from "../../backend.ts";

/**
 * A backend whose inbox.admit throws the next `state.failures` times.
 *
 * @param backend the real backend
 * @param state how many admissions still fail (counted down)
 * @returns the backend
 */
export function flakyAdmit(backend: DurabilityBackend, state: { failures: number }): DurabilityBackend {
  const bind = <T extends object>(target: T, override: Record<PropertyKey, unknown>): T =>
    new Proxy(target, {
      get(t, p) {
        if (p in override) return override[p];
        const v = Reflect.get(t, p, t);
        return typeof v === "function" ? v.bind(t) : v;
      },
    });
  const inbox = bind(backend.inbox, {
    admit: async (...args: Parameters<DurabilityBackend["inbox"]["admit"]>) => {
      if (state.failures > 0) {
        state.failures--;
        throw new Error("journal unavailable (injected)");
      }
      return backend.inbox.admit(...args);
    },
  });
  return bind(backend, { inbox });
}
