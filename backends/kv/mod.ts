/**
 * The generic durability backend over a {@link DurableKv}: one inbox and
 * outbox implementation with the full contract, built on versioned get,
 * compare-and-set, conditional delete and ordered prefix listing alone.
 * Several engines (processes, replicas) may share one kv.
 *
 * ## Layout (under `prefix`)
 * - `r/in/<id>`, `r/out/<key>`: the records, stored as `{ rec, hints }`, where
 *   `hints` lists the index keys the record currently owns.
 * - `i/due/in/<dueAt>/<receivedAt>/<state>/<id>/<nonce>`,
 *   `i/due/out/<dueAt>/<seq>/<state>/<chatId>/<key>/<nonce>`: active records by
 *   when a due scan must look at them.
 * - `i/st/<in|out>/<state>/<time>/<id>/<nonce>`: records by state; `time` is
 *   `updatedAt` for `done`/`sent` (purge) and the list order (`receivedAt`,
 *   `seq`) otherwise.
 * - `i/chat/<chatId>/<seq>/<key>/<nonce>`: the chat's unsettled outbox entries
 *   (`queued`, `sending`, `failed`).
 * - `i/chat-in/<chatId>/<receivedAt>/<id>/<nonce>`: the chat's active inbox
 *   records (`pending`, `processing`, `failed`).
 * - `c/out/seq`: the outbox sequence counter.
 * - `d/in/<id>`, `d/out/<key>`: records set aside as damaged, as
 *   `{ problem, setAsideAt, reported, v }` (`v`: the version of the value set
 *   aside).
 *
 * Numbers are zero-padded to 16 digits; ids, keys and chat ids have `%` and
 * `/` escaped so that they cannot break a key apart.
 *
 * ## Index keys are hints
 * There are no multi-key transactions, so every change is one compare-and-set
 * of the record, and index keys are hints checked against it: a hint is valid
 * only while the record's `hints` lists it. A change writes its new hints
 * first, then CASes the record, then deletes the hints the record no longer
 * lists. A crash leaves extra hints, never a missing one. Each hint written
 * carries a fresh random nonce, so a hint that was dropped is never valid
 * again and deleting it can never remove a hint that a later change needs.
 * A scan that meets a hint the record does not list deletes it, unless the
 * hint was written against the record's current version (its writer's CAS
 * may still be coming), or, for a record not created yet, unless it is
 * younger than ten minutes.
 *
 * This relies on the kv never reusing a version of a key, also after a
 * delete (the same property compare-and-set itself needs).
 *
 * ## Ordering of sends
 * `seq` comes from a counter key advanced by CAS: strictly increasing across
 * every engine on the kv, and a crash can only skip a number. Whether a chat
 * is clear (in `reserve` and `claimDue`) is checked against the chat index
 * before the entry is written or leased. Within one backend instance the
 * reserves of a chat run one at a time; across instances that check-then-write
 * is not atomic, so route each chat to one replica at a time (sticky by chat
 * id; see docs/replicas.md), as the engine requires anyway.
 *
 * ## Ordering of inbound records
 * An inbox due scan goes through due records in arrival order (`receivedAt`,
 * then id). The first time it meets a chat it reads the chat's active records
 * through the chat index: the records behind one held elsewhere are left, and
 * the others are claimed in arrival order up to the due one met, each by its
 * own compare-and-set. The scan leaves the chat at the first claim it loses.
 * So two concurrent scans of a chat race on the same first record: the loser
 * stops there, and a scan that reads the chat after that claim sees it held.
 * There is no admission counter, so ties of a millisecond are ordered by id;
 * a record held elsewhere therefore also holds back the records of its chat
 * received in the same millisecond (two engines may admit one chat's messages
 * in one millisecond, and the ids do not tell which came first).
 * A record stored before the chat index existed gets its chat index key with
 * its next change.
 *
 * `admit` with a lease reads the chat index first (one `list` of the chat's
 * prefix, up to the new record's `receivedAt`, and one read of each active
 * record it lists): the record is created leased only when each of them that
 * came first (received earlier, or in the same millisecond) lets it (the
 * caller's own live lease, or a `failed` record whose retry is not due yet),
 * else it is created `pending`, for a due scan to take in order. A record
 * set aside, or one stored before the chat index existed, counts as nothing. The check and the create are not one atomic step: two
 * admissions of one chat racing on two engines may both lease (route each
 * chat to one replica). An admit without a lease reads nothing more.
 *
 * ## Damaged records
 * A value under a record key that is not a record (not `{ rec, hints }`, a
 * field of `rec` of the wrong type, an unknown state, an id that is not its
 * key's) is set aside by the first operation that reads it: its marker
 * `d/<in|out>/<id>` is created by a compare-and-set (so exactly one caller
 * sets it aside, at the kv clock), and the value is kept as it is. An index
 * key that leads to it is deleted when a scan meets it: due scans neither
 * take it nor let it hold back its chat, `list` returns the other records.
 * `get` rejects with a `DamagedRecordError`, a `reserve` of its key too
 * (whether it was sent is unknown), an `admit` of its id answers `null`, and
 * nothing else changes it. `damaged()` lists the markers by set-aside time;
 * `reportDamaged` flips `reported` by compare-and-set. A value repaired by
 * hand needs its index keys written back and its marker deleted.
 *
 * @module
 */
export { KvDurability, type KvDurabilityOptions } from "./durability.ts";
export type { BackendScope, DurableKv, JsonValue, KvEntry } from "../../src/contract.ts";
