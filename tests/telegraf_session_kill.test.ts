// A Telegraf bot with sessions on SQLite through durableStorage (SQLiteStore for the journal and the
// sessions), SIGKILLed at random moments while updates stream in by long polling (bot.launch()),
// restarted each time, with the inbox's default settings: at the end each chat's session counter equals
// the number of its updates, and its list holds each of its texts once (no update applied twice, none lost).
import { test } from "bun:test";
import { killTestDir } from "./support/kill_harness.ts";
import { type KillFixture, sessionsKillRun } from "./support/plugin_kills.ts";

const dir = killTestDir("telegraf-session-kill", "TELEGRAF_KEEP");
const KILLS = Number(process.env.TELEGRAF_KILLS ?? 20);
const fixture: KillFixture = { name: "telegraf", script: "tests/fixtures/telegraf_session_bot.ts", label: "Telegraf session bot", kills: KILLS, dir };

// Telegraf's default session key is <from id>:<chat id>.
test(`Telegraf sessions on durableStorage, the bot SIGKILLed ${KILLS} times while updates stream in: each update applied once`, () => sessionsKillRun(fixture, (chat) => `${chat}:${chat}`), 120_000);
