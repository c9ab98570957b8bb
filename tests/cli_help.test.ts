// botmesh-durable's help and usage errors, in process (runCli with a recording opener): per-command help
// (`<command> --help`, `help <command>`), the one usage line of a usage error, and the exit codes.
import { describe, expect, test } from "bun:test";
import { MemoryDurability } from "../mod.ts";
import { BackendUrlError, COMMANDS, commandHelp, type OpenedBackend, runCli, usage, USAGE } from "../src/ops/cli.ts";
import { OperationError, usageLine } from "../src/ops/cli_command.ts";

interface Result {
  code: number;
  stdout: string;
  stderr: string;
  opened: string[];
}

async function cli(argv: string[], open?: (url: string) => Promise<OpenedBackend>): Promise<Result> {
  let stdout = "";
  let stderr = "";
  const opened: string[] = [];
  const code = await runCli(argv, { stdout: (t) => void (stdout += t), stderr: (t) => void (stderr += t) }, {
    open: (url) => {
      opened.push(url);
      if (open) return open(url);
      const backend = new MemoryDurability();
      return Promise.resolve({ backend, description: "memory", close: () => Promise.resolve() });
    },
    version: "9.9.9",
  });
  return { code, stdout, stderr, opened };
}

const command = (name: string) => COMMANDS.find((c) => c.name === name)!;

describe("help", () => {
  test("`<command> --help`, `<command> -h` and `help <command>` print that command's help, exit 0, open nothing", async () => {
    for (const c of COMMANDS) {
      const forms = await Promise.all([
        cli([c.name, "--help"]),
        cli([c.name, "-h"]),
        cli(["help", c.name]),
        cli(["-b", "sqlite:./x.db", c.name, ...c.args.map(() => "x"), "--help"]),
      ]);
      for (const r of forms) {
        expect({ name: c.name, code: r.code, stderr: r.stderr, opened: r.opened }).toEqual({
          name: c.name,
          code: 0,
          stderr: "",
          opened: [],
        });
        expect(r.stdout).toBe(commandHelp(c));
      }
      const help = forms[0]!.stdout;
      expect(help.startsWith(`Usage: ${usageLine(c)}\n\n${c.help}\n`)).toBe(true);
      for (const f of c.flags) expect(help).toContain(`--${f.name}`);
      expect(help).toContain("Exit codes: 0 done, 1 the operation failed");
      expect(help).toContain(c.changes ? "Changes the backend's records." : "Read-only: changes nothing and creates nothing");
      // Only this command: no other command's name starts a line of it, and no list of backend forms.
      for (const other of COMMANDS.filter((o) => o !== c)) {
        expect(help).not.toContain(`botmesh-durable [-b <url>] ${other.name} `);
      }
      expect(help).not.toContain("Accepted backend forms");
    }
  });

  test("the retry help, as a user reads it", async () => {
    const r = await cli(["retry", "--help"]);
    expect(r.stdout.split("\n").slice(0, 3)).toEqual([
      "Usage: botmesh-durable [-b <url>] retry <key> [--json]",
      "",
      'Queues an outbox entry that is dead, failed or unknown again (attempts reset): a running bot sends it',
    ]);
    expect(r.stdout).toContain("  botmesh-durable -b sqlite:./data/bot.db retry 9f1c2a:0\n");
    expect((await cli(["help", "purge"])).stdout).toContain(
      "Usage: botmesh-durable [-b <url>] purge --older-than <7d|12h|30m|ms> [--json]\n",
    );
    expect((await cli(["help", "list"])).stdout).toContain("--state <s[,s…]>     only records in these states\n");
  });

  test("`--help`, `-h`, `help`: the whole help, listing every command; help wins over a bad flag", async () => {
    for (const argv of [["--help"], ["-h"], ["help"], ["-b", "x.db", "--help"], ["--bogus", "--help"], ["retry", "--bogus", "-h"]]) {
      const r = await cli(argv);
      expect({ argv, code: r.code, stderr: r.stderr, opened: r.opened }).toEqual({ argv, code: 0, stderr: "", opened: [] });
      expect(r.stdout).toBe(argv[0] === "retry" ? commandHelp(command("retry")) : USAGE);
    }
    expect(USAGE).toBe(usage());
    for (const c of COMMANDS) expect(USAGE).toMatch(new RegExp(`\\n  ${c.name} +${c.summary.replace(/[()"|]/g, ".")}\\n`));
    expect(USAGE).toContain("Exit codes: 0 done, 1 the operation failed");
    expect(USAGE).toContain("Accepted backend forms:");
    expect(USAGE).toContain("events+file:./data/events.json");
  });

  test("help of an unknown command: exit 2", async () => {
    for (const argv of [["help", "frobnicate"], ["frobnicate", "--help"]]) {
      const r = await cli(argv);
      expect([r.code, r.stdout]).toEqual([2, ""]);
      expect(r.stderr).toContain('Unknown command "frobnicate"; commands are list, show, replay, retry');
    }
    const r = await cli(["help", "list", "show"]);
    expect(r.code).toBe(2);
    expect(r.stderr).toContain('"help" takes one command, got 2');
  });

  test("the command table: unique names; a flag name takes a value in every command or in none, and is not a global flag", () => {
    expect(new Set(COMMANDS.map((c) => c.name)).size).toBe(COMMANDS.length);
    expect(COMMANDS.map((c) => c.name)).not.toContain("help");
    const kinds = new Map<string, boolean>();
    for (const c of COMMANDS) {
      for (const f of c.flags) {
        expect(["backend", "json", "help", "version"]).not.toContain(f.name);
        const takesValue = f.value !== undefined;
        expect({ flag: f.name, takesValue }).toEqual({ flag: f.name, takesValue: kinds.get(f.name) ?? takesValue });
        kinds.set(f.name, takesValue);
      }
    }
  });

  test("--version", async () => {
    expect(await cli(["--version"])).toEqual({ code: 0, stdout: "botmesh-durable 9.9.9\n", stderr: "", opened: [] });
  });
});

describe("usage errors: exit 2, the message, the command's one usage line, nothing opened", () => {
  const cases: [string[], string, string][] = [
    [["list", "inbox", "--bogus"], "list", 'Unknown flag "--bogus"'],
    [["list", "mailbox"], "list", '"list" takes "inbox" or "outbox", got "mailbox"'],
    [["list"], "list", '"list" needs <inbox|outbox>; missing <inbox|outbox>'],
    [["list", "inbox", "--limit", "0"], "list", 'Flag "--limit" must be a positive integer, got "0"'],
    [["list", "outbox", "--state", "done"], "list", 'Flag "--state" has "done", not a outbox state; use queued, sending, sent, failed, dead, unknown'],
    [["show", "inbox"], "show", '"show" needs <inbox|outbox> <id>; missing <id>'],
    [["retry"], "retry", '"retry" needs <key>; missing <key>'],
    [["retry", "a", "b"], "retry", 'Unexpected argument "b" for "retry"'],
    [["retry", "a", "--limit", "3"], "retry", 'Flag "--limit" does not apply to "retry"'],
    [["replay", "a", "--chat"], "replay", 'Flag "--chat" needs a value'],
    [["purge"], "purge", '"purge" needs --older-than <7d|12h|30m|ms>'],
    [["purge", "--older-than", "soon"], "purge", 'Flag "--older-than" must be a duration like 7d, 12h, 30m or a number of ms, got "soon"'],
    [["stats", "--json=yes"], "stats", 'Flag "--json" takes no value, got "--json=yes"'],
    [["damaged", "--limit", "1", "--limit", "2"], "damaged", 'Flag "--limit" is given twice'],
    [["stats"], "stats", "Missing the backend: give --backend <url> or set BOTMESH_DURABLE_BACKEND"],
  ];
  for (const [argv, name, message] of cases) {
    test(argv.join(" "), async () => {
      const withBackend = message.startsWith("Missing the backend") ? argv : ["-b", "sqlite:./x.db", ...argv];
      const r = await cli(withBackend);
      expect({ code: r.code, stdout: r.stdout, opened: r.opened }).toEqual({ code: 2, stdout: "", opened: [] });
      expect(r.stderr).toBe(
        `botmesh-durable: ${message}\nUsage: ${usageLine(command(name))}\nRun "botmesh-durable ${name} --help" for more.\n`,
      );
    });
  }

  test("help console prints the console command's help", async () => {
    const r = await cli(["help", "console"]);
    expect([r.code, r.stderr]).toEqual([0, ""]);
    expect(r.stdout.startsWith("Usage: botmesh-durable console ")).toBe(true);
  });

  test("no command, or an unknown one: the general usage line and the list of commands", async () => {
    for (const [argv, message] of [
      [[], "Missing the command"],
      [["frobnicate"], 'Unknown command "frobnicate"; commands are list, show, replay, retry, mark-delivered, discard, purge, stats, damaged, console, help'],
      [["-x"], 'Unknown flag "-x"'],
    ] as [string[], string][]) {
      const r = await cli(argv);
      expect({ argv, code: r.code, stdout: r.stdout }).toEqual({ argv, code: 2, stdout: "" });
      expect(r.stderr).toBe(
        `botmesh-durable: ${message}\nUsage: botmesh-durable [--backend <url>] <command> [options]\n` +
          `Commands: list, show, replay, retry, mark-delivered, discard, purge, stats, damaged, console\nRun "botmesh-durable --help" for more.\n`,
      );
    }
  });
});

describe("exit codes", () => {
  test("0 done; 1 the operation failed or the backend cannot be opened; 2 a backend URL of no known form", async () => {
    const ok = await cli(["-b", "mem:", "stats", "--json"]);
    expect([ok.code, ok.stderr, ok.opened]).toEqual([0, "", ["mem:"]]);
    expect(JSON.parse(ok.stdout).backend).toBe("memory");

    const notFound = await cli(["-b", "mem:", "retry", "nope"]);
    expect([notFound.code, notFound.stderr]).toEqual([1, 'botmesh-durable: Outbox entry "nope" not found\n']);

    const missing = await cli(["-b", "mem:", "stats"], () => Promise.reject(new OperationError('SQLite file "x.db" does not exist')));
    expect([missing.code, missing.stdout, missing.stderr]).toEqual([1, "", 'botmesh-durable: SQLite file "x.db" does not exist\n']);

    const badUrl = await cli(["-b", "mysql://x", "stats"], (url) => Promise.reject(new BackendUrlError(url, "Backend URL is of no known form")));
    expect(badUrl.code).toBe(2);
    expect(badUrl.stderr).toContain("botmesh-durable: Backend URL is of no known form\nAccepted backend forms:");
    expect(badUrl.stderr).not.toContain("Usage:");
  });
});
