// `botmesh-durable console`: the web console served on its own. In process (runCli with a fake
// server: the refusals, the handler it serves, the shutdown) and as a real process under Bun,
// Deno and Node 20 (bundled) on SQLite: it prints its address, asks for the credentials from the
// environment, serves the console, and stops cleanly on SIGINT and on SIGTERM (its port closed).
import { afterAll, describe, expect, test } from "bun:test";
import { mkdirSync, rmSync } from "node:fs";
import { join } from "node:path";
import { SQLiteDurability } from "../backends/sqlite/durability.ts";
import { MemoryDurability } from "../backends/memory/durability.ts";
import { type CliOptions, runCli } from "../src/ops/cli.ts";
import { CONSOLE_USAGE, isConsoleCommand } from "../src/ops/console_command.ts";
import { bundleCliForNode } from "./support/cli_process.ts";
import { noteRemoteAddress, remoteAddressOf } from "../src/runtime/remote_address.ts";
import { serveHttp } from "../src/runtime/serve.ts";
import { nodeHandler } from "../src/ops/node_handler.ts";
import { runId } from "./support/services.ts";

const root = join(import.meta.dir, "..");
const bin = join(root, "node_modules", ".bin");
const tmp = join(root, ".tmp", `console-command-${runId()}`);
mkdirSync(tmp, { recursive: true });
afterAll(() => rmSync(tmp, { recursive: true, force: true }));
const SLOW = 180_000;
const PASSWORD = "a-long-console-password";

interface InProcess {
  code: Promise<number>;
  stdout: string[];
  stderr: string[];
  served: { fetch: (request: Request) => Promise<Response>; port: number; hostname: string }[];
  closed: string[];
  stop(): void;
}

function inProcess(argv: string[], env: Record<string, string>, backend = new MemoryDurability()): InProcess {
  const stdout: string[] = [];
  const stderr: string[] = [];
  const served: InProcess["served"] = [];
  const closed: string[] = [];
  let stop = () => {};
  const shutdown = new Promise<void>((resolve) => (stop = resolve));
  const options: CliOptions = {
    open: async (url) => ({ backend, description: `memory ${url}`, close: async () => void closed.push("backend") }),
    env: (name) => env[name],
    serve: async (fetch, address) => {
      served.push({ fetch, ...address });
      return { port: address.port === 0 ? 41234 : address.port, close: async () => void closed.push("server") };
    },
    untilShutdown: () => shutdown,
  };
  const code = runCli(argv, { stdout: (t) => void stdout.push(t), stderr: (t) => void stderr.push(t) }, options);
  return { code, stdout, stderr, served, closed, stop: () => stop() };
}

const CREDENTIALS = { BOTMESH_CONSOLE_USER: "ops", BOTMESH_CONSOLE_PASSWORD: PASSWORD };
const basic = (user: string, password: string) => ({ authorization: `Basic ${btoa(`${user}:${password}`)}` });

describe("botmesh-durable console (in process)", () => {
  test("the console command is recognised after a --backend flag too, and not as an argument of another command", () => {
    expect(isConsoleCommand(["console", "--port", "1"])).toBe(true);
    expect(isConsoleCommand(["-b", "sqlite:x.db", "console"])).toBe(true);
    expect(isConsoleCommand(["--backend=sqlite:x.db", "console"])).toBe(true);
    expect(isConsoleCommand(["show", "outbox", "console"])).toBe(false);
    expect(isConsoleCommand([])).toBe(false);
  });

  test("refuses to start without credentials, with a short password, or --no-auth off loopback (exit 2, nothing served)", async () => {
    const cases: [string[], Record<string, string>, string][] = [
      [["console", "-b", "mem"], {}, "Refusing to start without credentials: set BOTMESH_CONSOLE_USER and BOTMESH_CONSOLE_PASSWORD"],
      [["console", "-b", "mem"], { BOTMESH_CONSOLE_USER: "ops" }, "Refusing to start without credentials"],
      [["console", "-b", "mem"], { BOTMESH_CONSOLE_USER: "ops", BOTMESH_CONSOLE_PASSWORD: "short" }, "BOTMESH_CONSOLE_PASSWORD must be at least 12 characters, got 5"],
      [["console", "-b", "mem", "--no-auth", "--host", "0.0.0.0"], {}, "--no-auth is refused with --host 0.0.0.0"],
      [["console", "-b", "mem", "--no-auth"], CREDENTIALS, "--no-auth is given but BOTMESH_CONSOLE_USER/BOTMESH_CONSOLE_PASSWORD are set"],
      [["console"], CREDENTIALS, "Missing the backend: give --backend <url> or set BOTMESH_DURABLE_BACKEND"],
      [["console", "-b", "mem", "--port", "99999"], CREDENTIALS, `Flag "--port" must be a port number from 0 to 65535, got "99999"`],
      [["console", "-b", "mem", "--colour", "red"], CREDENTIALS, `Unknown flag "--colour" for "console"`],
      [["console", "-b", "mem", "--base-path", "ops/"], CREDENTIALS, `Option "basePath" must be`],
    ];
    for (const [argv, env, message] of cases) {
      const run = inProcess(argv, env);
      expect(await run.code, argv.join(" ")).toBe(2);
      expect(run.stderr.join(""), argv.join(" ")).toContain(message);
      expect(run.served).toEqual([]);
    }
    const help = inProcess(["console", "--help"], {});
    expect(await help.code).toBe(0);
    expect(help.stdout.join("")).toBe(CONSOLE_USAGE);
  });

  test("serves the console for the backend behind Basic auth, prints its address, and closes server then backend on shutdown", async () => {
    const backend = new MemoryDurability();
    await backend.outbox.reserve({ key: "k1", chatId: "c", content: "hello", contentHash: "h", inboundId: null });
    const run = inProcess(["console", "--backend", "mem", "--port", "0", "--base-path", "/ops"], CREDENTIALS, backend);
    while (run.served.length === 0 || run.stdout.length === 0) await Bun.sleep(5);
    expect(run.stdout).toEqual(["http://127.0.0.1:41234/ops/\n"]);
    expect(run.stderr.join("")).toContain('serving memory mem for user "ops"');
    const [{ fetch, port, hostname }] = run.served;
    expect([port, hostname]).toEqual([0, "127.0.0.1"]);
    expect((await fetch(new Request("http://x/ops/outbound"))).status).toBe(401);
    expect((await fetch(new Request("http://x/ops/outbound", { headers: basic("ops", "wrong") }))).status).toBe(401);
    const page = await fetch(new Request("http://x/ops/outbound", { headers: basic("ops", PASSWORD) }));
    expect(page.status).toBe(200);
    expect(await page.text()).toContain(`<a href="/ops/outbound/record?id=k1">k1</a>`);
    run.stop();
    expect(await run.code).toBe(0);
    expect(run.closed).toEqual(["server", "backend"]);
    expect(run.stderr.at(-1)).toBe("botmesh-durable console: stopped\n");
  });

  test("failed sign-ins are counted per client address: a guesser is refused, the operator elsewhere still gets in", async () => {
    const run = inProcess(["console", "--backend", "mem", "--port", "0"], CREDENTIALS);
    while (run.served.length === 0 || run.stdout.length === 0) await Bun.sleep(5);
    const [{ fetch }] = run.served;
    const from = (address: string, password: string) => {
      const request = new Request("http://x/outbound", { headers: basic("ops", password) });
      noteRemoteAddress(request, address);
      return fetch(request);
    };
    const statuses: number[] = [];
    for (let i = 0; i < 11; i++) statuses.push((await from("203.0.113.9", `guess-${i}`)).status);
    expect(statuses.slice(0, 10)).toEqual(Array(10).fill(401));
    expect(statuses[10], "the guesser's 11th attempt").toBe(429);
    expect((await from("203.0.113.9", PASSWORD)).status, "the guesser's address, even with the password").toBe(429);
    expect((await from("198.51.100.7", PASSWORD)).status, "the operator from another address").toBe(200);
    run.stop();
    expect(await run.code).toBe(0);
  });

  test("--no-auth on loopback serves without sign-in", async () => {
    const run = inProcess(["console", "-b", "mem", "--no-auth", "--host", "::1", "--port", "9999"], {});
    while (run.served.length === 0 || run.stdout.length === 0) await Bun.sleep(5);
    expect(run.stdout).toEqual(["http://[::1]:9999/\n"]);
    const page = await run.served[0]!.fetch(new Request("http://[::1]:9999/"));
    expect(page.status).toBe(200);
    expect(await page.text()).toContain("Signed in as local operator");
    run.stop();
    expect(await run.code).toBe(0);
  });

  test("--no-auth answers only a loopback Host with its port: a DNS name rebound to 127.0.0.1 gets a 403", async () => {
    const run = inProcess(["console", "-b", "mem", "--no-auth", "--port", "0"], {});
    while (run.served.length === 0 || run.stdout.length === 0) await Bun.sleep(5);
    expect(run.stdout).toEqual(["http://127.0.0.1:41234/\n"]);
    const get = (host: string) =>
      run.served[0]!.fetch(new Request("http://127.0.0.1:41234/outbound", { headers: { host, "sec-fetch-site": "same-origin" } }));
    for (const host of ["127.0.0.1:41234", "localhost:41234", "LOCALHOST:41234", "[::1]:41234", "127.1.2.3:41234"]) {
      expect([host, (await get(host)).status]).toEqual([host, 200]);
    }
    for (const host of ["evil.example:41234", "evil.example", "127.0.0.1", "127.0.0.1:80", "localhost:41235", "localhost.evil.example:41234", "[::2]:41234", ""]) {
      const refused = await get(host);
      expect([host, refused.status]).toEqual([host, 403]);
      const text = await refused.text();
      expect(text).toContain("without sign-in (--no-auth)");
      expect(text).toContain("localhost, 127.0.0.1 or [::1] with its port 41234");
    }
    run.stop();
    expect(await run.code).toBe(0);
  });

  test("with credentials any Host is answered (the sign-in is the guard)", async () => {
    const run = inProcess(["console", "-b", "mem", "--port", "0"], CREDENTIALS);
    while (run.served.length === 0 || run.stdout.length === 0) await Bun.sleep(5);
    const page = await run.served[0]!.fetch(new Request("http://ops.example.com/", { headers: basic("ops", PASSWORD) }));
    expect(page.status).toBe(200);
    run.stop();
    expect(await run.code).toBe(0);
  });
});

/** Runs the command as a process until it prints its address; then `request` it and stop it with SIGINT. */
async function realProcess(cmd: string[], label: string): Promise<void> {
  const file = join(tmp, `${label}.db`);
  const backend = new SQLiteDurability({ file });
  await backend.open();
  await backend.outbox.reserve({ key: `${label}-key`, chatId: "c", content: "hello", contentHash: "h", inboundId: null });
  await backend.close();
  const child = Bun.spawn([...cmd, "console", "--backend", `sqlite:${file}`, "--port", "0"], {
    cwd: tmp,
    stdout: "pipe",
    stderr: "pipe",
    env: { ...process.env, DENO_NO_UPDATE_CHECK: "1", BOTMESH_DURABLE_BACKEND: "", ...CREDENTIALS },
  });
  const stderr = new Response(child.stderr).text();
  try {
    const reader = child.stdout.getReader();
    let out = "";
    while (!out.includes("\n")) {
      const { value, done } = await reader.read();
      if (done) throw new Error(`${label}: exited before printing its address: ${await stderr}`);
      out += new TextDecoder().decode(value);
    }
    reader.releaseLock();
    const url = out.trim();
    expect(url).toMatch(/^http:\/\/127\.0\.0\.1:\d+\/$/);
    expect((await fetch(url)).status).toBe(401);
    const page = await fetch(`${url}outbound?state=queued`, { headers: basic("ops", PASSWORD) });
    expect(page.status).toBe(200);
    expect(page.headers.get("content-security-policy")).toContain("default-src 'none'");
    expect(await page.text()).toContain(`${label}-key`);
  } finally {
    child.kill("SIGINT");
  }
  expect(await child.exited, label).toBe(0);
  expect(await stderr).toContain("botmesh-durable console: stopped");
}

/**
 * Runs the command as a process (no sign-in, any port) until it serves; then SIGTERM: it must close
 * its server and exit 0 within a few seconds, and the port must refuse connections.
 */
async function stopsOnSigterm(cmd: string[], label: string): Promise<void> {
  const file = join(tmp, `${label}-sigterm.db`);
  const backend = new SQLiteDurability({ file });
  await backend.open();
  await backend.close();
  const child = Bun.spawn([...cmd, "console", "--backend", `sqlite:${file}`, "--port", "0", "--no-auth"], {
    cwd: tmp,
    stdout: "pipe",
    stderr: "pipe",
    env: { ...process.env, DENO_NO_UPDATE_CHECK: "1", BOTMESH_DURABLE_BACKEND: "", BOTMESH_CONSOLE_USER: "", BOTMESH_CONSOLE_PASSWORD: "" },
  });
  const stderr = new Response(child.stderr).text();
  let url: URL;
  try {
    const reader = child.stdout.getReader();
    let out = "";
    while (!out.includes("\n")) {
      const { value, done } = await reader.read();
      if (done) throw new Error(`${label}: exited before printing its address: ${await stderr}`);
      out += new TextDecoder().decode(value);
    }
    reader.releaseLock();
    url = new URL(out.trim());
    expect((await fetch(`${url.origin}/outbound`, { headers: { "sec-fetch-site": "same-origin" } })).status).toBe(200);
  } catch (error) {
    child.kill("SIGKILL");
    throw error;
  }
  const sent = performance.now();
  child.kill("SIGTERM");
  const exited = await Promise.race([child.exited, Bun.sleep(5_000).then(() => "still running after 5 s")]);
  if (exited !== 0) child.kill("SIGKILL");
  expect(exited, `${label}: the exit after SIGTERM (stderr: ${await Promise.race([stderr, Bun.sleep(100).then(() => "")])})`).toBe(0);
  expect(performance.now() - sent).toBeLessThan(5_000);
  expect(await stderr).toContain("botmesh-durable console: stopped");
  const after = await fetch(`${url.origin}/outbound`).then((r) => `answered ${r.status}`, () => "refused");
  expect(after, `${label}: the port after SIGTERM`).toBe("refused");
}

describe("botmesh-durable console stops on SIGTERM: the server closed, exit 0", () => {
  test("Bun (bun cli.ts console)", async () => {
    await stopsOnSigterm([join(bin, "bun"), join(root, "cli.ts")], "bun");
  }, SLOW);

  test("Deno (deno run -A cli.ts console)", async () => {
    await stopsOnSigterm([join(bin, "deno"), "run", "-A", join(root, "cli.ts")], "deno");
  }, SLOW);

  test("Node 20 (bundled with bun build --target=node)", async () => {
    const out = bundleCliForNode(join(tmp, "cli-sigterm.mjs"));
    await stopsOnSigterm(["node", out], "node");
  }, SLOW);
});

describe("botmesh-durable console as a process (SQLite)", () => {
  test("--no-auth over real HTTP: a request for another Host (DNS rebinding) is refused, 127.0.0.1 and localhost served", async () => {
    const file = join(tmp, "noauth.db");
    const backend = new SQLiteDurability({ file });
    await backend.open();
    await backend.close();
    const child = Bun.spawn([join(bin, "bun"), join(root, "cli.ts"), "console", "--backend", `sqlite:${file}`, "--port", "0", "--no-auth"], {
      cwd: tmp,
      stdout: "pipe",
      stderr: "pipe",
      env: { ...process.env, BOTMESH_DURABLE_BACKEND: "", BOTMESH_CONSOLE_USER: "", BOTMESH_CONSOLE_PASSWORD: "" },
    });
    const stderr = new Response(child.stderr).text();
    try {
      const reader = child.stdout.getReader();
      let out = "";
      while (!out.includes("\n")) {
        const { value, done } = await reader.read();
        if (done) throw new Error(`exited before printing its address: ${await stderr}`);
        out += new TextDecoder().decode(value);
      }
      reader.releaseLock();
      const url = new URL(out.trim());
      const get = (host: string) => fetch(`${url.origin}/outbound`, { headers: { host, "sec-fetch-site": "same-origin" } });
      const rebound = await get(`evil.example:${url.port}`);
      expect(rebound.status).toBe(403);
      expect(await rebound.text()).toContain('not to Host "evil.example:');
      expect((await get(`127.0.0.1:${url.port}`)).status).toBe(200);
      expect((await get(`localhost:${url.port}`)).status).toBe(200);
    } finally {
      child.kill("SIGINT");
    }
    expect(await child.exited).toBe(0);
  }, SLOW);

  test("Bun (bun cli.ts console)", async () => {
    await realProcess([join(bin, "bun"), join(root, "cli.ts")], "bun");
  }, SLOW);

  test("Deno (deno run -A cli.ts console)", async () => {
    await realProcess([join(bin, "deno"), "run", "-A", join(root, "cli.ts")], "deno");
  }, SLOW);

  test("Node 20 (bundled with bun build --target=node)", async () => {
    const out = bundleCliForNode(join(tmp, "cli.mjs"));
    await realProcess(["node", out], "node");
  }, SLOW);
});

describe("the client address of a request", () => {
  test("serveHttp (Bun.serve here) records it for the handler", async () => {
    const handler = (request: Request) => Promise.resolve(new Response(remoteAddressOf(request) ?? "none"));
    const server = await serveHttp({ port: 0, hostname: "127.0.0.1", fetch: handler, nodeListener: nodeHandler(handler) as never });
    try {
      expect(await (await fetch(`http://127.0.0.1:${server.port}/`)).text()).toBe("127.0.0.1");
    } finally {
      await server.close();
    }
  });

  test("nodeHandler records the socket's remote address", async () => {
    let seen: string | undefined = "unset";
    const listener = nodeHandler((request) => {
      seen = remoteAddressOf(request);
      return Promise.resolve(new Response("ok"));
    });
    const headers: Record<string, string> = {};
    const ended = new Promise<void>((resolve) => {
      const res = { statusCode: 0, setHeader: (name: string, value: string) => void (headers[name] = value), end: () => resolve() };
      const req = { method: "GET", url: "/", headers: { host: "x" }, socket: { remoteAddress: "192.0.2.44" }, [Symbol.asyncIterator]: async function* () {} };
      void listener(req as never, res as never);
    });
    await ended;
    expect(seen).toBe("192.0.2.44");
  });
});
