/**
 * The simulated channel: one shared log of every send that reached it, and
 * inbound delivery with redelivery (a message the bot did not acknowledge is
 * delivered again; any message may be delivered again at any moment). Each
 * incarnation talks to it through its own {@link SimProvider}.
 *
 * @module
 */
import type { JsonValue } from "../../contract.ts";
import { ProviderError } from "../../errors.ts";
import type {
  InboundMessage,
  InboundSink,
  OutboundContent,
  Provider,
  SendConfirmation,
  SendContext,
  SendInQuestion,
  SendReceipt,
} from "../../provider.ts";
import type { RateLimits } from "../../rate_limit.ts";
import type { CallRecord } from "./ledger.ts";
import type { Incarnation, World } from "./world.ts";

/** An inbound message of the scenario. */
export interface SimMessage {
  id: string;
  chatId: string;
  chatIndex: number;
  text: string;
}

/** The shared channel. */
export class SimChannel {
  readonly world: World;
  /** Ids the channel got an acknowledgement for (admitted or duplicate). */
  readonly acked: Set<string> = new Set();
  /** Messages the bot refused with a TypeError (an id that is not well-formed): not to be delivered again. */
  readonly refused: Set<string> = new Set();
  /** Ids delivered at least once. */
  readonly delivered: Set<string> = new Set();
  /** Deliveries under way (sink calls not yet answered). */
  inFlight = 0;
  /** Provider calls under way. */
  callsInFlight = 0;
  #redeliverMinMs: number;
  /** What the channel tells afterwards (see `Scenario.settles`). */
  readonly settles: { statuses: boolean; confirm: boolean };
  /** The channel's rate limits, given to each provider (see `Scenario.rateLimits`). */
  readonly rateLimits: RateLimits | null;

  constructor(
    world: World,
    redeliverMinMs = 300,
    settles: { statuses: boolean; confirm: boolean } = { statuses: false, confirm: false },
    rateLimits: RateLimits | null = null,
  ) {
    this.world = world;
    this.#redeliverMinMs = redeliverMinMs;
    this.settles = settles;
    this.rateLimits = rateLimits;
  }

  /** A delivery status for an accepted send, some time later, to a live replica (if any is up then). */
  scheduleStatus(key: string, messageId: string): void {
    const world = this.world;
    world.sched.after(world.plan.int(0, 3 * world.leaseMs), () => {
      const live = world.replicas.map((r) => r.current)
        .filter((inc): inc is Incarnation => inc !== null && inc.alive && inc.confirmSent !== null && !world.frozen(inc.replica));
      if (live.length === 0) return; // the channel gives up on it
      const inc = world.plan.pick(live);
      world.log(inc.id, `delivery status for ${key} (${messageId})`);
      void inc.confirmSent!(key, messageId).then(
        (resolved) => world.log(inc.id, `delivery status for ${key} -> ${resolved ? "resolved an unknown send" : "noted"}`),
        (error) => world.log(inc.id, `delivery status for ${key} -> threw ${(error as Error)?.name}: ${(error as Error)?.message}`),
      );
    });
  }

  /** Deliver `message` to a live replica (its chat's sticky one when it can). */
  deliver(message: SimMessage, reason: "first" | "redeliver" | "duplicate"): void {
    const world = this.world;
    if (reason === "redeliver" && this.acked.has(message.id)) return;
    const live = world.replicas
      .map((r) => r.current)
      .filter((inc): inc is Incarnation => inc !== null && inc.alive && inc.receive !== null && !world.frozen(inc.replica));
    const sticky = world.replicas[message.chatIndex % world.replicas.length]!.current;
    let target: Incarnation | undefined = live.find((inc) => inc === sticky);
    if (reason === "duplicate" && live.length > 1 && world.plan.chance(0.3)) target = world.plan.pick(live);
    if (!target && live.length > 0) target = world.plan.pick(live);
    if (!target) {
      if (reason !== "duplicate" || !this.acked.has(message.id)) this.#retryLater(message);
      return;
    }
    const inc = target;
    this.delivered.add(message.id);
    this.inFlight++;
    world.log(inc.id, `inbound ${message.id} (${reason}) chat ${message.chatId}`);
    const receive = inc.receive!;
    void (async () => {
      let status: string;
      try {
        // A process that dies never answers the channel: the delivery is unacknowledged then.
        const result = await Promise.race([
          receive({ id: message.id, chatId: message.chatId, type: "text", text: message.text, extra: hostileExtra() }),
          inc.died.then(() => ({ status: "no answer" })),
        ]);
        status = result.status;
        if (result.status === "rejected" && "error" in result && result.error instanceof TypeError) {
          status = "refused";
          this.refused.add(message.id);
        }
      } catch (error) {
        status = `threw ${(error as Error)?.name}`;
      }
      await world.thaw(inc.replica);
      this.inFlight--;
      if (!inc.alive) status = `${status}, lost (the process died)`;
      world.log(inc.id, `inbound ${message.id} -> ${status}`);
      if (inc.alive && (status === "admitted" || status === "duplicate" || status === "refused")) this.acked.add(message.id);
      else if (!this.acked.has(message.id)) this.#retryLater(message);
    })();
  }

  #retryLater(message: SimMessage): void {
    const world = this.world;
    world.sched.after(world.plan.int(this.#redeliverMinMs, this.#redeliverMinMs * 8), () => this.deliver(message, "redeliver"));
  }

  /** A provider for one incarnation. */
  provider(inc: Incarnation): SimProvider {
    return new SimProvider(this, inc);
  }
}

/** One incarnation's view of the channel. */
export class SimProvider implements Provider {
  readonly name = "sim";
  readonly #channel: SimChannel;
  readonly #inc: Incarnation;

  /** Present when the scenario's channel can be asked (see `Scenario.settles`). */
  readonly confirm?: (send: SendInQuestion) => Promise<SendConfirmation | null>;
  /** Present when the scenario has rate limits: the outbox waits for them on the simulated clock. */
  readonly rateLimits?: RateLimits;

  constructor(channel: SimChannel, inc: Incarnation) {
    this.#channel = channel;
    this.#inc = inc;
    if (channel.settles.confirm) this.confirm = (send) => this.#confirm(send);
    if (channel.rateLimits) this.rateLimits = channel.rateLimits;
  }

  start(sink: InboundSink): void {
    if (!this.#inc.alive) return;
    this.#inc.receive = (message: InboundMessage) => sink.receive(message);
    const confirmSent = sink.confirmSent;
    this.#inc.confirmSent = confirmSent ? (key, messageId) => confirmSent.call(sink, key, messageId) : null;
  }

  stop(): void {
    this.#inc.receive = null;
    this.#inc.confirmSent = null;
  }

  /** The channel's truthful answer, after a lookup's latency; now and then it cannot tell, or fails. */
  async #confirm(send: SendInQuestion): Promise<SendConfirmation | null> {
    const world = this.#channel.world;
    const inc = this.#inc;
    if (!inc.alive) throw world.death();
    const key = send.idempotencyKey;
    const roll = world.plan.weighted({ truthful: 8, "cannot tell": 1, fails: 1 });
    await world.sched.sleep(world.plan.int(1, 50));
    await world.thaw(inc.replica);
    if (!inc.alive) throw world.death();
    if (roll === "fails") {
      world.log(inc.id, `confirm ${key} -> lookup failed`);
      throw new Error("confirm lookup failed (sim)");
    }
    const gen = world.ledger.genOf(key);
    const calls = world.ledger.calls.filter((c) => c.key === key && c.gen === gen);
    const accepted = calls.find((c) => c.accepted);
    const answer: SendConfirmation | null = roll === "cannot tell"
      ? null
      : accepted
      ? { delivered: true, messageId: `msg-${accepted.n}` }
      : calls.some((c) => c.end === null)
      ? null // a call under way may still arrive
      : { delivered: false };
    world.log(inc.id, `confirm ${key} -> ${answer === null ? "cannot tell" : answer.delivered ? `delivered as ${answer.messageId}` : "never arrived"}`);
    return answer;
  }

  async send(chatId: string, content: OutboundContent, context: SendContext): Promise<SendReceipt> {
    const inc = this.#inc;
    const world = this.#channel.world;
    const ledger = world.ledger;
    if (!inc.alive) throw world.death();
    const key = context.idempotencyKey;
    const token = ledger.claimTokens.get(`${inc.id}|${key}|${context.attempt}`);
    const now = world.sched.time;
    // A handler's i-th reply carries the key `<message id>:<i>` however it was made (ctx.reply or bot.send).
    // (A reply of a handler that ran a step carries its result: `reply <i> to <id> [svc=<result>]`.)
    const reply = typeof content === "string" ? /^reply (\d+) to (\S+)(?: \[svc=[^\]]*\])?$/.exec(content) : null;
    if (reply !== null && key !== `${reply[2]}:${reply[1]}`) {
      ledger.live.push({ invariant: "reply-key", time: now, detail: `${inc.id} sent "${content}" under the key ${key}, not ${reply[2]}:${reply[1]}` });
    }
    // An ask's timeout step is keyed by the timeout (`<first message id>:t1`), wherever it fired.
    const timeout = typeof content === "string" ? /^timeout of (.+)$/.exec(content) : null;
    if (timeout !== null && key !== `${timeout[1]}:t1:1`) {
      ledger.live.push({ invariant: "reply-key", time: now, detail: `${inc.id} sent "${content}" under the key ${key}, not ${timeout[1]}:t1:1` });
    }
    if (token === undefined) {
      ledger.live.push({ invariant: "call-without-lease", time: now, detail: `${inc.id} called the provider for ${key} (attempt ${context.attempt}) without a lease the sim saw granted` });
    } else if (ledger.isOutClosed(key, token) || ledger.outFenceOf(key) > token) {
      ledger.live.push({
        invariant: "call-under-lost-lease",
        time: now,
        detail: `${inc.id} started a provider call for ${key} under token ${token}, but ${
          ledger.isOutClosed(key, token) ? `that lease had already ended (outcome recorded or made ambiguous)` : `token ${ledger.outFenceOf(key)} was issued since`
        }`,
      });
    }
    const call: CallRecord = {
      n: ledger.calls.length + 1,
      key,
      chatId,
      content,
      replica: inc.replica.name,
      inc: inc.id,
      gen: ledger.genOf(key),
      token,
      attempt: context.attempt,
      start: now,
      end: null,
      outcome: "pending",
      accepted: false,
      acceptedIndex: null,
    };
    ledger.calls.push(call);
    const { outcome, latency } = world.pickCallFault("provider");
    world.log(inc.id, `provider call #${call.n} ${key} t${token ?? "?"} attempt ${context.attempt}${outcome !== "ok" ? ` [${outcome}]` : ""}${latency > 100 ? ` (${latency}ms)` : ""}`);
    this.#channel.callsInFlight++;
    const accept = () => {
      call.accepted = true;
      call.acceptedIndex = ledger.acceptedCount++;
      if (this.#channel.settles.statuses) this.#channel.scheduleStatus(key, `msg-${call.n}`);
    };
    try {
      if (outcome === "provider-crash") {
        const at = world.plan.int(0, latency);
        const delivered = world.plan.chance(0.5);
        await world.sched.sleep(at);
        if (delivered) accept();
        call.end = world.sched.time;
        call.outcome = delivered ? "crash after the channel accepted" : "crash before the channel accepted";
        world.log(inc.id, `provider call #${call.n} ${key}: ${call.outcome}`);
        if (inc.alive) {
          world.crashes++;
          world.crash(inc, `during provider call #${call.n} for ${key}`);
        }
        throw world.death();
      }
      await world.sched.sleep(latency);
      call.end = world.sched.time;
      let error: Error | null = null;
      switch (outcome) {
        case "ok":
          accept();
          break;
        case "provider-timeout":
          accept();
          error = Object.assign(new Error("timed out after the channel accepted it (sim)"), { name: "TimeoutError" });
          break;
        case "provider-transient":
          error = new ProviderError("503 service unavailable (sim)", { status: 503 });
          break;
        case "provider-permanent":
          error = new ProviderError("400 invalid recipient (sim)", { status: 400 });
          break;
        case "provider-retry-after":
          error = new ProviderError("429 too many requests (sim)", {
            status: 429,
            retryAfterMs: world.plan.int(100, 3000),
          });
          break;
      }
      call.outcome = error ? `${outcome}${call.accepted ? " (accepted)" : ""}` : "ok";
      world.log(inc.id, `provider call #${call.n} ${key} -> ${call.outcome}${inc.alive ? "" : " (the caller is dead)"}`);
      await world.thaw(inc.replica);
      if (!inc.alive) throw world.death();
      if (error) throw error;
      return { messageId: `msg-${call.n}` };
    } finally {
      this.#channel.callsInFlight--;
    }
  }
}

/**
 * What every inbound message carries besides its text: own keys that a careless copy turns into a
 * prototype (`__proto__`) or drops. The handler checks that it sees exactly this, live and replayed.
 */
export function hostileExtra(): JsonValue {
  return JSON.parse('{"__proto__": {"polluted": true}, "constructor": {"prototype": {"x": 1}}, "list": [{"__proto__": null}]}') as JsonValue;
}

/** The text of {@link hostileExtra}, to compare with. */
export const HOSTILE_EXTRA_TEXT: string = JSON.stringify(hostileExtra());
