// A grammY bot made crash-safe with @botmesh/durable/grammy (on SQLite; by grammY's long polling,
// by @grammyjs/runner, and by webhook), SIGKILLed at random moments while updates stream in and started again each time: at
// the end every update got both its replies, and a reply went out twice only where the restarted
// process reported the send as ambiguous (killed during its Bot API call; sent again under
// onAmbiguous: "resend"). By webhook, an update is delivered again until it is answered 200, as
// Telegram does.
import { test } from "bun:test";
import { join } from "node:path";
import { killTestDir } from "./support/kill_harness.ts";
import { exampleKilledMidHandler, type KillFixture, repliesKillRun } from "./support/plugin_kills.ts";

const dir = killTestDir("grammy-kill", "GRAMMY_KEEP");
const KILLS = Number(process.env.GRAMMY_KILLS ?? 25);
const fixture: KillFixture = { name: "grammy", script: "tests/fixtures/grammy_bot.ts", label: "grammY bot", kills: KILLS, dir };

for (const mode of ["polling", "runner", "webhook"] as const) {
  test(`a grammY bot (${mode}) SIGKILLed ${KILLS} times while updates stream in: no update lost, no reply twice unreported`, () => repliesKillRun(fixture, mode), 240_000);
}

test("examples/grammy_bot.ts killed with SIGKILL mid-handler: every reply once", () => exampleKilledMidHandler("examples/grammy_bot.ts", join(dir, "example.db")), 60_000);
