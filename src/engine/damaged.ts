/**
 * The records a backend set aside as damaged that no bot reported yet: each reported as one `error`
 * event (a `DamagedRecordError` naming it and the backend) and counted in `damagedRecords`, by the one
 * bot whose `reportDamaged` marked it.
 *
 * @module
 */
import { DamagedRecordError, type DurabilityBackend } from "../contract.ts";
import type { DurabilityMetrics, EngineHost } from "./types.ts";

/** Damaged records reported per journal per sweep tick (the rest at the next ticks). */
const DAMAGED_REPORT_BATCH = 100;

/** What the reports need from the engine. */
export interface DamagedReportsHost {
  backend: DurabilityBackend;
  host: EngineHost;
  /** The engine's counters (updated in place). */
  metrics: DurabilityMetrics;
  halted(): boolean;
  /** Report an error that has no caller; `true` when it was a process death. */
  report(error: unknown, context: string): boolean;
}

/** Reports damaged records, one round at a time. */
export class DamagedReports {
  readonly #h: DamagedReportsHost;
  #reporting: Promise<void> | null = null;

  constructor(host: DamagedReportsHost) {
    this.#h = host;
  }

  /** One round (runs with the periodic sweep): never two at once; a call during one shares it. */
  report(): Promise<void> {
    if (this.#reporting !== null) return this.#reporting;
    const { backend } = this.#h;
    const run = async () => {
      for (const journal of [backend.inbox, backend.outbox]) {
        const found = await journal.damaged({ unreported: true, limit: DAMAGED_REPORT_BATCH });
        for (const record of found) {
          if (this.#h.halted() || !await journal.reportDamaged(record.id)) continue;
          this.#h.metrics.damagedRecords++;
          this.#h.report(new DamagedRecordError(record), `${record.journal} of backend "${record.backend}"`);
        }
      }
    };
    const work = run()
      .catch((error) => void this.#h.report(error, "report of damaged records"))
      .finally(() => {
        this.#reporting = null;
      });
    this.#reporting = work;
    this.#h.host.track(work);
    return work;
  }
}
