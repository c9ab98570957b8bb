// The console's form bodies: read up to the form limit (16 KiB) and within bodyTimeoutMs, whether or not
// the request declares its length.
import { describe, expect, test } from "bun:test";
import { MemoryDurability } from "../backends/memory/durability.ts";
import { basicAuth, durabilityConsole } from "../src/ops/console.ts";

const AUTH = { authorization: `Basic ${btoa("ops:correct horse")}` };

function post(body: ReadableStream<Uint8Array> | string): Request {
  return new Request("http://127.0.0.1/outbound/discard?id=x", {
    method: "POST",
    headers: { ...AUTH, "content-type": "application/x-www-form-urlencoded" },
    body,
    // @ts-ignore: Node needs it for a stream body
    duplex: "half",
  });
}

describe("console form bodies", () => {
  test("a chunked POST without Content-Length is cut off after the form limit (413), not read whole", async () => {
    const dlq = durabilityConsole(new MemoryDurability(), { auth: basicAuth("ops", "correct horse"), onError: () => {} });
    let sent = 0;
    let cancelled = false;
    const chunk = new Uint8Array(64 * 1024).fill(0x61);
    const total = 32 * 1024 * 1024;
    const body = new ReadableStream<Uint8Array>({
      pull(controller) {
        if (sent >= total) return controller.close();
        sent += chunk.length;
        controller.enqueue(chunk);
      },
      cancel() {
        cancelled = true;
      },
    });
    const response = await dlq(post(body));
    expect(response.status).toBe(413);
    expect(await response.text()).toContain("larger than 16384 bytes");
    expect(sent).toBeLessThan(1024 * 1024);
    expect(cancelled).toBe(true);
    await dlq.close();
  });

  test("a body that never ends is answered 408 after bodyTimeoutMs", async () => {
    const dlq = durabilityConsole(new MemoryDurability(), { auth: basicAuth("ops", "correct horse"), bodyTimeoutMs: 50, onError: () => {} });
    let cancelled = false;
    const body = new ReadableStream<Uint8Array>({
      start(controller) {
        controller.enqueue(new TextEncoder().encode("csrf="));
      },
      cancel() {
        cancelled = true;
      },
    });
    const response = await dlq(post(body));
    expect(response.status).toBe(408);
    expect(await response.text()).toContain("within 50 ms");
    expect(cancelled).toBe(true);
    await dlq.close();
  });

  test("a form within the limit is read (then refused for its token, not its size)", async () => {
    const dlq = durabilityConsole(new MemoryDurability(), { auth: basicAuth("ops", "correct horse"), onError: () => {} });
    const response = await dlq(post(`csrf=nope&pad=${"a".repeat(16_000)}`));
    expect(response.status).toBe(403);
    await dlq.close();
  });

  test("bodyTimeoutMs is checked", () => {
    for (const bodyTimeoutMs of [0, 1.5, 600_001]) {
      expect(() => durabilityConsole(new MemoryDurability(), { auth: basicAuth("ops", "correct horse"), bodyTimeoutMs, openBackend: false })).toThrow(
        /bodyTimeoutMs/,
      );
    }
  });
});
