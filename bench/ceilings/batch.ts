/**
 * The batching the ceilings share with our Postgres and Redis backends: the writes called in one turn of
 * the event loop go out together (setImmediate, as the backends' group commit), at most `inFlight`
 * batches at once; writes that arrive meanwhile wait for the next batch.
 */
export interface Write<K extends string> {
  kind: K;
  row: Record<string, unknown>;
  resolve: () => void;
  reject: (e: unknown) => void;
}

export class TurnBatcher<K extends string> {
  #queued: Write<K>[] = [];
  #inFlight = 0;
  #scheduled = false;
  batches = 0;
  writes = 0;

  constructor(
    private readonly flush: (batch: Write<K>[], slot: number) => Promise<void>,
    private readonly inFlight: number,
    private readonly max = 256,
  ) {}

  write(kind: K, row: Record<string, unknown>): Promise<void> {
    return new Promise((resolve, reject) => {
      this.#queued.push({ kind, row, resolve, reject });
      this.#schedule();
    });
  }

  #free: number[] = [];
  #schedule(): void {
    if (this.#scheduled || this.#queued.length === 0 || this.#inFlight >= this.inFlight) return;
    this.#scheduled = true;
    setImmediate(() => {
      this.#scheduled = false;
      while (this.#queued.length > 0 && this.#inFlight < this.inFlight) {
        const slot = this.#free.pop() ?? this.#inFlight;
        this.#inFlight++;
        const batch = this.#queued.splice(0, this.max);
        this.batches++;
        this.writes += batch.length;
        void this.flush(batch, slot).then(
          () => batch.forEach((w) => w.resolve()),
          (e) => batch.forEach((w) => w.reject(e)),
        ).finally(() => {
          this.#inFlight--;
          this.#free.push(slot);
          this.#schedule();
        });
      }
    });
  }
}
