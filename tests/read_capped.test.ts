// readCapped: the body read whole, or cut at its size cap, or at its deadline; neither waits on the body's cancel.
import { expect, test } from "bun:test";
import { readCapped, ReadTimeoutError } from "../src/read_capped.ts";

/** A body that sends 1 KiB chunks for as long as it is read, and whose cancel never settles (a stalled peer). */
function endlessBody(): ReadableStream<Uint8Array> {
  return new ReadableStream<Uint8Array>({
    pull(controller) {
      controller.enqueue(new Uint8Array(1024));
    },
    cancel() {
      return new Promise<void>(() => {});
    },
  });
}

/** The outcome of `read`, or that there was none within 2 s. */
function outcome(read: Promise<Uint8Array | null>): Promise<string> {
  return Promise.race([
    read.then((bytes) => (bytes === null ? "over the cap" : `read ${bytes.byteLength} bytes`), (error) => `threw ${(error as Error).name}`),
    new Promise<string>((resolve) => setTimeout(() => resolve("no answer within 2 s"), 2_000)),
  ]);
}

test("a body read to its end", async () => {
  expect(await outcome(readCapped(new Response("hello").body, 5, { timeoutMs: 1_000 }))).toBe("read 5 bytes");
});

test("over the cap: null, even when the body's cancel never settles", async () => {
  expect(await outcome(readCapped(endlessBody(), 4096, { timeoutMs: 200 }))).toBe("over the cap");
});

test("past the deadline: ReadTimeoutError, even when the body's cancel never settles", async () => {
  const stalled = new ReadableStream<Uint8Array>({
    start(controller) {
      controller.enqueue(new Uint8Array(10));
    },
    cancel: () => new Promise<void>(() => {}),
  });
  expect(await outcome(readCapped(stalled, 4096, { timeoutMs: 100 }))).toBe(`threw ${new ReadTimeoutError(100).name}`);
});
