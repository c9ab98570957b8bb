/**
 * A fault-injecting view of the shared backend, one per incarnation. At every
 * journal call the seeded plan picks: nothing, an error before the write (no
 * effect), a lost reply after the write (it committed), a delay before or
 * after, or the death of the process before or after. It also feeds the
 * ledger with the real effect of every call.
 *
 * @module
 */
import {
  type ClaimOptions,
  type DurabilityBackend,
  type FailOutcome,
  type InboundRecord,
  type InboxJournal,
  type OutboxClaim,
  type OutboxEntry,
  type OutboxJournal,
  type ReserveResult,
  StaleLeaseError,
  INBOX_JOURNAL_METHODS,
  OUTBOX_JOURNAL_METHODS,
} from "../../contract.ts";
import { stepOf } from "../../engine/steps.ts";
import type { AdmissionRecord, AmbiguityRecord, LeaseGrant, LostBy } from "./ledger.ts";
import type { Incarnation, World } from "./world.ts";
import { SIM_EPOCH } from "./scheduler.ts";

/** A network error before the request reached the server: nothing happened. */
export class ConnectionRefused extends Error {
  constructor(op: string) {
    super(`connection refused (sim, ${op})`);
    this.name = "ConnectionRefused";
  }
}

/** A network error after the server committed: the reply was lost. */
export class ConnectionReset extends Error {
  constructor(op: string) {
    super(`connection reset after commit (sim, ${op})`);
    this.name = "ConnectionReset";
  }
}

type JournalFault =
  | { kind: "none" }
  | { kind: "error-before" }
  | { kind: "lost-reply" }
  | { kind: "delay"; before: number; after: number }
  | { kind: "crash"; when: "before" | "after" };

/** Ops traced even without a fault (the others are too frequent). */
const QUIET = new Set(["heartbeat", "get", "list", "purge"]);

function pickFault(world: World): JournalFault {
  if (!world.faultsActive || world.journalFaultRate <= 0 || !world.plan.chance(world.journalFaultRate)) {
    return { kind: "none" };
  }
  const kind = world.plan.weighted({
    "error-before": world.can("error-before") ? 3 : 0,
    "lost-reply": world.can("lost-reply") ? 3 : 0,
    delay: world.can("delay") ? 3 : 0,
    crash: world.can("crash") ? 1 : 0,
    none: 0.001,
  });
  switch (kind) {
    case "error-before":
    case "lost-reply":
      return { kind };
    case "delay": {
      const long = world.plan.chance(0.3);
      const ms = long ? world.plan.int(Math.floor(world.leaseMs / 2), world.leaseMs * 2) : world.plan.int(1, 200);
      return world.plan.chance(0.5) ? { kind, before: ms, after: 0 } : { kind, before: 0, after: ms };
    }
    case "crash":
      return { kind, when: world.plan.chance(0.5) ? "before" : "after" };
    default:
      return { kind: "none" };
  }
}

function faultName(fault: JournalFault): string {
  switch (fault.kind) {
    case "delay":
      return fault.before > 0 ? `delay ${fault.before}ms before` : `delay ${fault.after}ms after`;
    case "crash":
      return `crash ${fault.when}`;
    default:
      return fault.kind;
  }
}

/** A record or entry in a line, without its incarnation id (a random UUID: not part of the trace). */
function brief(value: unknown): string {
  const r = value as Partial<InboundRecord & OutboxEntry>;
  const lease = r.lease ? ` lease ${r.lease.owner} t${r.lease.token}` : "";
  return `${r.key ?? r.id} ${r.state} t${r.fence}${lease}`;
}

function show(value: unknown): string {
  if (value === undefined) return "undefined";
  if (value instanceof Error) return `${value.name}: ${value.message}`;
  if (Array.isArray(value)) return `[${value.map((v) => (typeof v === "object" && v !== null && "state" in v ? brief(v) : show(v))).join(", ")}]`;
  if (typeof value === "object" && value !== null && "state" in value) return brief(value);
  return JSON.stringify(value);
}

/** What a call did, for the trace. */
function summary(op: string, args: unknown[], result: unknown, error: unknown): string {
  const a0 = args[0];
  const id = typeof a0 === "string" ? a0 : (a0 as { id?: string; key?: string } | undefined)?.id ??
    (a0 as { key?: string } | undefined)?.key;
  const token = typeof args[1] === "number" ? ` t${args[1]}` : "";
  const head = `${op}${id !== undefined ? ` ${id}` : ""}${token}`;
  if (error !== undefined) return `${head} -> ${show(error)}`;
  if (op === "inbox.claimDue") return `${head} -> [${(result as InboundRecord[]).map((r) => `${r.id} t${r.fence}`).join(", ")}]`;
  if (op === "outbox.claimDue") {
    const { due, ambiguous } = result as OutboxClaim;
    return `${head} -> due [${due.map((e) => `${e.key} t${e.fence}`).join(", ")}] ambiguous [${
      ambiguous.map((e) => e.key).join(", ")
    }]`;
  }
  if (op === "outbox.reserve") {
    const r = result as ReserveResult;
    return `${head} -> ${r.status} ${r.entry.state} t${r.entry.fence} seq${r.entry.seq}`;
  }
  if (op === "inbox.admit" || op === "inbox.claim") {
    const r = result as InboundRecord | null;
    return `${head} -> ${r ? `${r.state} t${r.fence}` : "null"}`;
  }
  return `${head} -> ${show(result)}`;
}

/**
 * The fault-injecting backend of one incarnation.
 * @param world the run
 * @param inc the incarnation it belongs to
 * @param inner the shared backend
 * @param resendAmbiguous whether the bots run with `onAmbiguous: 'resend'`
 * @returns the wrapper
 */
export function faultyBackend(
  world: World,
  inc: Incarnation,
  inner: DurabilityBackend,
  resendAmbiguous: boolean,
): DurabilityBackend {
  const ledger = world.ledger;

  /** Feeds the ledger with a call's real effect; returns what to do once the reply reaches the engine. */
  const observe = (op: string, args: unknown[], result: unknown, error: unknown): ((lostBy: LostBy) => void) => {
    const now = world.sched.time;
    const grants: { delivered: boolean; lostBy: LostBy; pending?: boolean }[] = [];
    const leaseMs = (op === "inbox.claimDue" || op === "outbox.claimDue" ? args[0] : args[1]) as ClaimOptions | undefined;
    const grant = (): LeaseGrant => {
      const g: LeaseGrant = { inc: inc.id, time: now, delivered: true, lostBy: null, pending: true, expires: now + (leaseMs?.leaseMs ?? 0) };
      grants.push(g);
      return g;
    };
    let onDelivered: (() => void) | null = null;
    const staleCheck = (kind: "inbox" | "outbox", id: string, token: number) => {
      if (!(error instanceof StaleLeaseError)) return;
      // Not genuine when the caller's own outcome write for this token already committed (a lost reply).
      const genuine = kind === "inbox" ? !ledger.isInRecorded(id, token) : !ledger.isOutRecorded(id, token);
      onDelivered = () => ledger.stale.push({ kind, id, token, time: world.sched.time, inc: inc.id, genuine });
    };
    const selfSteal = (kind: "inbox" | "outbox", id: string, token: number, how = `claimed ${kind} ${id} (token ${token}) away from`) => {
      const prev = token - 1;
      const g = kind === "inbox" ? ledger.inLease(id, prev) : ledger.outLease(id, prev);
      const closed = kind === "inbox" ? ledger.isInClosed(id, prev) : ledger.isOutClosed(id, prev);
      // Its own lease, not ended, and in true time not lapsed yet (heartbeats extend it): only a
      // server clock step makes the backend see it lapsed. A lease that really lapsed (a long
      // delay, a stall, failed heartbeats) is claimable by anyone, its holder too.
      if (g && g.inc === inc.id && !closed && inc.alive && now < g.expires) {
        // Only a server clock step makes a backend re-lease a live lease to its own holder; the engine
        // must carry on with the work under the new token. Counted here; what it must not do (run the
        // handler again, report or call again) is checked by double-handling, self-reported and the rest.
        world.count("self-steal");
        world.log(inc.id, `note: ${how} its own live lease (token ${prev}, good until ${
          ((g.expires - SIM_EPOCH) / 1000).toFixed(3)
        }s in true time); server clock offset ${world.serverOffset}ms`);
      }
    };
    const isRepeat = (op === "inbox.claimDue" || op === "outbox.claimDue") && (args[0] as { repeat?: boolean } | undefined)?.repeat === true;
    if (error === undefined && isRepeat) {
      // A repeat changes nothing: it delivers the grants and transitions of the scan it asks about, it makes none.
      world.count(op === "inbox.claimDue" ? "repeat-in" : "repeat-out");
      if (op === "inbox.claimDue") {
        for (const r of result as InboundRecord[]) {
          const g = ledger.inLease(r.id, r.fence);
          if (g) grants.push(g);
          else world.count("repeat-unknown-grant");
        }
      } else {
        const { due, ambiguous } = result as OutboxClaim;
        if (ambiguous.length > 0) world.count("repeat-out-ambiguous");
        for (const e of ambiguous) {
          const token = resendAmbiguous ? e.fence - 1 : e.fence;
          const a = [...ledger.ambiguities].reverse().find((x) => x.key === e.key && x.token === token);
          if (a) grants.push(a);
          else world.count("repeat-unknown-ambiguity");
        }
        for (const e of due) {
          const g = ledger.outLease(e.key, e.fence);
          if (g) grants.push(g);
          else world.count("repeat-unknown-grant");
        }
      }
    } else if (error === undefined) {
      switch (op) {
        case "inbox.admit": {
          const r = result as InboundRecord | null;
          if (r && args[1] !== undefined) ledger.grantIn(r.id, r.fence, grant());
          if (r && !ledger.admissions.has(r.id)) {
            const timerAt = timerAtOf(r.payload);
            const admission: AdmissionRecord = {
              id: r.id,
              chatId: r.chatId,
              commit: ledger.admissions.size,
              time: now,
              receivedAt: r.receivedAt,
              inc: inc.id,
              ...(timerAt !== undefined ? { timerAt } : {}),
              delivered: true,
              lostBy: null,
            };
            ledger.admissions.set(r.id, admission);
            grants.push(admission);
          }
          break;
        }
        case "inbox.claim":
        case "inbox.claimDue": {
          const records = op === "inbox.claim" ? (result ? [result as InboundRecord] : []) : result as InboundRecord[];
          for (const r of records) {
            selfSteal("inbox", r.id, r.fence);
            ledger.grantIn(r.id, r.fence, grant());
          }
          break;
        }
        case "inbox.heartbeat":
        case "outbox.heartbeat":
        case "outbox.markCalling": {
          if (op === "outbox.markCalling" && result === true) {
            const rec = { inc: inc.id, time: now, delivered: true, lostBy: null as LostBy, pending: true };
            ledger.announced.set(`${args[0] as string}#${args[1] as number}`, rec);
            grants.push(rec);
          }
          const g = op === "inbox.heartbeat"
            ? ledger.inLease(args[0] as string, args[1] as number)
            : ledger.outLease(args[0] as string, args[1] as number);
          if (result === true && g) g.expires = now + (args[2] as number);
          if (g && g.inc === inc.id) g.delivered = true; // it knows the lease (learned it some other way)
          break;
        }
        case "inbox.complete":
          ledger.closeIn(args[0] as string, args[1] as number, true);
          break;
        case "inbox.fail": {
          const [id, token, outcome] = args as [string, number, FailOutcome];
          ledger.closeIn(id, token, true);
          if (outcome.dead) {
            const rec = { id, token, delivered: true, lostBy: null as LostBy, error: outcome.error, inc: inc.id, time: now };
            ledger.inDead.push(rec);
            grants.push(rec);
          }
          break;
        }
        case "inbox.replay":
          if (result === true) ledger.bump(ledger.operatorReplayed, args[0] as string);
          break;
        case "outbox.reserve": {
          const r = result as ReserveResult;
          if (r.status === "exists") break;
          const e = r.entry;
          ledger.newGeneration(e.key);
          const seqs = ledger.seqs.get(e.key) ?? [];
          seqs.push(e.seq);
          ledger.seqs.set(e.key, seqs);
          ledger.chatOf.set(e.key, e.chatId);
          const step = stepOf(e);
          if (step !== undefined) ledger.stepOfAttempt.set(e.key, step.key);
          if (r.status === "leased") {
            ledger.grantOut(e.key, e.fence, grant());
            if (e.called) {
              // Reserved with its call announced (a send that goes out at once): as a markCalling under its lease.
              const rec = { inc: inc.id, time: now, delivered: true, lostBy: null as LostBy, pending: true };
              ledger.announced.set(`${e.key}#${e.fence}`, rec);
              grants.push(rec);
            }
            ledger.claimTokens.set(`${inc.id}|${e.key}|${e.attempts}`, e.fence);
            // The attempt the step's function runs under, if this process goes on to call it.
            if (step !== undefined) ledger.stepHeld.set(`${inc.id}|${step.key}`, { attempt: e.key, token: e.fence });
          }
          break;
        }
        case "outbox.claimDue": {
          const { due, ambiguous } = result as OutboxClaim;
          const resent = new Set<string>();
          for (const e of ambiguous) {
            const token = resendAmbiguous ? e.fence - 1 : e.fence;
            selfSteal("outbox", e.key, token + 1, resendAmbiguous ? undefined : `made outbox ${e.key} unknown, taking`);
            if (resendAmbiguous) resent.add(e.key);
            const g = ledger.outLease(e.key, token);
            // A call its holder started under an earlier token and that was still under way when this
            // lease was granted to the same process (a re-lease handed on to the work) counts as its call.
            const handedOn = g
              ? ledger.calls.filter((c) =>
                c.key === e.key && c.inc === g.inc && c.start <= g.time && (c.end === null || c.end >= g.time) &&
                (c.token ?? 0) < token
              )
              : [];
            // A step's attempt: its "call" is a call of the step's function at the fake service.
            const stepCalls = ledger.stepCallsOf(e.key, token);
            const calls = [...ledger.callsOf(e.key, token), ...handedOn, ...stepCalls];
            let verdict: AmbiguityRecord["verdict"];
            let detail: string;
            if (calls.length > 0) {
              verdict = "call";
              detail = `a call under token ${token} started at ${
                ((calls[0]!.start - SIM_EPOCH) / 1000).toFixed(3)
              }s by ${calls[0]!.inc}`;
            } else if (
              resendAmbiguous && ledger.ambiguities.some((a) =>
                a.key === e.key && a.token === token - 1 && (a.verdict === "call" || a.verdict === "announced" || a.verdict === "inherited-call")
              )
            ) {
              // Its lease re-sent an ambiguous call (resendAmbiguous), which may still reach the channel: the
              // entry stays marked called, so losing this lease before its own call is ambiguous again.
              verdict = "inherited-call";
              detail = `no call under token ${token}, but it re-sent token ${token - 1}'s ambiguous call, which may still reach the channel`;
            } else if (ledger.announced.has(`${e.key}#${token}`)) {
              // Announced, not called: excused only where the holder could not call in time: it died,
              // was stalled, or had not had (or lost) the announcement's answer.
              const a = ledger.announced.get(`${e.key}#${token}`)!;
              const holder = world.replicas.find((r) => a.inc.startsWith(`${r.name}#`));
              const why = ledger.isDead(a.inc)
                ? "died"
                : a.pending
                ? "was still waiting for the announcement's answer"
                : !a.delivered
                ? `lost the announcement's answer (${a.lostBy})`
                : holder && world.wasFrozen(holder, a.time, now)
                ? "was stalled"
                : null;
              verdict = why === null ? "announced-not-called" : "announced";
              detail = `no call under token ${token}, but ${a.inc} had announced one (markCalling) at ${
                ((a.time - SIM_EPOCH) / 1000).toFixed(3)
              }s and ${why ?? "was alive, not stalled and had its answer: it never called"}`;
            } else if (g && ledger.isDead(g.inc)) {
              verdict = "crash-before-call";
              detail = `holder ${g.inc} died before calling the provider`;
            } else {
              const holder = g ? world.replicas.find((r) => g.inc.startsWith(`${r.name}#`)) : undefined;
              verdict = !g || !g.delivered
                ? "lost-grant"
                : g.pending || (holder && world.wasFrozen(holder, g.time, now))
                ? "stalled-before-call"
                : "held";
              detail = g
                ? `holder ${g.inc} is alive and never called the provider under token ${token}${
                  !g.delivered
                    ? " (the grant's reply was lost: it never knew it held the lease)"
                    : g.pending
                    ? " [the grant's reply was still on its way: delayed past the lease]"
                    : holder && world.wasFrozen(holder, g.time, now)
                    ? " [holder was stalled]"
                    : " (it got the lease and kept it without calling: queued behind another send of the chat, or its claim's reply came late)"
                }`
                : `no grant of token ${token} seen`;
            }
            const closedBefore = ledger.isOutClosed(e.key, token);
            ledger.ambiguities.push({
              key: e.key,
              chatId: e.chatId,
              token,
              time: now,
              by: inc.id,
              delivered: true,
              lostBy: null,
              verdict,
              detail,
              // Its own live lease (only a server clock step makes it look lapsed): the process must carry on.
              // (A grant whose reply had not reached it yet is the delayed-grant case, counted with the others.)
              selfSteal: g !== undefined && g.inc === inc.id && g.delivered && !g.pending && !closedBefore && inc.alive &&
                now < g.expires,
            });
            grants.push(ledger.ambiguities[ledger.ambiguities.length - 1]!);
            ledger.closeOut(e.key, token);
          }
          for (const e of due) {
            if (!resent.has(e.key)) selfSteal("outbox", e.key, e.fence);
            ledger.grantOut(e.key, e.fence, grant());
            ledger.claimTokens.set(`${inc.id}|${e.key}|${e.attempts}`, e.fence);
            // A step attempt this process holds, re-leased to it (its lease only looked lapsed): the engine
            // hands the new token on to the step under way, whose call then runs under it.
            const step = stepOf(e);
            const held = step === undefined ? undefined : ledger.stepHeld.get(`${inc.id}|${step.key}`);
            if (held !== undefined && held.attempt === e.key && e.fence > held.token) held.token = e.fence;
          }
          break;
        }
        case "outbox.markSent":
          ledger.closeOut(args[0] as string, args[1] as number, true);
          if (ledger.stepOfAttempt.has(args[0] as string)) {
            ledger.stepSettled.push({ attempt: args[0] as string, token: args[1] as number, messageId: args[2] as string, inc: inc.id, time: now });
          }
          break;
        case "outbox.markFailed": {
          const [key, token, outcome] = args as [string, number, FailOutcome];
          ledger.closeOut(key, token, true);
          if (outcome.dead) {
            const rec = { key, token, delivered: true, lostBy: null as LostBy, error: outcome.error, inc: inc.id, time: now };
            ledger.outDead.push(rec);
            grants.push(rec);
          }
          if ("ambiguous" in outcome && outcome.ambiguous === true) {
            // The caller's provider call may have reached the channel (a timeout): unknown, by its own word.
            ledger.ambiguities.push({
              key,
              chatId: ledger.chatOf.get(key) ?? "",
              token,
              time: now,
              by: inc.id,
              delivered: true,
              lostBy: null,
              verdict: "call",
              detail: `${inc.id} recorded its provider call as ambiguous: ${outcome.error}`,
            });
            grants.push(ledger.ambiguities[ledger.ambiguities.length - 1]!);
          }
          break;
        }
        case "outbox.retry":
          if (result === true) ledger.bump(ledger.operatorRetried, args[0] as string);
          break;
        case "outbox.discard":
          if (result === true) ledger.bump(ledger.operatorDiscarded, args[0] as string);
          break;
      }
    } else {
      switch (op) {
        case "inbox.complete":
        case "inbox.fail":
          staleCheck("inbox", args[0] as string, args[1] as number);
          break;
        case "outbox.markSent":
        case "outbox.markFailed":
          staleCheck("outbox", args[0] as string, args[1] as number);
          break;
      }
    }
    return (lostBy: LostBy) => {
      for (const g of grants) {
        g.delivered = lostBy === null;
        g.lostBy = lostBy;
        if (g.pending !== undefined) g.pending = false;
      }
      if (lostBy === null) (onDelivered as (() => void) | null)?.();
    };
  };

  const call = async (op: string, method: string, target: object, args: unknown[]): Promise<unknown> => {
    if (!inc.alive) throw world.death();
    if (op === "outbox.markSent" || op === "outbox.markFailed") {
      const id = `${args[0] as string}#${args[1] as number}`;
      if (!ledger.outcomeStarted.has(id)) ledger.outcomeStarted.set(id, world.sched.time);
    }
    const fault = pickFault(world);
    const quiet = QUIET.has(method);
    if (fault.kind !== "none") {
      world.count(fault.kind === "delay" && Math.max(fault.before, fault.after) >= world.leaseMs ? "delay(>lease)" : fault.kind);
      if (fault.kind === "delay" && Math.max(fault.before, fault.after) >= world.leaseMs / 2) world.leaseThreats++;
      if (fault.kind === "error-before" && method === "heartbeat") world.leaseThreats++;
      world.log(inc.id, `fault ${faultName(fault)} at ${op}`);
    }
    if (fault.kind === "error-before") throw new ConnectionRefused(op);
    if (fault.kind === "crash" && fault.when === "before") {
      world.crashes++;
      world.crash(inc, `before ${op}`);
      throw world.death();
    }
    if (fault.kind === "delay" && fault.before > 0) {
      await world.sched.sleep(fault.before);
      if (!inc.alive) throw world.death(); // a dead process sends nothing
    }
    let result: unknown;
    let error: unknown;
    try {
      result = await (target as Record<string, (...a: unknown[]) => Promise<unknown>>)[method]!.apply(target, args.map(asStored));
    } catch (e) {
      error = e ?? new Error("undefined rejection");
    }
    const deliver = observe(op, args, result, error);
    const empty = error === undefined && (op === "inbox.claimDue" ? (result as unknown[]).length === 0
      : op === "outbox.claimDue" && (result as OutboxClaim).due.length + (result as OutboxClaim).ambiguous.length === 0);
    if (world.verbose || (!quiet && !empty) || fault.kind !== "none" || error !== undefined) world.log(inc.id, summary(op, args, result, error));
    if (fault.kind === "lost-reply") {
      deliver("lost-reply");
      throw new ConnectionReset(op);
    }
    if (fault.kind === "crash" && fault.when === "after") {
      deliver("crash");
      if (inc.alive) {
        world.crashes++;
        world.crash(inc, `after ${op}`);
      }
      throw world.death();
    }
    if (fault.kind === "delay" && fault.after > 0) await world.sched.sleep(fault.after);
    if (op === "inbox.claimDue" && world.claimLagMs > 0) await world.sched.sleep(world.claimLagMs);
    await world.thaw(inc.replica);
    if (!inc.alive) {
      deliver("crash");
      throw world.death();
    }
    deliver(null);
    if (error !== undefined) throw error;
    return result;
  };

  const wrap = <J extends object>(name: "inbox" | "outbox", journal: J, methods: readonly string[]): J => {
    const wrapped: Record<string, unknown> = {};
    for (const method of methods) {
      wrapped[method] = (...args: unknown[]) => call(`${name}.${method}`, method, journal, args);
    }
    return wrapped as J;
  };

  const inbox = wrap<InboxJournal>("inbox", inner.inbox, INBOX_JOURNAL_METHODS);
  const outbox = wrap<OutboxJournal>("outbox", inner.outbox, OUTBOX_JOURNAL_METHODS);
  return {
    name: `sim(${inner.name})`,
    scope: inner.scope,
    inbox,
    outbox,
    open: async () => {
      if (!inc.alive) throw world.death();
    },
    close: async () => {
      if (!inc.alive) throw world.death();
    },
  };
}

/**
 * The deadline of a timer record (`DurabilityEngine.scheduleTimer` journals it with its payload's
 * `$timer.at`, wall-clock ms of the arming process), or `undefined` for a message.
 */
export function timerAtOf(payload: unknown): number | undefined {
  if (typeof payload !== "object" || payload === null || Array.isArray(payload)) return undefined;
  const timer = (payload as Record<string, unknown>)["$timer"] as { at?: unknown } | undefined;
  return typeof timer === "object" && timer !== null && typeof timer.at === "number" ? timer.at : undefined;
}

/** For type users: the claim options of a lease. */
export type { ClaimOptions, OutboxEntry };

const utf8 = { encoder: new TextEncoder(), decoder: new TextDecoder() };
/** A string as a database stores it: through UTF-8, where a lone surrogate becomes U+FFFD. */
function lossy(text: string): string {
  return utf8.decoder.decode(utf8.encoder.encode(text));
}
/**
 * An argument as a SQL or Redis backend would store its ids (keys, ids, chat ids): the memory backend
 * keeps any JavaScript string, so the sim makes it forget lone surrogates the way those backends do.
 */
function asStored(arg: unknown): unknown {
  if (typeof arg === "string") return lossy(arg);
  if (typeof arg !== "object" || arg === null || Array.isArray(arg)) return arg;
  const copy: Record<string, unknown> = { ...(arg as Record<string, unknown>) };
  for (const field of ["id", "chatId", "key", "inboundId"]) {
    if (typeof copy[field] === "string") copy[field] = lossy(copy[field] as string);
  }
  return copy;
}
