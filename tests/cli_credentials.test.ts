// A backend URL in the CLI's messages never shows its password: the userinfo ends at the last "@" of the whole URL,
// so a password with "@", "/", "?" or "#" in it is hidden whole (an "@" in the path or query is hidden with it).
import { describe, expect, test } from "bun:test";
import { hideCredentials } from "../src/ops/url_credentials.ts";
import { runCli } from "../src/ops/cli.ts";
import { openBackend } from "../backends/open_url.ts";
import { runId, serviceSkip } from "./support/services.ts";

const SECRET = "s3cr3tPW";

test("hideCredentials: up to the last @ of the URL; the user name stays; an Upstash token is hidden whole", () => {
  const cases: [string, string][] = [
    ["postgres://app:p@ss@word@db.example:5432/x", "postgres://app:***@db.example:5432/x"],
    ["postgresql://app:secret@db.example/x?schema=bots", "postgresql://app:***@db.example/x?schema=bots"],
    ["postgres://app:@db.example/x", "postgres://app:***@db.example/x"],
    ["redis://default:p@ss@127.0.0.1:6379/0", "redis://default:***@127.0.0.1:6379/0"],
    ["rediss://:p@ss:w@rd@cache.example:6380", "rediss://:***@cache.example:6380"],
    ["redis+upstash://tok@en@eu1-x.upstash.io?keyPrefix=ab", "redis+upstash://***@eu1-x.upstash.io?keyPrefix=ab"],
    ["redis+upstash+http://t@127.0.0.1:8079", "redis+upstash+http://***@127.0.0.1:8079"],
    // a password with a delimiter of the authority
    ["postgres://app:ab#pw@127.0.0.1:1/db", "postgres://app:***@127.0.0.1:1/db"],
    ["postgresql://app:ab?pw@127.0.0.1:1/db", "postgresql://app:***@127.0.0.1:1/db"],
    ["redis://:ab/pw@127.0.0.1:1", "redis://:***@127.0.0.1:1"],
    ["rediss://default:ab#pw@127.0.0.1:1", "rediss://default:***@127.0.0.1:1"],
    ["redis+upstash://ab#pw@example.invalid", "redis+upstash://***@example.invalid"],
    // one slash, none, a leading space, an upper-case scheme
    ["postgres:/app:pw@127.0.0.1:1/db", "postgres:/app:***@127.0.0.1:1/db"],
    ["postgres:app:pw@127.0.0.1:1/db", "postgres:app:***@127.0.0.1:1/db"],
    [" postgres://app:pw@127.0.0.1:1/db\n", " postgres://app:***@127.0.0.1:1/db\n"],
    ["POSTGRES://app:pw@db.example/x", "POSTGRES://app:***@db.example/x"],
    // a userinfo without ":" is a user name for Postgres only; an unknown scheme's is hidden whole
    ["redis://pw@127.0.0.1:6379", "redis://***@127.0.0.1:6379"],
    ["postgress://app:pw@db.example/x", "postgress://***@db.example/x"],
    // a query parameter named like a secret
    ["redis://127.0.0.1:1/?password=pw", "redis://127.0.0.1:1/?password=***"],
    ["postgres://app@db.example/x?sslmode=require&sslpassword=pw#f", "postgres://app@db.example/x?sslmode=require&sslpassword=***#f"],
    ["redis+upstash://***@h?apiKey=pw&keyPrefix=bm:", "redis+upstash://***@h?apiKey=***&keyPrefix=bm:"],
    // an @ in the path or query is taken as the end of the userinfo (a password may have "/" or "?" in it)
    ["postgres://db.example:5432/x?application_name=me@host", "postgres://db.example:***@host"],
    ["postgres://app@db.example/x?options=a:b@c", "postgres://app@db.example/x?options=a:***@c"],
    ["redis://127.0.0.1:6379/0?keyPrefix=u:p@q", "redis://127.0.0.1:***@q"],
    // no password: as given
    ["postgres://app@db.example:5432/x", "postgres://app@db.example:5432/x"],
    ["postgres://db.example:5432/x?application_name=me", "postgres://db.example:5432/x?application_name=me"],
    ["redis://127.0.0.1:6379?keyPrefix=bm:", "redis://127.0.0.1:6379?keyPrefix=bm:"],
    ["sqlite:./data/a@b.db", "sqlite:./data/a@b.db"],
    ["events+shared:///srv/a@b.json", "events+shared:///srv/a@b.json"],
    ["./data/a@b.db", "./data/a@b.db"],
  ];
  for (const [url, shown] of cases) expect({ url, shown: hideCredentials(url) }).toEqual({ url, shown });
});

test("hideCredentials in a message: every URL quoted in it, the quotes kept", () => {
  expect(hideCredentials(`Unexpected argument "redis://127.0.0.1:1/?password=${SECRET}" for "list"`))
    .toBe('Unexpected argument "redis://127.0.0.1:1/?password=***" for "list"');
  expect(hideCredentials(`got "app:${SECRET}@db" and "postgres://u:${SECRET}@h/x"`)).toBe('got "app:***@h/x"');
  expect(hideCredentials('Flag "--json" does not apply to "stats"')).toBe('Flag "--json" does not apply to "stats"');
});

describe("openBackend: a URL refused before any connection does not show its password", () => {
  async function messageOf(url: string): Promise<string> {
    try {
      await (await openBackend(url)).close();
      return "(opened)";
    } catch (error) {
      return String((error as Error).message);
    }
  }
  for (
    const [url, reason] of [
      [`postgres://app:ab#${SECRET}@127.0.0.1:1/db`, "is not a valid URL"],
      [`postgresql://app:ab?${SECRET}@127.0.0.1:1/db`, "is not a valid URL"],
      [`redis://:ab/${SECRET}@127.0.0.1:1`, "is not a valid URL"],
      [`rediss://default:ab#${SECRET}@127.0.0.1:1`, "is not a valid URL"],
      [`redis+upstash://ab#${SECRET}@example.invalid`, "has no token"],
      [` postgres://app:${SECRET}@127.0.0.1:1/db`, "is of no known form"],
      [`redis://127.0.0.1:1/?password=${SECRET}`, 'has an unknown parameter "password"'],
    ]
  ) {
    test(JSON.stringify(url.replace(SECRET, "…")), async () => {
      const message = await messageOf(url!);
      expect(message).toContain(reason!);
      expect(message).not.toContain(SECRET);
    });
  }
});

describe("the CLI's usage errors quote an argument with its password hidden", () => {
  for (
    const [argv, shown] of [
      [[`--backnd=postgres://app:${SECRET}@db.example/bot`, "stats"], '"--backnd=postgres://app:***@db.example/bot"'],
      [[`postgres://app:${SECRET}@db.example/bot`, "stats"], '"postgres://app:***@db.example/bot"'],
      [["-b", "sqlite:./x.db", "list", "inbox", `redis://:${SECRET}@cache.example:6379`], '"redis://:***@cache.example:6379"'],
      [["console", `postgres://app:${SECRET}@db.example/bot`], '"postgres://app:***@db.example/bot"'],
      [["console", `--backnd=redis://127.0.0.1:6379/?password=${SECRET}`], '"--backnd=redis://127.0.0.1:6379/?password=***"'],
    ] as const
  ) {
    test(argv.join(" ").replace(SECRET, "…"), async () => {
      let stderr = "";
      const code = await runCli(argv, { stdout: (t) => void (stderr += t), stderr: (t) => void (stderr += t) }, {
        open: () => Promise.reject(new Error("not opened")),
      });
      expect(code).toBe(2);
      expect(stderr).toContain(shown);
      expect(stderr).not.toContain(SECRET);
    });
  }
});

async function cli(argv: string[]): Promise<{ code: number; stdout: string; stderr: string }> {
  let stdout = "";
  let stderr = "";
  const code = await runCli(argv, { stdout: (t) => void (stdout += t), stderr: (t) => void (stderr += t) }, { open: openBackend });
  return { code, stdout, stderr };
}

describe("the CLI's errors", async () => {
  const pgSkip = await serviceSkip("postgres");
  const redisSkip = await serviceSkip("redis");

  test.skipIf(pgSkip !== false)("Postgres: a password with @ (trust auth lets it in; the schema is missing)", async () => {
    const schema = `nope_${runId()}`;
    const r = await cli(["-b", `postgres://postgres:p@ss@word@127.0.0.1:5432/test?schema=${schema}`, "stats"]);
    expect(r.code).toBe(1);
    expect(r.stderr).toContain(`Postgres schema "${schema}" does not exist`);
    expect(r.stderr).toContain(`(from "postgres://postgres:***@127.0.0.1:5432/test?schema=${schema}")`);
    expect(r.stderr).not.toMatch(/ss@word|p@ss|word@/);
  });

  test("a URL of an unknown parameter (exit 2, nothing opened)", async () => {
    const r = await cli(["-b", "redis://u:p@ss@word@127.0.0.1:1?schema=x", "stats"]);
    expect(r.code).toBe(2);
    expect(r.stderr).toContain('Backend URL "redis://u:***@127.0.0.1:1?schema=x" has an unknown parameter "schema"');
    expect(r.stderr).not.toMatch(/ss@word|p@ss|word@/);
  });

  test.skipIf(redisSkip !== false)("Redis: a password with @ (the server has none, so any passes; the key prefix is empty)", async () => {
    const keyPrefix = `bm-none:${runId()}:`;
    const r = await cli(["-b", `redis://default:p@ss@word@127.0.0.1:6379?keyPrefix=${keyPrefix}`, "stats"]);
    expect(r.code).toBe(1);
    expect(r.stderr).toContain(`(from "redis://default:***@127.0.0.1:6379?keyPrefix=${keyPrefix}")`);
    expect(r.stderr).not.toMatch(/ss@word|p@ss|word@/);
  });
});
