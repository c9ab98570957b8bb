// A real BuilderBot bot (@builderbot/bot 1.3) on DurableMetaProvider, driven through the fake WhatsApp
// Cloud API (signed webhooks in, Graph API sends out): a capture flow of three questions, a redelivered
// webhook, a restart mid-flow with new process objects (new flows, so new random BuilderBot refs) on the
// same SQLite or file store, a crash of the handler after its sends, and BuilderBot's own HTTP server.
import { afterAll, afterEach, describe, expect, test } from "bun:test";
import { mkdirSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { addKeyword, createBot, createFlow, EVENTS, utils } from "@builderbot/bot";
import { type DurabilityBackend, MemoryDurability, MemoryStore, type SessionStore } from "../mod.ts";
import { SQLiteStore } from "../backends/sqlite/mod.ts";
import { FileDurability } from "../backends/file/mod.ts";
import { bodyOf, DurableMetaProvider } from "../providers/builderbot/mod.ts";
import { StableRefs } from "../providers/builderbot/refs.ts";
import { FakeWhatsApp, inbound, makeWamid, webhookPayload } from "./support/fake_whatsapp.ts";

const dir = join(tmpdir(), `botmesh-builderbot-tests-${crypto.randomUUID()}`);
mkdirSync(dir, { recursive: true });
afterAll(() => rmSync(dir, { recursive: true, force: true }));

const TOKEN = "EAAG-test-access-token";
const PHONE = "106540352242922";
const SECRET = "app-secret-0123456789abcdef";
const VERIFY = "verify-me-please";
const USER = "16505551234";
const USER2 = "16505550000";

const fake = FakeWhatsApp.start({ accessToken: TOKEN, phoneNumberId: PHONE, appSecret: SECRET });
afterAll(() => fake.close());

const cleanups: (() => Promise<void> | void)[] = [];
afterEach(async () => {
  while (cleanups.length > 0) await cleanups.pop()!();
});

/** What the flows saw, per process: the answers each callback captured. */
interface Seen {
  captured: string[];
  /** Set to make the callback of the n-th question throw once after its answer was captured (a crash). */
  throwOnce?: string;
}

/** The shop's flows, made anew for each "process": BuilderBot's refs are random per definition. */
function flows(seen: Seen) {
  const welcome = addKeyword(EVENTS.WELCOME).addAnswer("Bienvenido: escribe pedido para comprar");
  const order = addKeyword(["pedido"])
    .addAnswer("¿Qué talla?", { capture: true }, async (ctx, { state }) => {
      seen.captured.push(`size=${ctx.body}`);
      await state.update({ size: ctx.body });
    })
    .addAnswer("¿Qué color?", { capture: true }, async (ctx, { state }) => {
      seen.captured.push(`color=${ctx.body}`);
      await state.update({ color: ctx.body });
      if (seen.throwOnce === "color") {
        seen.throwOnce = undefined;
        throw new Error("crash after the colour was captured");
      }
    })
    .addAnswer("¿Cuántas?", { capture: true }, async (ctx, { state, flowDynamic }) => {
      seen.captured.push(`qty=${ctx.body}`);
      await flowDynamic(`Pedido: talla ${state.get("size")}, color ${state.get("color")}, ${ctx.body} unidades`);
    });
  const media = addKeyword(EVENTS.MEDIA).addAction(async (ctx, { provider, flowDynamic }) => {
    const file = await (provider as DurableMetaProvider).saveFile(ctx, { path: dir });
    seen.captured.push(`file=${file}`);
    await flowDynamic(`Imagen recibida (${ctx.caption ?? "sin texto"})`);
  });
  const cancel = addKeyword(["cancelar"]).addAnswer("¿Seguro?", { capture: true }, async (ctx, { endFlow }) => {
    seen.captured.push(`sure=${ctx.body}`);
    // endFlow sends its message without BuilderBot awaiting it: the handling still waits for it.
    if (ctx.body === "sí") return endFlow("Pedido cancelado");
  });
  const register = addKeyword(utils.setEvent("REGISTRO")).addAnswer("¿Tu nombre?", { capture: true }, async (ctx, { flowDynamic }) => {
    seen.captured.push(`name=${ctx.body}`);
    await flowDynamic(`Registrado: ${ctx.body}`);
  });
  return createFlow([welcome, order, media, cancel, register]);
}

interface Harness {
  provider: DurableMetaProvider;
  bot: Awaited<ReturnType<typeof createBot>>;
  hook: string;
  seen: Seen;
  dead: unknown[];
  errors: unknown[];
  stop(): Promise<void>;
}

async function harness(
  backend: DurabilityBackend,
  store: SessionStore,
  options: { serve?: "bun" | "builderbot"; flow?: ReturnType<typeof createFlow>; args?: Parameters<typeof createBot>[1] } = {},
): Promise<Harness> {
  const seen: Seen = { captured: [] };
  const provider = new DurableMetaProvider({
    whatsapp: { accessToken: TOKEN, phoneNumberId: PHONE, appSecret: SECRET, verifyToken: VERIFY, graphBase: fake.url, requestTimeoutMs: 2_000 },
    durability: {
      backend,
      instanceId: "builderbot-test",
      inbox: { retries: 3, backoff: { baseMs: 10, capMs: 40 } },
      outbox: { retries: 4, backoff: { baseMs: 10, capMs: 40 }, rateLimit: { perChat: false } },
    },
    store,
    settleMs: 10,
  });
  const dead: unknown[] = [];
  const errors: unknown[] = [];
  provider.onDurability("durability:dead", (d) => dead.push(d));
  provider.onDurability("error", (e) => errors.push(e));
  const bot = await createBot({ flow: options.flow ?? flows(seen), provider, database: provider.database }, options.args);
  provider.attach(bot);
  let hook: string;
  let stopServer: () => void | Promise<void>;
  if (options.serve === "builderbot") {
    bot.httpServer(0);
    await provider.start();
    const app = provider.server as unknown as { server?: { listening: boolean; address(): { port: number } } };
    // httpServer() starts the journal, then listens (BuilderBot does not wait for it).
    while (app.server?.listening !== true) await new Promise((r) => setTimeout(r, 5));
    hook = `http://127.0.0.1:${app.server.address().port}/webhook`;
    stopServer = () => {};
  } else {
    await provider.start();
    const server = Bun.serve({ hostname: "127.0.0.1", port: 0, fetch: provider.webhook });
    hook = `http://127.0.0.1:${server.port}/webhook`;
    stopServer = () => server.stop(true);
  }
  let stopped = false;
  const h: Harness = {
    provider,
    bot,
    hook,
    seen,
    dead,
    errors,
    async stop() {
      if (stopped) return;
      stopped = true;
      await stopServer();
      await provider.stop();
    },
  };
  cleanups.push(() => h.stop());
  return h;
}

/** The texts the fake received for `user`, in order, from attempt `since` on. */
function textsTo(user: string, since = 0): string[] {
  return fake.sent.slice(since).filter((a) => a.body.to === user).map((a) => a.body.text?.body ?? JSON.stringify(a.body));
}

/** Send one text the way Meta does and wait until the bot handled it. */
async function say(h: Harness, user: string, text: string, id: string = makeWamid()): Promise<string> {
  const statuses = await fake.deliver(h.hook, webhookPayload(PHONE, { messages: [inbound.text(user, text, id)], contacts: [{ wa_id: user, profile: { name: "Ana" } }] }));
  expect(statuses.at(-1)).toBe(200);
  await h.provider.idle();
  return id;
}

const FLOW = ["¿Qué talla?", "¿Qué color?", "¿Cuántas?", "Pedido: talla M, color rojo, 2 unidades"];

describe("BuilderBot on DurableMetaProvider", () => {
  test("a capture flow of three questions: each answer is captured once, the replies are keyed by the message", async () => {
    const h = await harness(new MemoryDurability(), new MemoryStore());
    const since = fake.attempts.length;
    const first = await say(h, USER, "hola");
    expect(textsTo(USER, since)).toEqual(["Bienvenido: escribe pedido para comprar"]);
    await say(h, USER, "pedido");
    await say(h, USER, "M");
    await say(h, USER, "rojo");
    const last = await say(h, USER, "2");
    expect(textsTo(USER, since).slice(1)).toEqual(FLOW);
    expect(h.seen.captured).toEqual(["size=M", "color=rojo", "qty=2"]);
    // The outbox keys are the inbound wamid and the send's number within its handling.
    const keys = (await h.provider.durability.outbox.list({ limit: 100 })).map((e) => e.key);
    expect(keys).toContain(`${first}:1`);
    expect(keys).toContain(`${last}:1`);
    // The state was written with the last message's done mark.
    expect(h.provider.state.getMyState(USER)()).toMatchObject({ size: "M", color: "rojo" });
    expect(h.dead).toEqual([]);
    expect(h.errors).toEqual([]);
  });

  test("a redelivered webhook is not run twice: the answer is captured once and the next question asked once", async () => {
    const h = await harness(new MemoryDurability(), new MemoryStore());
    const since = fake.attempts.length;
    await say(h, USER2, "pedido");
    const id = await say(h, USER2, "L");
    // Meta delivers the same message again (its answer was lost, say), twice, then once more concurrently.
    await say(h, USER2, "L", id);
    await Promise.all([say(h, USER2, "L", id), say(h, USER2, "L", id)]);
    expect(h.seen.captured).toEqual(["size=L"]);
    expect(textsTo(USER2, since)).toEqual(["¿Qué talla?", "¿Qué color?"]);
    await say(h, USER2, "azul");
    expect(textsTo(USER2, since)).toEqual(["¿Qué talla?", "¿Qué color?", "¿Cuántas?"]);
  });

  for (const kind of ["sqlite", "file"] as const) {
    test(`a restart mid-flow (${kind}): new process objects continue the flow with the right answers`, async () => {
      const make = (): { backend: DurabilityBackend; store: SessionStore; close(): Promise<void> | void } => {
        if (kind === "sqlite") {
          const store = new SQLiteStore({ file: join(dir, "restart.db") });
          return { backend: store.durability(), store, close: () => store.close() };
        }
        // The journal in a file of its own, the flow position and the state in SQLite.
        const store = new SQLiteStore({ file: join(dir, "restart-state.db") });
        return { backend: new FileDurability({ path: join(dir, "restart.journal") }), store, close: () => store.close() };
      };
      const since = fake.attempts.length;
      const one = make();
      const a = await harness(one.backend, one.store);
      await say(a, USER, "pedido");
      await say(a, USER, "M");
      expect(textsTo(USER, since)).toEqual(["¿Qué talla?", "¿Qué color?"]);
      await a.stop();
      await one.close();

      // A new process: new flows (other random refs), a new provider and bot, the same files.
      const two = make();
      const b = await harness(two.backend, two.store);
      expect(b.provider.state.getMyState(USER)()).toBeUndefined(); // nothing in memory yet
      await say(b, USER, "rojo");
      await say(b, USER, "2");
      expect(textsTo(USER, since)).toEqual(FLOW);
      expect(b.seen.captured).toEqual(["color=rojo", "qty=2"]);
      await b.stop();
      await two.close();
    });
  }

  test("a handling that throws after its sends runs again without sending twice, on the state from before it", async () => {
    const h = await harness(new MemoryDurability(), new MemoryStore());
    const since = fake.attempts.length;
    await say(h, USER, "pedido");
    await say(h, USER, "S");
    h.seen.throwOnce = "color";
    await say(h, USER, "verde");
    // The first run captured the colour and threw: the second captured it again, from the same position.
    expect(h.seen.captured).toEqual(["size=S", "color=verde", "color=verde"]);
    await say(h, USER, "3");
    expect(textsTo(USER, since)).toEqual(["¿Qué talla?", "¿Qué color?", "¿Cuántas?", "Pedido: talla S, color verde, 3 unidades"]);
    expect(h.dead).toEqual([]);
  });

  test("bot.httpServer(port): the webhook is served by BuilderBot's server, signature checked on the raw body", async () => {
    const h = await harness(new MemoryDurability(), new MemoryStore(), { serve: "builderbot" });
    const since = fake.attempts.length;
    const bad = await fake.post(h.hook, webhookPayload(PHONE, { messages: [inbound.text(USER2, "pedido")] }), { signature: "sha256=00" });
    expect(bad.status).toBe(401);
    const verify = await fetch(`${h.hook}?hub.mode=subscribe&hub.verify_token=${VERIFY}&hub.challenge=42`);
    expect(await verify.text()).toBe("42");
    await say(h, USER2, "pedido");
    expect(textsTo(USER2, since)).toEqual(["¿Qué talla?"]);
  });
});

describe("dispatch", () => {
  test("bot.dispatch from an HTTP route is journaled: its flow runs from the inbox, its sends keyed by its record", async () => {
    const h = await harness(new MemoryDurability(), new MemoryStore(), { serve: "builderbot" });
    const since = fake.attempts.length;
    h.provider.server.post(
      "/v1/register",
      h.bot.handleCtx(async (bot, req, res) => {
        await bot!.dispatch("REGISTRO", { from: (req as unknown as { body: { number: string } }).body.number, name: "Ana" });
        res.end("ok");
      }),
    );
    const route = h.hook.replace("/webhook", "/v1/register");
    const answer = await fetch(route, { method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify({ number: USER }) });
    expect(await answer.text()).toBe("ok");
    await h.provider.idle();
    expect(textsTo(USER, since)).toEqual(["¿Tu nombre?"]);
    const records = await h.provider.durability.inbox.list({ limit: 100 });
    const dispatched = records.find((r) => r.id.startsWith("bb-dispatch:"))!;
    expect(dispatched.state).toBe("done");
    expect((await h.provider.durability.outbox.list({ limit: 100 })).map((e) => e.key)).toContain(`${dispatched.id}:1`);
    await say(h, USER, "Ana");
    expect(textsTo(USER, since)).toEqual(["¿Tu nombre?", "Registrado: Ana"]);
    expect(h.seen.captured).toEqual(["name=Ana"]);
  });

  test("provider.dispatch resolves once the event is journaled; its flow runs from the inbox", async () => {
    const h = await harness(new MemoryDurability(), new MemoryStore());
    const since = fake.attempts.length;
    expect(await h.provider.dispatch("REGISTRO", { from: `+${USER2}`, name: "Ana" }, { id: "req-1" })).toBe("admitted");
    expect(await h.provider.dispatch("REGISTRO", { from: USER2, name: "Ana" }, { id: "req-1" })).toBe("duplicate"); // the request retried
    expect((await h.provider.durability.inbox.list({ limit: 100 })).filter((r) => r.id.startsWith("bb-dispatch:")).map((r) => r.id)).toEqual(["bb-dispatch:req-1"]);
    await h.provider.idle();
    await say(h, USER2, "Luis");
    expect(textsTo(USER2, since)).toEqual(["¿Tu nombre?", "Registrado: Luis"]);
    await h.stop();
    await expect(h.provider.dispatch("REGISTRO", { from: USER2 })).rejects.toThrow(/not started/);
  });

  test("a custom event's flow keeps its stable names although BuilderBot encrypts its keyword with a key of each start", () => {
    // Two "processes": the same flow, its keyword encrypted under two keys (stood in for by two prefixes).
    const step = (keyword: string) => ({ flowSerialize: [{ ref: `key_${keyword}`, keyword, options: {}, refSerialize: `rs-${keyword}` }] });
    const one = new StableRefs(step("AAAA"), (k) => (k === "AAAA" ? "_event_custom_X_" : undefined));
    const two = new StableRefs(step("BBBB"), (k) => (k === "BBBB" ? "_event_custom_X_" : undefined));
    expect(two.decode(one.encode({ ref: "key_AAAA", refSerialize: "rs-AAAA" }))).toEqual({ ref: "key_BBBB", refSerialize: "rs-BBBB" });
  });
});

describe("endFlow", () => {
  test("endFlow's message (which BuilderBot does not await) is the handling's send; the flow is over after it", async () => {
    const h = await harness(new MemoryDurability(), new MemoryStore());
    const since = fake.attempts.length;
    await say(h, USER2, "cancelar");
    const id = await say(h, USER2, "sí");
    await say(h, USER2, "hola");
    expect(textsTo(USER2, since)).toEqual(["¿Seguro?", "Pedido cancelado", "Bienvenido: escribe pedido para comprar"]);
    const entries = await h.provider.durability.outbox.list({ limit: 100 });
    expect(entries.find((e) => e.key.startsWith(id))?.key).toBe(`${id}:1`);
    expect(entries.filter((e) => !/^wamid\..+:\d+$/.test(e.key)).map((e) => e.key), "sends with a random key").toEqual([]);
  });
});

describe("media", () => {
  test("an image runs the EVENTS.MEDIA flow; saveFile downloads it again through the Graph API", async () => {
    const h = await harness(new MemoryDurability(), new MemoryStore());
    const since = fake.attempts.length;
    const bytes = new Uint8Array([0x89, 0x50, 0x4e, 0x47, 1, 2, 3]);
    const mediaId = await fake.addMedia(bytes, "image/png");
    const payload = webhookPayload(PHONE, { messages: [inbound.media("image", USER2, { id: mediaId, mime_type: "image/png", caption: "mira" })] });
    expect(await fake.deliver(h.hook, payload)).toEqual([200]);
    await h.provider.idle();
    expect(textsTo(USER2, since)).toEqual(["Imagen recibida (mira)"]);
    const file = h.seen.captured[0]!.slice("file=".length);
    expect(file.endsWith(".png")).toBe(true);
    expect(new Uint8Array(await Bun.file(file).arrayBuffer())).toEqual(bytes);
  });
});

describe("the pieces", () => {
  test("stable refs: two definitions of the same flows name their steps alike", () => {
    type Steps = { flowSerialize: { ref: string; refSerialize: string; keyword: string }[] };
    const f1 = flows({ captured: [] }) as unknown as Steps;
    const f2 = flows({ captured: [] }) as unknown as Steps;
    const one = new StableRefs(f1);
    const two = new StableRefs(f2);
    expect(one.size).toBeGreaterThan(8);
    for (const i of [0, 2, 3, 5]) {
      const [s1, s2] = [f1.flowSerialize[i]!, f2.flowSerialize[i]!];
      expect(s1.ref).not.toBe(s2.ref); // BuilderBot's refs are random per definition
      const stored = one.encode({ ref: s1.ref, refSerialize: s1.refSerialize, keyword: s1.keyword, answer: "M", f: () => 1 });
      expect(JSON.stringify(stored)).not.toContain(s1.ref);
      expect(two.decode(stored)).toEqual({ ref: s2.ref, refSerialize: s2.refSerialize, keyword: s2.keyword, answer: "M" });
      expect(one.decode(stored)).toEqual({ ref: s1.ref, refSerialize: s1.refSerialize, keyword: s1.keyword, answer: "M" });
    }
  });

  test("bodies: media and locations become BuilderBot's event bodies, the same on every run", () => {
    const image = { id: "wamid.1", chatId: USER, type: "image", extra: { waType: "image" } };
    expect(bodyOf(image)).toMatch(/^_event_media__[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/);
    expect(bodyOf(image)).toBe(bodyOf({ ...image }));
    expect(bodyOf({ id: "wamid.2", chatId: USER, type: "location", text: "x", extra: { waType: "location" } })).toMatch(/^_event_location__/);
    expect(bodyOf({ id: "wamid.3", chatId: USER, type: "interaction", interaction: { id: "b1", value: { kind: "button_reply", title: "Sí" } } })).toBe("Sí");
  });

  test("attach refuses a bot made with another database, and start() needs an attached bot", async () => {
    const provider = new DurableMetaProvider({
      whatsapp: { accessToken: TOKEN, phoneNumberId: PHONE, appSecret: SECRET, verifyToken: VERIFY, graphBase: fake.url },
      durability: { backend: new MemoryDurability(), instanceId: "x" },
      store: new MemoryStore(),
    });
    await expect(provider.start()).rejects.toThrow(/attach the bot first/);
    const { MemoryDB } = await import("@builderbot/bot");
    const bot = await createBot({ flow: flows({ captured: [] }), provider, database: new MemoryDB() });
    expect(() => provider.attach(bot)).toThrow(/database/);
  });
});

/** Wait (polling) until `condition` holds: a condition, not a fixed delay, is what the tests wait for. */
async function until(condition: () => boolean, what: string, timeoutMs = 10_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!condition()) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 5));
  }
}

/** Deliver a text the way Meta does, without waiting for its handling. */
async function deliver(h: Harness, user: string, text: string, id: string = makeWamid()): Promise<string> {
  const statuses = await fake.deliver(h.hook, webhookPayload(PHONE, { messages: [inbound.text(user, text, id)], contacts: [{ wa_id: user, profile: { name: "Ana" } }] }));
  expect(statuses.at(-1)).toBe(200);
  return id;
}

describe("review fixes", () => {
  test("bot.sendMessage from BuilderBot's /v1/messages route sends (BuilderBot passes it unbound)", async () => {
    const h = await harness(new MemoryDurability(), new MemoryStore(), { serve: "builderbot" });
    const since = fake.attempts.length;
    h.provider.server.post(
      "/v1/messages",
      h.bot.handleCtx(async (bot, req, res) => {
        const { number, message, urlMedia } = (req as unknown as { body: { number: string; message: string; urlMedia?: string } }).body;
        await bot!.sendMessage(number, message, { media: urlMedia ?? null });
        return res.end("sended");
      }),
    );
    const answer = await fetch(h.hook.replace("/webhook", "/v1/messages"), {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ number: USER, message: "hola desde la API" }),
    });
    expect(answer.status).toBe(200);
    expect(await answer.text()).toBe("sended");
    await h.provider.idle();
    expect(textsTo(USER, since)).toEqual(["hola desde la API"]);
  });

  test("a reaction (and a system or unsupported message) is not given to the flows: a 👍 does not answer a question", async () => {
    expect(bodyOf({ id: "wamid.r", chatId: USER, type: "reaction", text: "👍", extra: { waType: "reaction" } })).toBe("");
    expect(bodyOf({ id: "wamid.s", chatId: USER, type: "system", text: "changed number", extra: { waType: "system" } })).toBe("");
    expect(bodyOf({ id: "wamid.u", chatId: USER, type: "unsupported", text: "x", extra: { waType: "unsupported" } })).toBe("");
    const h = await harness(new MemoryDurability(), new MemoryStore());
    const since = fake.attempts.length;
    await say(h, USER2, "pedido");
    await fake.deliver(h.hook, webhookPayload(PHONE, { messages: [inbound.other(USER2, "reaction", { message_id: "wamid.prev", emoji: "👍" })] }));
    await h.provider.idle();
    expect(textsTo(USER2, since)).toEqual(["¿Qué talla?"]);
    expect(h.seen.captured).toEqual([]);
    await say(h, USER2, "M");
    expect(h.seen.captured).toEqual(["size=M"]);
    expect(textsTo(USER2, since)).toEqual(["¿Qué talla?", "¿Qué color?"]);
  });

  test("a route's state(number).update after a restart keeps the stored answers (merged with the store, not the empty memory)", async () => {
    const backend = new MemoryDurability();
    const store = new MemoryStore();
    const a = await harness(backend, store);
    const since = fake.attempts.length;
    await say(a, USER, "pedido");
    await say(a, USER, "M");
    await a.stop();
    const b = await harness(backend, store, { serve: "builderbot" });
    b.provider.server.post(
      "/vip",
      b.bot.handleCtx(async (bot, _req, res) => {
        await bot!.state(USER).update({ vip: true });
        res.end("ok");
      }),
    );
    expect(await (await fetch(b.hook.replace("/webhook", "/vip"), { method: "POST" })).text()).toBe("ok");
    await b.provider.idle();
    expect(b.provider.state.getMyState(USER)()).toMatchObject({ size: "M", vip: true });
    await say(b, USER, "rojo");
    await say(b, USER, "2");
    expect(textsTo(USER, since)).toEqual(FLOW);
    expect(b.provider.state.getMyState(USER)()).toMatchObject({ size: "M", color: "rojo", vip: true });
  });

  test("a dead-lettered handling's state change stays out of memory: a later route update does not persist it", async () => {
    const flow = createFlow([
      addKeyword(EVENTS.WELCOME).addAnswer("hi"),
      addKeyword("pedido").addAnswer("¿Qué talla?", { capture: true }, async (ctx, { state }) => {
        await state.update({ size: ctx.body });
        throw new Error("stock API down");
      }),
    ]);
    const store = new MemoryStore();
    const h = await harness(new MemoryDurability(), store, { flow });
    await say(h, USER2, "pedido");
    await deliver(h, USER2, "XL");
    await until(() => h.dead.length === 1, "the dead letter");
    await h.provider.idle();
    expect(h.provider.state.getMyState(USER2)()?.size).toBeUndefined();
    await h.provider.state.updateState({ from: USER2 })({ vip: true });
    await h.provider.idle();
    const stored = (await store.get(`builderbot:state:${USER2}`)) as { v?: Record<string, unknown> } | undefined;
    expect(stored?.v?.vip).toBe(true);
    expect(stored?.v?.size).toBeUndefined();
  });

  test("a flow's notice to another chat, while that chat's message is handled, is keyed by the flow's own message", async () => {
    const ADMIN = "16505559999";
    let reports = 0;
    let release!: () => void;
    const gate = new Promise<void>((r) => (release = r));
    const flow = createFlow([
      addKeyword(EVENTS.WELCOME).addAnswer("hi"),
      addKeyword("pedido").addAction(async (ctx, { provider, flowDynamic }) => {
        await (provider as DurableMetaProvider).sendMessage(ADMIN, `nuevo pedido de ${ctx.from}`, {});
        await flowDynamic("gracias");
      }),
      addKeyword("informe").addAction(async (_ctx, { flowDynamic }) => {
        reports++;
        await gate;
        if (reports === 1) throw new Error("transient failure");
        await flowDynamic("informe listo");
      }),
    ]);
    const h = await harness(new MemoryDurability(), new MemoryStore(), { flow });
    const since = fake.attempts.length;
    const adminId = await deliver(h, ADMIN, "informe");
    await until(() => reports === 1, "the admin's handling to start");
    const userId = await deliver(h, USER, "pedido");
    await until(() => textsTo(USER, since).length === 1, "the user's reply");
    release();
    await h.provider.idle();
    expect(textsTo(USER, since)).toEqual(["gracias"]);
    expect(textsTo(ADMIN, since).sort()).toEqual(["informe listo", `nuevo pedido de ${USER}`]);
    const entries = await h.provider.durability.outbox.list({ limit: 100 });
    const key = (text: string) => entries.find((e) => JSON.stringify(e.content) === JSON.stringify(text))?.key;
    expect(key(`nuevo pedido de ${USER}`)?.startsWith(`${userId}:`)).toBe(true);
    expect(key("informe listo")?.startsWith(`${adminId}:`)).toBe(true);
    expect(h.dead).toEqual([]);
  });

  test("a dispatch made in a handling is keyed by it: a rerun of the handling does not dispatch again", async () => {
    let runs = 0;
    const flow = createFlow([
      addKeyword(EVENTS.WELCOME).addAnswer("hi"),
      addKeyword("pagar").addAction(async (ctx, { provider }) => {
        (provider as DurableMetaProvider).dispatchInside({ from: ctx.from, name: "Ana", body: utils.setEvent("PAGO") });
        if (++runs === 1) throw new Error("transient error after the dispatch");
      }),
      addKeyword(utils.setEvent("PAGO")).addAnswer("Enlace de pago enviado"),
    ]);
    const h = await harness(new MemoryDurability(), new MemoryStore(), { flow });
    const since = fake.attempts.length;
    const id = await say(h, USER2, "pagar");
    await until(() => runs === 2, "the rerun");
    await h.provider.idle();
    expect(textsTo(USER2, since)).toEqual(["Enlace de pago enviado"]);
    const dispatched = (await h.provider.durability.inbox.list({ limit: 100 })).filter((r) => r.id.startsWith("bb-dispatch:")).map((r) => r.id);
    expect(dispatched).toEqual([`bb-dispatch:${id}:dispatch:1`]);
  });

  test("a callback slower than BuilderBot's queue timeout is still the handling's: it ends after the callback's send and state", async () => {
    const flow = createFlow([
      addKeyword(EVENTS.WELCOME).addAnswer("hi"),
      addKeyword("pregunta").addAction(async (_ctx, { flowDynamic, state }) => {
        await new Promise((r) => setTimeout(r, 300)); // the work (a model's call), longer than the queue timeout
        await state.update({ answered: true });
        await flowDynamic("respuesta del modelo");
      }),
    ]);
    const store = new MemoryStore();
    const h = await harness(new MemoryDurability(), store, { flow, args: { queue: { timeout: 50, concurrencyLimit: 15 } } });
    const since = fake.attempts.length;
    const id = await say(h, USER, "pregunta");
    expect((await h.provider.durability.inbox.get(id))?.state).toBe("done");
    expect(textsTo(USER, since)).toEqual(["respuesta del modelo"]);
    expect((await h.provider.durability.outbox.list({ limit: 100 })).map((e) => e.key)).toContain(`${id}:1`);
    expect(((await store.get(`builderbot:state:${USER}`)) as { v?: Record<string, unknown> } | undefined)?.v?.answered).toBe(true);
  });

  test("an unawaited flowDynamic held back by BuilderBot's delay is still the handling's send", async () => {
    const flow = createFlow([
      addKeyword(EVENTS.WELCOME).addAnswer("hi"),
      addKeyword("info").addAction(async (_ctx, { flowDynamic }) => {
        void flowDynamic("aquí tienes la info");
      }),
    ]);
    const h = await harness(new MemoryDurability(), new MemoryStore(), { flow, args: { delay: 150 } });
    const since = fake.attempts.length;
    const id = await say(h, USER2, "info");
    expect(textsTo(USER2, since)).toEqual(["aquí tienes la info"]);
    expect((await h.provider.durability.outbox.list({ limit: 100 })).map((e) => e.key)).toEqual([`${id}:1`]);
  });

  test("options: settleMs above a timer's limit, and a name or port of the wrong type, are refused naming the option", () => {
    const base = {
      whatsapp: { accessToken: TOKEN, phoneNumberId: PHONE, appSecret: SECRET, verifyToken: VERIFY, graphBase: fake.url },
      durability: { backend: new MemoryDurability(), instanceId: "x" },
      store: new MemoryStore(),
    };
    expect(() => new DurableMetaProvider({ ...base, settleMs: 2 ** 31 })).toThrow(RangeError);
    expect(() => new DurableMetaProvider({ ...base, settleMs: 2 ** 31 })).toThrow(/settleMs/);
    expect(() => new DurableMetaProvider({ ...base, name: 42 as unknown as string })).toThrow(/Option "name"/);
    expect(() => new DurableMetaProvider({ ...base, port: "3000" as unknown as number })).toThrow(/Option "port"/);
  });
});
