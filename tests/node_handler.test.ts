// nodeHandler on real Node (a bundle run by Node 20): the body reaches the Web handler as a stream, so a
// provider's bodyTimeoutMs and size cap apply to it, a handler that answers without reading it answers at
// once, and a connection whose body was not read to its end is closed after the answer.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { mkdirSync, rmSync } from "node:fs";
import { connect } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { childLines } from "./support/child_lines.ts";

const root = join(import.meta.dir, "..");
const dir = join(tmpdir(), `botmesh-node-handler-${crypto.randomUUID()}`);
let child: ReturnType<typeof Bun.spawn> & { stdout: ReadableStream<Uint8Array> };
let port = 0;

beforeAll(async () => {
  mkdirSync(dir, { recursive: true });
  const build = Bun.spawnSync(
    [join(root, "node_modules", ".bin", "bun"), "build", "tests/fixtures/node_webhook_server.ts", "--target=node", "--outdir", dir],
    { cwd: root },
  );
  expect(build.exitCode, build.stderr.toString()).toBe(0);
  child = Bun.spawn(["node", join(dir, "node_webhook_server.js")], { cwd: root, stdout: "pipe", stderr: "inherit" });
  const line = await childLines(child.stdout, "node_webhook_server.js", 15_000).next("listening on ");
  port = Number(line.slice("listening on ".length));
});

afterAll(async () => {
  child?.kill("SIGTERM");
  await child?.exited;
  rmSync(dir, { recursive: true, force: true });
});

/**
 * Send a request's head and the first part of its body, then (with `drip`) a byte every 50 ms, never the end.
 * Resolves with what the server answered and whether it closed the connection, or says it did not within `withinMs`.
 */
function endlessPost(path: string, headers: Record<string, string>, drip: boolean, withinMs: number) {
  return new Promise<{ status: string; closed: boolean } | string>((resolve) => {
    const socket = connect(port, "127.0.0.1");
    let received = "";
    let timer: ReturnType<typeof setInterval> | undefined;
    const done = (result: { status: string; closed: boolean } | string) => {
      clearInterval(timer);
      clearTimeout(limit);
      socket.destroy();
      resolve(result);
    };
    const limit = setTimeout(() => done(`no answer and no close within ${withinMs} ms; received ${JSON.stringify(received)}`), withinMs);
    socket.on("error", () => {}); // a write after the server closed: the answer is what counts
    socket.on("data", (data) => (received += data.toString("latin1")));
    socket.on("close", () => done({ status: received.split("\r\n")[0] ?? "", closed: true }));
    const head = Object.entries({ host: "bot.test", "content-type": "application/json", "content-length": "100000", ...headers })
      .map(([name, value]) => `${name}: ${value}\r\n`).join("");
    socket.write(`POST ${path} HTTP/1.1\r\n${head}\r\n{"update_id":1,`);
    if (drip) timer = setInterval(() => socket.writable && socket.write(" "), 50);
  });
}

describe("nodeHandler streams the request body to the Web handler (Node)", () => {
  test("Telegram, a wrong secret and a body that never ends: 401 at once, the connection closed", async () => {
    const result = await endlessPost("/telegram", { "x-telegram-bot-api-secret-token": "wrong" }, false, 5_000);
    expect(result).toEqual({ status: "HTTP/1.1 401 Unauthorized", closed: true });
  });

  test("WhatsApp, a body that drips a byte every 50 ms: 408 at bodyTimeoutMs, the connection closed", async () => {
    const result = await endlessPost("/whatsapp", { "x-hub-signature-256": `sha256=${"0".repeat(64)}` }, true, 5_000);
    expect(result).toEqual({ status: "HTTP/1.1 408 Request Timeout", closed: true });
  });

  test("over maxBodyBytes while the handler reads: 413; a body within it is read whole, on a kept-alive connection", async () => {
    const base = `http://127.0.0.1:${port}`;
    const big = await fetch(`${base}/echo`, { method: "POST", body: "x".repeat(4096) });
    expect([big.status, await big.text()]).toEqual([413, "Request body too large"]);
    const small = await fetch(`${base}/echo`, { method: "POST", body: "x".repeat(1000) });
    expect([small.status, small.headers.get("connection"), await small.text()]).toEqual([200, "keep-alive", "read 1000 bytes"]);
    const get = await fetch(`${base}/echo`);
    expect([get.status, await get.text()]).toEqual([200, "read 0 bytes"]);
  });
});
