/**
 * `@botmesh/durable/redis`: a durability backend, a session store and a
 * {@link DurableKv} on Redis, shared by many replicas on many hosts.
 *
 * - {@link RedisDurability}: the inbox and outbox journals.
 * - {@link RedisStore}: the bot's {@link SessionStore} (values with a TTL);
 *   `store.durability()` journals with the same client and key prefix.
 * - {@link RedisKv}: a versioned key-value store for `new KvDurability(kv)` or
 *   `new EventsDurability({ journal, outbox: kv })`.
 *
 * ## Clients
 * Pass the client you already have as `client`: an `@upstash/redis` client
 * (HTTP/fetch: edge workers), or a TCP client for servers — `ioredis`,
 * `redis` (node-redis, connected) or Bun's `RedisClient`. It is recognised by
 * its shape (no client package is imported); the adapters
 * {@link fromUpstash}, {@link fromIoredis}, {@link fromNodeRedis},
 * {@link fromBunRedis} are exported too, and any object implementing
 * {@link RedisCommands} (`evalsha`, `scriptLoad`) works. The backend never
 * connects or closes the client: close it yourself after `bot.stop()`.
 *
 * ## Atomicity, time and fencing
 * Every operation is ONE Lua script (`lua/*.lua`, assembled by `lua.ts`), loaded once and
 * run with `EVALSHA`; when the server answers `NOSCRIPT` (after a
 * `SCRIPT FLUSH`, a restart or a failover) it is loaded again and re-run.
 * The writes of the hot path (admit, heartbeats, finishing, reserve,
 * markCalling, markSent/markFailed) issued in one turn of the event loop go
 * in one `EVALSHA` of a batch script that runs each as its own script would,
 * in order, and answers each on its own (one that fails changes nothing of
 * the others); at most two such calls are in flight, and the writes issued
 * meanwhile go together in the next one.
 * Scripts are atomic, so claims, fencing checks and the per-chat order of
 * sends hold across any number of replicas. Times come from the server
 * (`redis.call('TIME')` inside the scripts), never from a replica's clock.
 *
 * ## Keys
 * Every key starts with `{keyPrefix}` (default `{botmesh:}`): the braces are
 * a Redis Cluster hash tag, so all keys of one backend share a slot. Give
 * each bot (tenant, test) its own prefix. Under the prefix:
 * - `in:r:<id>` inbox record (hash; the payload is opaque JSON text);
 *   `in:chat:<chatId>`, `in:st:<state>` sorted sets in receipt
 *   order (`in:st:pending` is also the due backlog); `in:timed` (failed and
 *   processing records by when they become due); `in:own:<n>:<owner>:<incarnation>`
 *   (the records one incarnation leases, in receipt order; `<n>` is the owner's length), and
 *   `in:incs:<owner>` the incarnations that have such a set, for `reclaimOwn`
 *   (a restart takes back its previous incarnation's records batch by batch,
 *   reading each batch only); `in:done` (done records by `updatedAt`, for
 *   purges); `in:ord` admission counter; `in:act:<chatId>` the chat's active
 *   (pending/processing/failed) records in arrival order, which due scans
 *   and leased admissions read to keep the chat's order; `in:actv` marks
 *   that index as built;
 *   `in:dmg` the ids of damaged records set aside, in the order they were
 *   (`in:dmgn` counter), `in:dmgu` those not reported yet, `in:dmg:<id>`
 *   (hash: `problem`, `at`, `reported`) each one's report.
 * - `out:r:<key>` outbox entry (hash; content is opaque JSON text; `called`
 *   is `1`/`0`);
 *   `out:chat:<chatId>`, `out:st:<state>` by `seq`;
 *   `out:open:<chatId>` the chat's unsettled (queued/sending/failed) entries
 *   by `seq`, whose first is the chat's head; `out:due` the heads that are
 *   queued/failed, by `nextAttemptAt`; `out:lease` sending entries by lease
 *   expiry; `out:owner:<owner>`; `out:sent` by `updatedAt`; `out:seq` counter;
 *   `out:dmg`, `out:dmgn`, `out:dmgu`, `out:dmg:<key>` as for the inbox.
 * - `s:<key>` session values (`SET … PX`); `kv:r:<key>`, `kv:keys`, `kv:ver` the kv.
 *
 * Due scans read only due entries (`claimDue` is O(due)); an inbox scan also
 * reads the active records of the chats it takes from, never settled ones.
 * Purges delete at most 500 records per script call.
 *
 * ## Admission
 * `inbox.admit` is one script. With a lease it first reads the active records
 * of the chat that come before the new one (`in:act:<chatId>`, in arrival
 * order, up to its `receivedAt`), stopping at the first one that is not a
 * `failed` record waiting for its retry or a live lease of the caller's own
 * incarnation: then the new record is admitted `pending` (attempts 0, no
 * lease) for a due scan to take in order, else it is leased. The check and
 * the insert are one atomic script: an admission sees every record of its
 * chat admitted before it, by any replica, so two racing admissions of one
 * chat lease both only when the later one sorts first (an earlier
 * `receivedAt`). A damaged record met on the way is set aside and holds
 * nothing back. The cost: one sorted-set range read (per 16 records) and one
 * record read per active record of the chat ahead of the new one, up to the
 * first that holds it back (in the usual case, the caller's own queue of that
 * chat); an admission without a lease reads nothing more.
 *
 * ## Lost replies
 * A reply can be lost after Redis ran the script, and clients send the call
 * again (ioredis re-sends unfulfilled commands after a reconnect, Upstash
 * retries a failed fetch). Every mutating script is therefore run once per
 * call: the backend passes a random request key `rq:<uuid>` (`KEYS[2]`); a
 * second run returns the reply the first stored there (`SET … PX`, 120 s; see
 * `REQUEST_TTL_MS` in `lua.ts` for the memory this costs). The one
 * exception is `outbox.markCalling`, one write per send on the hot path: it is
 * idempotent by itself, so it stores no reply, and a re-sent call answers for
 * the entry as it is then (`false` when its lease was lost meanwhile, so that
 * no provider call starts under it). A batch call has one request key: a
 * second run answers its other operations from it and runs the
 * `markCalling`s in it again. The stored replies are small: an admission or
 * a new reservation answers the state, times and number the script chose
 * (the caller has the rest of the record), never a copy of the record.
 *
 * A due scan named by a `requestId` (`ClaimDueOptions`) is run under the
 * request key `rq:scan:<in|out>:<requestId>` instead of a random one (in the
 * prefix's hash slot like every key), so its reply stays there for
 * `SCAN_ANSWER_KEEP_MS`; a `repeat` closes the request and reads that key
 * (one script: it sets the journal's empty answer there unless the key is
 * set, then answers what is there) and decodes it as the scan's own reply,
 * by any replica. A scan whose reply was lost is thus answered under the
 * fencing tokens it issued; a scan that had not run yet when the repeat came
 * (it was still on its way) finds the key when it arrives and answers the
 * empty answer without running: the repeat's answer is final.
 *
 * ## Stored data of older versions
 * Older versions also wrote `in:all`/`out:all` (every record, in list
 * order) and `in:owner:<owner>` (one set of every lease of an owner, which a
 * reclaiming scan read whole for each batch). Lists now read the per-state
 * sets, which hold every record too; `in:all`/`out:all` are left as they are
 * (purges still remove from them). The first reclaiming scan of an owner
 * moves its `in:owner:<owner>` into the sets by incarnation and deletes it
 * (again when an older replica wrote to it meanwhile, in a rolling upgrade;
 * such a replica's unfiltered lists miss the records this version admits).
 *
 * An outbox entry written before the `called` field existed has none: it
 * reads as `called: true` (a provider call may have started under its lease,
 * so a lapsed one stays ambiguous, as it was). The next claim writes the field;
 * nothing has to be migrated.
 *
 * Inbox records written before the per-chat index (`in:act:<chatId>`)
 * existed are indexed by the first inbox due scan under the key prefix: one
 * script that reads every active (pending, processing, failed) record once,
 * then sets `in:actv`; settled records are not read. A record an older
 * replica admits after that (during a rolling upgrade) is indexed when a due
 * scan first sees it. Until then a leased admission does not see such records
 * (it reads the index only) and may lease a record behind one of them.
 *
 * Records an older version quarantined (state `dead`, error
 * `botmesh: quarantined as damaged: …`) are damaged records: the first call
 * that meets one sets it aside (below), with that problem.
 *
 * ## Damaged records
 * A record whose hash is not one this library wrote — a field missing, a
 * number that is none, an unknown state, a payload or content that is not
 * JSON, a key that holds no hash — is damaged. Every script checks each field
 * the reader needs before its first write (Lua does not roll back; a
 * payload's or content's JSON syntax is checked as `JSON.parse` reads it),
 * and the first one that meets a damaged record sets it aside, once (scripts
 * are atomic): its hash is kept exactly as it is, it leaves every index (due
 * windows, chat order, states, lists), and it is listed in `in:dmg`/`out:dmg`.
 * From then on due scans neither take it nor let it hold back its chat,
 * `list` returns the other records, `get` (and `reserve` of its key) rejects
 * with a `DamagedRecordError` naming the key and field, `claim` answers
 * `null`, `replay`, `retry` and `discard` answer `false`, `purge` leaves it,
 * and calls under its old lease are stale. `damaged()` lists the records set
 * aside, `reportDamaged(id)` marks one reported (one script: one caller gets
 * `true`); the bot reports each once. An outbox entry whose chat cannot be
 * read (its `chatId` field gone, its key no hash) cannot be taken out of its
 * chat's order by a due scan: the chat's next entry moves up when the chat is
 * next written to (a `reserve` in it), as for an entry deleted by hand.
 * Marks of records that are gone, or not due (any more), are dropped from the
 * due windows as they are read.
 *
 * @module
 */
export { RedisDurability } from "./durability.ts";
export { RedisKv } from "./kv.ts";
export { RedisRateLimiter, type RedisRateLimiterOptions } from "./rate_limiter.ts";
export type { RedisDurabilityOptions, RedisKvOptions, RedisOptions, RedisStoreOptions } from "./options.ts";
export { RedisStore } from "./store.ts";
export {
  type BunRedisLike,
  fromBunRedis,
  fromIoredis,
  fromNodeRedis,
  fromUpstash,
  type IoredisLike,
  type NodeRedisLike,
  type RedisCommands,
  type UpstashLike,
} from "./clients.ts";
