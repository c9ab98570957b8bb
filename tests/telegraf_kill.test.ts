// A Telegraf bot made crash-safe with @botmesh/durable/telegraf (on SQLite; by bot.launch() long
// polling, and by Telegraf's webhookCallback), SIGKILLed at random moments while updates stream in and
// started again each time, with the inbox's default settings: at the end every update got both its
// replies, and a reply went out twice only where the restarted process reported the send as ambiguous
// (killed during its Bot API call; sent again under onAmbiguous: "resend"). By webhook, an update is
// delivered again until it is answered 200, as Telegram does.
import { test } from "bun:test";
import { join } from "node:path";
import { killTestDir } from "./support/kill_harness.ts";
import { exampleKilledMidHandler, type KillFixture, repliesKillRun } from "./support/plugin_kills.ts";

const dir = killTestDir("telegraf-kill", "TELEGRAF_KEEP");
const KILLS = Number(process.env.TELEGRAF_KILLS ?? 20);
const fixture: KillFixture = { name: "telegraf", script: "tests/fixtures/telegraf_bot.ts", label: "Telegraf bot", kills: KILLS, dir };

for (const mode of ["polling", "webhook"] as const) {
  test(`a Telegraf bot (${mode}) SIGKILLed ${KILLS} times while updates stream in: no update lost, no reply twice unreported`, () => repliesKillRun(fixture, mode), 120_000);
}

test("examples/telegraf_bot.ts killed with SIGKILL mid-handler: every reply once", () => exampleKilledMidHandler("examples/telegraf_bot.ts", join(dir, "example.db")), 60_000);
