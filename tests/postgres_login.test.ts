// A login the Postgres server refuses is said as such, naming the user and the server (never the password), before
// what was being done: "Postgres login failed for user "app" at db:5432: …; cannot set up schema …". The local
// server trusts every login from 127.0.0.1 (no password is ever checked), so a wrong password (28P01) is a client
// that fails as porsager does; a role that does not exist (28000) is refused by the real server.
import { describe, expect, test } from "bun:test";
import postgres from "postgres";
import { PostgresDurability } from "../backends/postgres/mod.ts";
import { loginFailure } from "../backends/postgres/login_error.ts";
import { openBackend } from "../backends/open_url.ts";
import { runCli } from "../src/ops/cli.ts";
import { runId, serviceSkip } from "./support/services.ts";

/** A client whose every statement fails as porsager's does when the server refuses the login. */
function refusingClient(code: string, message: string, options: Record<string, unknown>) {
  const error = Object.assign(new Error(message), { name: "PostgresError", code, severity: "FATAL" });
  return { unsafe: () => Promise.reject(error), options };
}

describe("loginFailure", () => {
  test("28P01 and 28000 are a refused login, with the user and the server; other errors are not", () => {
    const target = { user: "app", host: ["db.example"], port: [5432], path: false, pass: "s3cret-pass" };
    const wrong = Object.assign(new Error('password authentication failed for user "app"'), { code: "28P01" });
    expect(loginFailure(wrong, { options: target })).toBe(
      'Postgres login failed for user "app" at db.example:5432: password authentication failed for user "app"',
    );
    const hba = Object.assign(new Error('no pg_hba.conf entry for host "10.0.0.7", user "app", database "x", no encryption'), {
      code: "28000",
    });
    expect(loginFailure(hba, { options: { ...target, host: ["a.example", "::1"], port: [5432, 6432] } })).toBe(
      `Postgres login failed for user "app" at a.example:5432,[::1]:6432: ${hba.message}`,
    );
    expect(loginFailure(hba, { options: { ...target, path: "/run/postgresql/.s.PGSQL.5432" } })).toStartWith(
      'Postgres login failed for user "app" at /run/postgresql/.s.PGSQL.5432: no pg_hba.conf entry',
    );
    // A client without porsager's options: the server's message still says what failed.
    expect(loginFailure(wrong, {})).toBe('Postgres login failed: password authentication failed for user "app"');
    expect(loginFailure(Object.assign(new Error("relation does not exist"), { code: "42P01" }), { options: target })).toBeNull();
    expect(loginFailure(Object.assign(new Error("closed"), { code: "CONNECTION_CLOSED" }), { options: target })).toBeNull();
    expect(loginFailure(new Error("boom"), { options: target })).toBeNull();
  });

  test("open(): a wrong password reads as a failed login first, then the schema it was setting up; no password", async () => {
    const sql = refusingClient("28P01", 'password authentication failed for user "app"', {
      user: "app",
      host: ["db.example"],
      port: [5432],
      path: false,
      pass: "s3cret-pass",
    });
    const error = await new PostgresDurability({ sql, schema: "bots" }).open().then(() => null, (e: Error) => e);
    expect(error?.message).toBe(
      'Postgres login failed for user "app" at db.example:5432: password authentication failed for user "app"; ' +
        'cannot set up schema "bots", tables "botmesh_*"',
    );
    expect(error?.message).not.toContain("s3cret");
    // Any other failure keeps the schema first.
    const other = refusingClient("42501", "permission denied for database test", { user: "app", host: ["db.example"], port: [5432] });
    const denied = await new PostgresDurability({ sql: other, schema: "bots" }).open().then(() => null, (e: Error) => e);
    expect(denied?.message).toBe('Postgres: cannot set up schema "bots", tables "botmesh_*": permission denied for database test');
  });
});

describe("a role the real server does not know (28000)", async () => {
  const skip = await serviceSkip("postgres");
  const role = `nobody_${runId()}`;

  test.skipIf(skip !== false)("open() names the user and the server", async () => {
    const sql = postgres(`postgres://${role}:pw-secret@127.0.0.1:5432/test`, { max: 1, onnotice: () => {}, connect_timeout: 10 });
    try {
      const error = await new PostgresDurability({ sql }).open().then(() => null, (e: Error) => e);
      expect(error?.message).toBe(
        `Postgres login failed for user "${role}" at 127.0.0.1:5432: role "${role}" does not exist; ` +
          `cannot set up schema "public", tables "botmesh_*"`,
      );
      expect(error?.message).not.toContain("pw-secret");
    } finally {
      await sql.end({ timeout: 0 });
    }
  });

  test.skipIf(skip !== false)("the CLI says the same, with the URL (password hidden)", async () => {
    let stderr = "";
    const code = await runCli(
      ["-b", `postgres://${role}:pw-secret@127.0.0.1:5432/test?schema=bots`, "stats"],
      { stdout: () => {}, stderr: (t) => void (stderr += t) },
      { open: openBackend },
    );
    expect(code).toBe(1);
    expect(stderr).toBe(
      `botmesh-durable: Postgres login failed for user "${role}" at 127.0.0.1:5432: role "${role}" does not exist ` +
        `(from "postgres://${role}:***@127.0.0.1:5432/test?schema=bots")\n`,
    );
  });
});
