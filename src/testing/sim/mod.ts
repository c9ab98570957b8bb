/**
 * A deterministic simulator for the durability engine: a whole multi-replica
 * bot scenario in simulated time, reproducible from a seed, with a seeded
 * fault plan and invariants checked at the end. Backend-agnostic: give it a
 * backend factory.
 *
 * @module
 */
export { type BackendFactory, parseFaults, runSimulation, type SimOptions, type SimResult } from "./run.ts";
export type { SimFailure } from "./invariants.ts";
export { FAULT_KINDS, type FaultKind } from "./world.ts";
export { Prng } from "./prng.ts";
export { ReplicaClock, SIM_EPOCH, SimScheduler } from "./scheduler.ts";
