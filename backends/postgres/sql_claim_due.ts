/**
 * The due scans of the Postgres backend (inbox and outbox `claimDue`), each
 * a statement assembled from named parts ({@link SqlPart}) that can be read,
 * and run, alone.
 *
 * @module
 */
import { OUTBOX, sqlIn, statesDueBy } from "../../src/machine.ts";
import { ACTIVE, asideRead, BLOCKING, chatTouchedAt, CLAIM_SET, IN_LEASED, INBOX_COLUMNS, inboxClaimable, KEPT, nextChatVersion, NOW, NOW_PART, OUT_CLAIM_SET, OUT_WAITING, OUTBOX_COLUMNS, type SqlPart, type Tables, withParts } from "./sql_common.ts";
/** What the parts of inbox claimDue are built for: the tables and reclaimOwn. */
interface InboxScan {
  t: Tables;
  reclaim: boolean;
}

/** holdsChat of rules.ts for the record `b` (an alias): a live lease (only a processing record has one) neither the caller's nor one it may take. */
const heldElsewhere = (b: string, reclaim: boolean) =>
  `${b}.lease_expires_at > ${NOW} AND (${b}.lease_owner IS DISTINCT FROM $1${
    reclaim ? "" : ` OR ${b}.lease_incarnation IS DISTINCT FROM $2`
  })`;

/**
 * `g`: the holders of leases, each (owner, incarnation) of a `processing` record once, found by a loose scan of
 * the lease index (one probe per holder). The chat-order checks go by holder, each an index range of one
 * holder's records in one chat: the leases the caller itself holds are never read in them. A record with a
 * partial lease (an owner without an incarnation) is damaged, and holds nothing back.
 */
function holders({ t }: InboxScan): SqlPart {
  const leased = (alias: string) => `${sqlIn(`${alias}.state`, IN_LEASED)} AND ${alias}.lease_owner IS NOT NULL AND ${alias}.lease_incarnation IS NOT NULL`;
  return {
    name: "g",
    reads: [],
    rows: "owner, inc",
    materialized: true,
    text: `WITH RECURSIVE h(owner, inc) AS (
        (SELECT a.lease_owner, a.lease_incarnation FROM ${t.inbox} a WHERE ${leased("a")}
          ORDER BY a.lease_owner, a.lease_incarnation LIMIT 1)
        UNION ALL
        SELECT x.lease_owner, x.lease_incarnation FROM h CROSS JOIN LATERAL (
          SELECT a.lease_owner, a.lease_incarnation FROM ${t.inbox} a
          WHERE ${leased("a")} AND (a.lease_owner, a.lease_incarnation) > (h.owner, h.inc)
          ORDER BY a.lease_owner, a.lease_incarnation LIMIT 1) x
      )
      SELECT h.owner, h.inc FROM h`,
  };
}

/** Whether holder `g` holds its leases elsewhere than the caller: another owner, or (without reclaimOwn) another incarnation. */
const elsewhere = (g: string, reclaim: boolean) => reclaim ? `${g}.owner <> $1` : `(${g}.owner <> $1 OR ${g}.inc <> $2)`;

/**
 * That no earlier record of the chat of `i` is held elsewhere in the snapshot (holdsChat of rules.ts: a live
 * lease neither the caller's nor one it may take), so a chat held elsewhere does not fill the batch. Per holder
 * held elsewhere, a probe of its records of that chat (the holder index): the caller's own are not read.
 */
const chatFree = ({ t, reclaim }: InboxScan) =>
  `NOT EXISTS (
        SELECT 1 FROM g CROSS JOIN LATERAL (
          SELECT 1 FROM ${t.inbox} b
          WHERE b.chat_id = i.chat_id AND b.state IN (${ACTIVE}) AND ${sqlIn("b.state", IN_LEASED)} AND b.lease_owner = g.owner
            AND b.lease_incarnation = g.inc AND b.${KEPT} AND (b.received_at, b.ord) < (i.received_at, i.ord)
            AND b.lease_expires_at > ${NOW} LIMIT 1) b
        WHERE ${elsewhere("g", reclaim)})`;

/** The columns of a branch (`p0`, `p1`, `p2`). */
const BRANCH_COLUMNS = "i.ord, i.chat_id, i.received_at";

/** `p0`: the pending records (due at 0) whose chat is free, oldest first from the due index, $4, locked. */
function pendingDue(s: InboxScan): SqlPart {
  return {
    name: "p0",
    reads: ["n", "g"],
    rows: "ord, chat_id, received_at",
    text: `SELECT ${BRANCH_COLUMNS} FROM ${s.t.inbox} i WHERE i.due_at = 0 AND i.${KEPT} AND ${chatFree(s)}
      ORDER BY i.received_at, i.ord LIMIT $4 FOR UPDATE OF i SKIP LOCKED`,
  };
}

/**
 * `p1`: the records due at a time that has come (retries, timers, lapsed leases) whose chat is free, by a range
 * of the due index, $4, locked. It sorts by expressions (`+ 0`) so that the planner reads the due range rather
 * than walk the receipt index in order (its estimate of that range is poor).
 */
function timedDue(s: InboxScan): SqlPart {
  return {
    name: "p1",
    reads: ["n", "g"],
    rows: "ord, chat_id, received_at",
    text: `SELECT ${BRANCH_COLUMNS} FROM ${s.t.inbox} i WHERE i.due_at > 0 AND i.due_at <= ${NOW} AND i.${KEPT} AND ${chatFree(s)}
      ORDER BY i.received_at + 0, i.ord LIMIT $4 FOR UPDATE OF i SKIP LOCKED`,
  };
}

/**
 * `p2` (reclaimOwn): the records leased by the owner's other incarnations whose chat is free: of each such
 * incarnation (`g`), its oldest $4 by the lease index, locked. A restart's reclaim reads O($4) records per
 * scan, never the ones it took back before.
 */
function otherIncarnations(s: InboxScan): SqlPart {
  return {
    name: "p2",
    reads: ["n", "g"],
    rows: "ord, chat_id, received_at",
    text: `SELECT o.ord, o.chat_id, o.received_at FROM g CROSS JOIN LATERAL (
        SELECT ${BRANCH_COLUMNS} FROM ${s.t.inbox} i
        WHERE i.lease_owner = g.owner AND i.lease_incarnation = g.inc AND ${sqlIn("i.state", IN_LEASED)} AND i.${KEPT} AND ${chatFree(s)}
        ORDER BY i.received_at, i.ord LIMIT $4 FOR UPDATE OF i SKIP LOCKED) o
      WHERE g.owner = $1 AND g.inc <> $2`,
  };
}

/** `pick`: the oldest $4 of the branches. */
function picked({ reclaim }: InboxScan): SqlPart {
  return {
    name: "pick",
    reads: reclaim ? ["p0", "p1", "p2"] : ["p0", "p1"],
    rows: "ord, chat_id, received_at",
    text: `SELECT u.ord, u.chat_id, u.received_at FROM (SELECT * FROM p0 UNION SELECT * FROM p1${reclaim ? " UNION SELECT * FROM p2" : ""}) u
      ORDER BY u.received_at, u.ord LIMIT $4`,
  };
}

/** `c`: the pick, materialized (several parts read it). */
const PICK_KEPT: SqlPart = {
  name: "c",
  reads: ["pick"],
  rows: "chat_id, received_at, ord",
  materialized: true,
  text: "SELECT pick.chat_id, pick.received_at, pick.ord FROM pick",
};

/**
 * `soon`: the caller's own leases that lapse within half of its lease length ($3), by the due index (a
 * `processing` record is due at its lease's expiry). Normally none: heartbeats extend them long before.
 */
function ownLapsingSoon({ t }: InboxScan): SqlPart {
  return {
    name: "soon",
    reads: ["n"],
    rows: "ord, chat_id, received_at",
    materialized: true,
    text: `SELECT e.ord, e.chat_id, e.received_at FROM ${t.inbox} e
      WHERE e.due_at > 0 AND e.due_at <= ${NOW} + $3::bigint / 2 AND ${sqlIn("e.state", IN_LEASED)} AND e.lease_owner = $1
        AND e.lease_incarnation = $2 AND e.lease_expires_at <= ${NOW} + $3::bigint / 2 AND e.${KEPT}`,
  };
}

/**
 * `seen`: per chat of the pick, its other active records up to its last picked one (in the snapshot), but those
 * the caller itself holds with at least half of its lease length ($3) left. Such a record neither holds the
 * chat nor is claimable, and no other owner can take it before its lease lapses, which is longer than this
 * statement runs: locking it tells nothing. (A next incarnation of the owner, under reclaimOwn, may take it
 * at any time, but then takes the caller's later records too, and fencing settles the rest.) They are read
 * by holder from the holder index: the chat's unleased records, the records of each holder but the caller,
 * and the caller's own from `soon`; what the caller holds is never read, so a scan's work is what it may
 * take, not everything the caller already holds (a restart's backlog made each scan read, and lock, every
 * record taken by the scans before it). OFFSET 0 keeps each holder's read a probe of its own range (not a
 * join of the chat's active records, the caller's among them, with the holders).
 */
function earlierSeen({ t }: InboxScan): SqlPart {
  const upTo = (e: string) => `(${e}.received_at, ${e}.ord) <= (l.received_at, l.ord)`;
  return {
    name: "seen",
    reads: ["c", "g", "soon"],
    rows: "ord, chat_id, received_at",
    materialized: true,
    text: `SELECT s.ord, s.chat_id, s.received_at
      FROM (SELECT DISTINCT ON (c.chat_id) c.chat_id, c.received_at, c.ord FROM c ORDER BY c.chat_id, c.received_at DESC, c.ord DESC) l
      CROSS JOIN LATERAL (
        SELECT e.ord, e.chat_id, e.received_at FROM ${t.inbox} e
        WHERE e.chat_id = l.chat_id AND e.state IN (${ACTIVE}) AND e.lease_owner IS NULL AND e.lease_incarnation IS NULL AND e.${KEPT}
          AND ${upTo("e")}
        UNION ALL
        SELECT e.ord, e.chat_id, e.received_at FROM g CROSS JOIN LATERAL (
          SELECT e.ord, e.chat_id, e.received_at FROM ${t.inbox} e
          WHERE e.chat_id = l.chat_id AND e.state IN (${ACTIVE}) AND e.lease_owner = g.owner AND e.lease_incarnation = g.inc
            AND e.${KEPT} AND ${upTo("e")} OFFSET 0) e
        WHERE g.owner <> $1 OR g.inc <> $2
        UNION ALL
        SELECT o.ord, o.chat_id, o.received_at FROM soon o WHERE o.chat_id = l.chat_id AND ${upTo("o")}
      ) s
      WHERE s.ord NOT IN (SELECT ord FROM c)`,
  };
}

/**
 * `locked`: the records of `seen` locked FOR KEY SHARE SKIP LOCKED, which reads their latest version; it waits
 * for nothing and does not hold up a heartbeat or a completion.
 */
function earlierLocked({ t }: InboxScan): SqlPart {
  return {
    name: "locked",
    reads: ["seen"],
    rows: "ord, chat_id, received_at and what holdsChat and the claimable check read",
    materialized: true,
    text: `SELECT k.ord, k.chat_id, k.received_at, k.state, k.next_attempt_at, k.lease_owner, k.lease_incarnation, k.lease_expires_at,
        k.set_aside_seq
      FROM ${t.inbox} k WHERE k.ord = ANY(ARRAY(SELECT ord FROM seen))
      FOR KEY SHARE OF k SKIP LOCKED`,
  };
}

/**
 * `bad`: the records of `seen` that keep the later picks of their chat from being taken: held elsewhere (latest
 * version), claimable but not picked (another scan may be taking it), or not locked (another scan has it locked).
 */
function earlierBlocking({ reclaim }: InboxScan): SqlPart {
  return {
    name: "bad",
    reads: ["locked", "seen", "n"],
    rows: "chat_id, received_at, ord",
    text: `SELECT k.chat_id, k.received_at, k.ord FROM locked k WHERE k.${KEPT} AND ((${heldElsewhere("k", reclaim)}) OR ${
      inboxClaimable(reclaim, "k.", NOW)
    })
      UNION ALL
      SELECT s.chat_id, s.received_at, s.ord FROM seen s WHERE s.ord NOT IN (SELECT ord FROM locked)`,
  };
}

/** `take`: the picks with no `bad` record before them in their chat. */
const TAKEN: SqlPart = {
  name: "take",
  reads: ["c", "bad"],
  rows: "ord",
  text: `SELECT c.ord FROM c WHERE NOT EXISTS (
        SELECT 1 FROM bad WHERE bad.chat_id = c.chat_id AND (bad.received_at, bad.ord) < (c.received_at, c.ord))`,
};

/**
 * The parts of inbox claimDue, in statement order. Due records in arrival order, in LIMITed branches that each
 * read an index in order (so a backlog of settled rows, or a long pending queue, is never walked): `p0`, `p1`
 * and with reclaimOwn `p2`. Each branch locks what it reads (FOR UPDATE SKIP LOCKED: concurrent claimers take
 * disjoint sets) and leaves out a record that an earlier one of its chat holds back in the statement's snapshot;
 * `pick` keeps the oldest $4 of them. The branches' other rows (at most 2 × $4) stay locked until the statement
 * ends, then are free.
 *
 * Chat order (holdsChat of rules.ts) is then checked on the latest row versions, which the snapshot may not
 * hold: a concurrent scan may have leased an earlier record of the chat and committed, or be leasing it now.
 * A picked record is taken only when no earlier record of its chat (`seen`, `locked`) is `bad`. The picked
 * records themselves are locked by their branch, which rechecked them on their latest version. So of two
 * concurrent scans that pick from one chat, the one whose picks come later in the chat finds the other's
 * earlier picks locked, or leased elsewhere once the other committed, or still claimable, and leaves the rest
 * of the chat to a later scan.
 */
export function inboxClaimDueParts(t: Tables, reclaim: boolean): SqlPart[] {
  const s: InboxScan = { t, reclaim };
  const branches = reclaim ? [pendingDue(s), timedDue(s), otherIncarnations(s)] : [pendingDue(s), timedDue(s)];
  return [NOW_PART, holders(s), ...branches, picked(s), PICK_KEPT, ownLapsingSoon(s), earlierSeen(s), earlierLocked(s), earlierBlocking(s), TAKEN];
}

/** Inbox claimDue: its parts, then the UPDATE that leases what is taken, the claimable check repeated. */
export function inboxClaimDueSql(t: Tables, reclaim: boolean): string {
  return withParts(
    inboxClaimDueParts(t, reclaim),
    `UPDATE ${t.inbox} AS r SET ${CLAIM_SET} FROM n
    WHERE r.ord = ANY(ARRAY(SELECT ord FROM take)) AND ${inboxClaimable(reclaim, "r.")} AND r.${KEPT}
    RETURNING ${INBOX_COLUMNS.split(", ").map((c) => `r.${c}`).join(", ")}, ${asideRead("r")}`,
  );
}

/** What the parts of outbox claimDue are built for: the tables, reclaimOwn and resendAmbiguous. */
interface OutboxScan {
  t: Tables;
  reclaim: boolean;
  resend: boolean;
}

/** The outbox columns of the row alias `alias`. */
const outboxColumnsOf = (alias: string) => OUTBOX_COLUMNS.split(", ").map((c) => `${alias}.${c}`).join(", ");

/**
 * `lost0`: the abandoned `sending` entries (lease lapsed: a sending entry's due mark is its lease's expiry;
 * or, under reclaimOwn, leased by the owner's other incarnations), locked, with whether their call was never
 * announced (`uncalled`; read from the locked, latest row version, so a markCalling that committed first
 * makes it called). With resend all of them are leased again, so at most $4.
 */
function abandonedSends({ t, reclaim, resend }: OutboxScan): SqlPart {
  return {
    name: "lost0",
    reads: ["n"],
    rows: "seq, chat_id, uncalled",
    text: `SELECT o.seq, o.chat_id, coalesce(o.uncalled_fence = o.fence, false) AS uncalled FROM ${t.outbox} o
      WHERE ${sqlIn("o.state", statesDueBy(OUTBOX, "leaseExpiry"))} AND o.${KEPT} AND (o.due_at <= ${NOW}${
      reclaim ? ` OR (o.lease_owner = $1 AND o.lease_incarnation <> $2)` : ""
    })
      ORDER BY o.seq${resend ? " LIMIT $4" : ""}
      FOR UPDATE OF o SKIP LOCKED`,
  };
}

/** `lost` with resend: every abandoned entry is leased again (the uncalled ones reported as due only). */
const ALL_ABANDONED: SqlPart = { name: "lost", reads: ["lost0"], rows: "seq, uncalled", text: "SELECT l.seq, l.uncalled FROM lost0 l" };

/** `called` (without resend): the abandoned entries whose call was announced, so whose outcome is ambiguous. */
const CALLED_ABANDONED: SqlPart = {
  name: "called",
  reads: ["lost0"],
  rows: "seq, chat_id",
  text: "SELECT l.seq, l.chat_id FROM lost0 l WHERE NOT l.uncalled",
};

/**
 * `lc`: the chat rows of the called entries, locked (SKIP LOCKED: a called entry whose chat row another
 * statement holds is left to a later scan). Moving an entry to `unknown` changes which entries block its chat.
 */
function calledChatsLocked({ t }: OutboxScan): SqlPart {
  return {
    name: "lc",
    reads: ["called"],
    rows: "chat_id",
    text: `SELECT c.chat_id FROM ${t.chat} c WHERE c.chat_id IN (SELECT chat_id FROM called)
      FOR UPDATE OF c SKIP LOCKED`,
  };
}

/**
 * `lcu`: the locked chat rows stamped with a new version, `resync` set when the locked version is not the
 * snapshot's; `current` when it is (the snapshot holds the chat's blocking entries).
 */
function calledChatsStamped({ t }: OutboxScan): SqlPart {
  return {
    name: "lcu",
    reads: ["lc", "n"],
    rows: "chat_id, current",
    text: `UPDATE ${t.chat} AS c SET ver = ${nextChatVersion(t)}, prev = c.ver, touched_at = ${chatTouchedAt("c", "n.now")},
        resync = c.resync OR c.ver IS DISTINCT FROM (SELECT s.ver FROM ${t.chat} s WHERE s.chat_id = c.chat_id)
      FROM lc, n WHERE c.chat_id = lc.chat_id
      RETURNING c.chat_id, c.prev IS NOT DISTINCT FROM (SELECT s.ver FROM ${t.chat} s WHERE s.chat_id = c.chat_id) AS current`,
  };
}

/** `lnh`: the next head of each current chat of `lcu` (the called entries left out), when it waits: due-marked by `rsm`. */
function calledChatsNextHeads({ t }: OutboxScan): SqlPart {
  return {
    name: "lnh",
    reads: ["lcu", "called"],
    rows: "seq",
    note: "The next head of a chat whose snapshot is current (the entries made unknown left out): due-marked below.",
    text: `SELECT h.seq FROM lcu CROSS JOIN LATERAL (
        SELECT b.seq, b.state FROM ${t.outbox} b
        WHERE b.chat_id = lcu.chat_id AND b.state IN (${BLOCKING}) AND b.${KEPT} AND b.seq NOT IN (SELECT seq FROM called)
        ORDER BY b.seq LIMIT 1
      ) h
      WHERE lcu.current AND h.state IN (${OUT_WAITING})`,
  };
}

/** `lost` without resend: the called entries that go `unknown`, those whose chat row was locked (or that have none). */
function calledToUnknown({ t }: OutboxScan): SqlPart {
  return {
    name: "lost",
    reads: ["called", "lcu"],
    rows: "seq, uncalled",
    text: `SELECT l.seq, false AS uncalled FROM called l
      WHERE l.chat_id IN (SELECT chat_id FROM lcu) OR NOT EXISTS (SELECT 1 FROM ${t.chat} x WHERE x.chat_id = l.chat_id)`,
  };
}

/**
 * `relost` (without resend): the uncalled abandoned entries, leased again as due work (no attempt was started:
 * OUT_CLAIM_SET keeps their attempts), at most $4 and before the heads. They stay `sending`: no chat lock.
 */
const UNCALLED_RELEASED: SqlPart = {
  name: "relost",
  reads: ["lost0"],
  rows: "seq",
  text: "SELECT l.seq FROM lost0 l WHERE l.uncalled ORDER BY l.seq LIMIT $4",
};

/** `amb`: the entries of `lost` written: `unknown` (lease dropped, no due mark), or with resend leased again. */
function abandonedSettled({ t, resend }: OutboxScan): SqlPart {
  const set = resend ? OUT_CLAIM_SET : `state = 'unknown', lease_owner = NULL, lease_incarnation = NULL, lease_token = NULL,
        lease_expires_at = NULL, next_attempt_at = NULL,
        error = coalesce(error, 'the sender was lost during the provider call'), updated_at = n.now, due_at = NULL`;
  return {
    name: "amb",
    reads: ["lost", "n"],
    rows: "the entries' columns, xv, uncalled",
    text: `UPDATE ${t.outbox} AS a SET ${set}
      FROM lost, n WHERE a.seq = lost.seq
      RETURNING ${outboxColumnsOf("a")}, a.xmin::text AS xv, lost.uncalled`,
  };
}

/** `rsl`: up to 100 chat rows flagged `resync`, locked (SKIP LOCKED), but for the chats of `lost0`'s entries made unknown. */
function resyncChatsLocked({ t, resend }: OutboxScan): SqlPart {
  const skipped = resend ? "lost0" : "called";
  return {
    name: "rsl",
    reads: [skipped],
    rows: "chat_id, ver (the locked, latest version)",
    note: "Chats flagged for resync (not those of entries made unknown: their rows are updated above).",
    text: `SELECT c.chat_id, c.ver FROM ${t.chat} c
      WHERE c.resync AND c.chat_id NOT IN (SELECT chat_id FROM ${skipped})
      ORDER BY c.chat_id LIMIT 100
      FOR UPDATE OF c SKIP LOCKED`,
  };
}

/** `rs`: the chats of `rsl` whose snapshot is current (their head can be found in it). */
function resyncChatsCurrent({ t }: OutboxScan): SqlPart {
  return {
    name: "rs",
    reads: ["rsl"],
    rows: "chat_id",
    note: "Only those whose locked (latest) version is the one this snapshot sees.",
    text: `SELECT rsl.chat_id FROM rsl WHERE rsl.ver = (SELECT s.ver FROM ${t.chat} s WHERE s.chat_id = rsl.chat_id)`,
  };
}

/** `rsc`: the flag of the chats of `rs` cleared. */
function resyncCleared({ t }: OutboxScan): SqlPart {
  return {
    name: "rsc",
    reads: ["rs"],
    rows: "chat_id",
    text: `UPDATE ${t.chat} AS c SET resync = false FROM rs WHERE c.chat_id = rs.chat_id RETURNING c.chat_id`,
  };
}

/** `rsh`: the head of each chat of `rsc` (its first blocking entry, by the active index), when it waits. */
function resyncHeads({ t }: OutboxScan): SqlPart {
  return {
    name: "rsh",
    reads: ["rsc"],
    rows: "seq",
    text: `SELECT h.seq FROM rsc CROSS JOIN LATERAL (
        SELECT b.seq, b.state FROM ${t.outbox} b
        WHERE b.chat_id = rsc.chat_id AND b.state IN (${BLOCKING}) AND b.${KEPT} ORDER BY b.seq LIMIT 1
      ) h
      WHERE h.state IN (${OUT_WAITING})`,
  };
}

/**
 * `rsm`: the heads of `rsh` (and `lnh`) without a due mark get one (SKIP LOCKED: a head locked by another
 * claimDue is being leased by it). This statement's `heads` reads the snapshot: the next scan leases them.
 */
function headsMarked({ t, resend }: OutboxScan): SqlPart {
  return {
    name: "rsm",
    reads: resend ? ["rsh", "n"] : ["rsh", "lnh", "n"],
    rows: "1 per head marked",
    text: `UPDATE ${t.outbox} AS m SET due_at = coalesce(m.next_attempt_at, n.now) FROM n
      WHERE m.seq = ANY(ARRAY(
        SELECT x.seq FROM ${t.outbox} x WHERE x.seq IN (SELECT seq FROM rsh${resend ? "" : " UNION ALL SELECT seq FROM lnh"})
          AND x.due_at IS NULL
        FOR UPDATE OF x SKIP LOCKED))
      RETURNING 1`,
  };
}

/**
 * `heads`: the due chat heads, by the due index (a due mark on an entry that is not its chat's head, a
 * stray, is passed over), locked (SKIP LOCKED), oldest first, as many as $4 leaves after the abandoned
 * entries leased again (`amb` with resend, `relost` without).
 */
function dueHeads({ t, resend }: OutboxScan): SqlPart {
  const taken = resend ? "amb" : "relost";
  return {
    name: "heads",
    reads: ["n", taken],
    rows: "seq",
    text: `SELECT o.seq FROM ${t.outbox} o
      WHERE o.due_at IS NOT NULL AND o.due_at <= ${NOW} AND o.state IN (${OUT_WAITING}) AND o.${KEPT}
        AND NOT EXISTS (
          SELECT 1 FROM ${t.outbox} b
          WHERE b.chat_id = o.chat_id AND b.state IN (${BLOCKING}) AND b.${KEPT} AND b.seq < o.seq)
      ORDER BY o.seq
      LIMIT greatest(0, $4 - (SELECT count(*) FROM ${taken}))
      FOR UPDATE OF o SKIP LOCKED`,
  };
}

/** `due`: the heads (and without resend `relost`) leased to the caller (claimedOutbox of rules.ts). */
function dueLeased({ t, resend }: OutboxScan): SqlPart {
  return {
    name: "due",
    reads: resend ? ["heads", "n"] : ["heads", "relost", "n"],
    rows: "the entries' columns, xv",
    note: "The rows of lost0 and heads are locked (their state rechecked when locked): no state check needed here.",
    text: `UPDATE ${t.outbox} AS d SET ${OUT_CLAIM_SET}
      FROM (SELECT seq FROM heads${resend ? "" : " UNION ALL SELECT seq FROM relost"}) p, n WHERE d.seq = p.seq
      RETURNING ${outboxColumnsOf("d")}, d.xmin::text AS xv`,
  };
}

/**
 * The parts of outbox claimDue, in statement order. It resolves the abandoned sends first: an uncalled one
 * is leased again, a called one is ambiguous (`unknown`, which no longer blocks its chat, so only with its chat
 * row locked; or with resend leased again as well, counted against $4 like the uncalled ones). Then it finds
 * and marks the heads of the chats flagged `resync` (see "Due marks" at {@link outboxSql}), and leases the due
 * heads, $4 in all with the abandoned entries leased again.
 */
export function outboxClaimDueParts(t: Tables, reclaim: boolean, resend: boolean): SqlPart[] {
  const s: OutboxScan = { t, reclaim, resend };
  const lost = resend
    ? [ALL_ABANDONED]
    : [CALLED_ABANDONED, calledChatsLocked(s), calledChatsStamped(s), calledChatsNextHeads(s), calledToUnknown(s), UNCALLED_RELEASED];
  return [
    NOW_PART,
    abandonedSends(s),
    ...lost,
    abandonedSettled(s),
    resyncChatsLocked(s),
    resyncChatsCurrent(s),
    resyncCleared(s),
    resyncHeads(s),
    headsMarked(s),
    dueHeads(s),
    dueLeased(s),
  ];
}

/** Outbox claimDue: its parts, then each entry it returns with its `part`: `ambiguous` (from `amb`, called) or `due`. */
export function outboxClaimDueSql(t: Tables, reclaim: boolean, resend: boolean): string {
  return withParts(
    outboxClaimDueParts(t, reclaim, resend),
    `SELECT CASE WHEN amb.uncalled THEN 'due' ELSE 'ambiguous' END AS part, ${OUTBOX_COLUMNS}, xv FROM amb
    UNION ALL SELECT 'due' AS part, ${OUTBOX_COLUMNS}, xv FROM due`,
  );
}

// ---- the session store and the kv ---------------------------------------------------
