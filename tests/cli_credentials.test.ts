// A backend URL in the CLI's messages never shows its password: the userinfo ends at the last "@" of the authority,
// as the drivers parse it, so a password with "@" in it is hidden whole; an "@" in the path or query is not userinfo.
import { describe, expect, test } from "bun:test";
import { hideCredentials } from "../backends/url_credentials.ts";
import { runCli } from "../src/ops/cli.ts";
import { openBackend } from "../backends/open_url.ts";
import { runId, serviceSkip } from "./support/services.ts";

test("hideCredentials: up to the last @ of the authority; the user name stays; an Upstash token is hidden whole", () => {
  const cases: [string, string][] = [
    ["postgres://app:p@ss@word@db.example:5432/x", "postgres://app:***@db.example:5432/x"],
    ["postgresql://app:secret@db.example/x?schema=bots", "postgresql://app:***@db.example/x?schema=bots"],
    ["postgres://app:@db.example/x", "postgres://app:***@db.example/x"],
    ["redis://default:p@ss@127.0.0.1:6379/0", "redis://default:***@127.0.0.1:6379/0"],
    ["rediss://:p@ss:w@rd@cache.example:6380", "rediss://:***@cache.example:6380"],
    ["redis+upstash://tok@en@eu1-x.upstash.io?keyPrefix=a@b", "redis+upstash://***@eu1-x.upstash.io?keyPrefix=a@b"],
    ["redis+upstash+http://t@127.0.0.1:8079", "redis+upstash+http://***@127.0.0.1:8079"],
    // no password: as given
    ["postgres://app@db.example:5432/x", "postgres://app@db.example:5432/x"],
    ["redis://127.0.0.1:6379", "redis://127.0.0.1:6379"],
    // an @ after the authority is not userinfo
    ["postgres://db.example:5432/x?application_name=me@host", "postgres://db.example:5432/x?application_name=me@host"],
    ["postgres://app@db.example/x?options=a:b@c", "postgres://app@db.example/x?options=a:b@c"],
    ["postgres://app:pw@db.example/we@ird#frag@x", "postgres://app:***@db.example/we@ird#frag@x"],
    ["redis://127.0.0.1:6379/0?keyPrefix=u:p@q", "redis://127.0.0.1:6379/0?keyPrefix=u:p@q"],
    ["sqlite:./data/a@b.db", "sqlite:./data/a@b.db"],
  ];
  for (const [url, shown] of cases) expect({ url, shown: hideCredentials(url) }).toEqual({ url, shown });
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
