/**
 * An in-memory durability backend: the full contract kept in plain objects
 * inside one process. For tests, and as the shared state of the crash harness
 * (two `Bot` instances on one `MemoryDurability`).
 *
 * @module
 */
export { MemoryDurability, type MemoryDurabilityOptions } from "./durability.ts";
export { MemoryKv, type MemoryKvOptions } from "./kv.ts";
