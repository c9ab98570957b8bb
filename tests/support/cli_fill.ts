// The records the CLI tests work on.
import { expect } from "bun:test";
import type { DurabilityBackend } from "../../mod.ts";

export const OWNER = { owner: "cli-test", incarnation: "i1", leaseMs: 60_000 };

/** Dead, done and pending inbound records; dead and sent outbox entries. */
export async function fill(backend: DurabilityBackend): Promise<void> {
  await backend.open?.();
  const t = Date.now();
  const admit = (id: string, receivedAt: number) =>
    backend.inbox.admit({ id, kind: "message", chatId: "c1", provider: "mock", payload: { text: `text of ${id}` }, receivedAt });
  await admit("in-pending", t - 120_000);
  await admit("in-dead", t - 60_000);
  const dead = await backend.inbox.claim("in-dead", OWNER);
  await backend.inbox.start("in-dead", dead!.lease!.token, 1); // its handler ran once, as the bot journals it
  await backend.inbox.fail("in-dead", dead!.lease!.token, { error: 'Handler "boom" failed\nat line 2', dead: true });
  await admit("in-done", t - 30_000);
  const done = await backend.inbox.claim("in-done", OWNER);
  await backend.inbox.start("in-done", done!.lease!.token, 1);
  await backend.inbox.complete("in-done", done!.lease!.token);

  const reserve = (key: string, chatId: string) =>
    backend.outbox.reserve({ key, chatId, content: { text: key }, contentHash: key, inboundId: null }, OWNER);
  const r1 = await reserve("out-dead", "c2");
  expect(r1.status).toBe("leased");
  await backend.outbox.markFailed("out-dead", r1.entry.lease!.token, { error: "Invalid recipient", dead: true });
  const r2 = await reserve("out-sent", "c3");
  await backend.outbox.markSent("out-sent", r2.entry.lease!.token, "msg-1");
  await backend.close?.();
}

