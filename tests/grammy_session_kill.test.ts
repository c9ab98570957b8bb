// A grammY bot with sessions on SQLite through durableStorage (SQLiteStore for the journal and the
// sessions), SIGKILLed at random moments while updates stream in by long polling, restarted each time,
// with the inbox's default settings: at the end each chat's session counter equals the number of its
// updates, and its list holds each of its texts once (no update applied twice, none lost).
import { test } from "bun:test";
import { killTestDir } from "./support/kill_harness.ts";
import { type KillFixture, sessionsKillRun } from "./support/plugin_kills.ts";

const dir = killTestDir("grammy-session-kill", "GRAMMY_KEEP");
const KILLS = Number(process.env.GRAMMY_KILLS ?? 20);
const fixture: KillFixture = { name: "grammy", script: "tests/fixtures/grammy_session_bot.ts", label: "grammY session bot", kills: KILLS, dir };

test(`grammY sessions on durableStorage, the bot SIGKILLed ${KILLS} times while updates stream in: each update applied once`, () => sessionsKillRun(fixture, (chat) => String(chat)), 120_000);
