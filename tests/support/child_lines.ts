/** Reading a child process's stdout line by line, for the real-process tests. */

/** What `childLines` returns. */
export interface ChildLines {
  /** Waits for the next line that starts with `prefix` (lines before it are passed over). */
  next(prefix: string, timeoutMs?: number): Promise<string>;
  /** Every line so far. */
  all(): string[];
  /** Resolves when the stream has ended (every complete line is then in `all()`). */
  ended: Promise<void>;
}

/**
 * @param stdout the child's stdout
 * @param name names the child in timeout errors
 * @param defaultTimeoutMs the default wait of `next`
 */
export function childLines(stdout: ReadableStream<Uint8Array>, name = "the child", defaultTimeoutMs = 5_000): ChildLines {
  const seen: string[] = [];
  const signal: { wake: (() => void) | null } = { wake: null };
  const ended = (async () => {
    let buffered = "";
    const decoder = new TextDecoder();
    const reader = stdout.getReader();
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      buffered += decoder.decode(value, { stream: true });
      let at: number;
      while ((at = buffered.indexOf("\n")) >= 0) {
        seen.push(buffered.slice(0, at));
        buffered = buffered.slice(at + 1);
      }
      signal.wake?.();
    }
    signal.wake?.();
  })().catch(() => {});
  let read = 0;
  return {
    async next(prefix, timeoutMs = defaultTimeoutMs) {
      const until = Date.now() + timeoutMs;
      for (;;) {
        while (read < seen.length) {
          const line = seen[read++]!;
          if (line.startsWith(prefix)) return line;
        }
        if (Date.now() > until) {
          throw new Error(`${name}: no line "${prefix}…" within ${timeoutMs} ms (got ${JSON.stringify(seen.slice(-20))})`);
        }
        await new Promise<void>((r) => {
          signal.wake = r;
          setTimeout(r, 20);
        });
      }
    },
    all: () => [...seen],
    ended,
  };
}
