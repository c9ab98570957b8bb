import { BenchProvider, closedLoop, type LoadConfig, type RowResult } from "../lib.ts";

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

/** The writes of one message of our protocol. */
export type ProtocolWrite = "admit" | "reserve" | "sent" | "done";

/** One message as the ceilings write it: its ids and the tokens of its two leases. */
export interface ProtocolMessage {
  id: string;
  chat: string;
  key: string;
  token: number;
  outToken: number;
}

/**
 * The closed loop of a ceiling, as ours runs: admit, reserve, the mock provider's send (the loop closes
 * there), then markSent and complete while the chat's next message is admitted. `rows` builds each
 * write's row in the ceiling's own shape; every reply is checked to have been sent once.
 */
export async function protocolLoop(
  cfg: LoadConfig,
  batcher: TurnBatcher<ProtocolWrite>,
  rows: { [K in ProtocolWrite]: (m: ProtocolMessage, receipt: string) => Record<string, unknown> },
): Promise<{ total: number; result: RowResult }> {
  const provider = new BenchProvider();
  const abort = new AbortController();
  const background = new Set<Promise<void>>();
  let token = 0;
  const looped = await closedLoop(cfg, async (n, c) => {
    const m: ProtocolMessage = { id: `m-${n}`, chat: `c${c}`, key: `m-${n}:0`, token: ++token, outToken: ++token };
    await batcher.write("admit", rows.admit(m, ""));
    await batcher.write("reserve", rows.reserve(m, ""));
    const receipt = await provider.send(m.chat, `r:${m.id}`, { idempotencyKey: m.key, attempt: 1, signal: abort.signal });
    const after = Promise.all([
      batcher.write("sent", rows.sent(m, receipt.messageId)),
      batcher.write("done", rows.done(m, receipt.messageId)),
    ]).then(() => void background.delete(after));
    background.add(after);
  }, async () => {
    while (background.size > 0) await Promise.all(background);
  });
  provider.verify(looped.total);
  return looped;
}
