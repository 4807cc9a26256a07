import { formatRange, type Range } from "@moeswarm/core";
import { rng } from "@moeswarm/testkit";
import { describe, expect, it } from "vitest";
import type { Lease } from "../src/market.js";
import { CoverageMarket, isMoeswarmHubConflict, type MarketModel } from "./market-helpers.js";

/*
 * The simulation, in-process and in simulated time: 50 workers with random capacities
 * join in random order against a model of 8 layers x 64 experts. Half of them take what
 * `autoClaim` offers; the others read the demand list and claim the range whose value, clipped to
 * their capacity, is largest, the way a worker runtime reading GET /api/demand would. Pollers of one instant share one
 * demand snapshot, so they race for the same ranges. Downloads renew their lease; some workers
 * crash while downloading (their lease must expire), some leave after serving (their cells must
 * come back and be taken again).
 */

const MiB = 1 << 20;
const LAYERS = 8;
const EXPERTS = 64;
const BYTES_PER_EXPERT = 6 * MiB;
const MODEL: MarketModel = {
  id: "sim",
  layers: Array.from({ length: LAYERS }, (_, layer) => ({
    layer,
    nExpert: EXPERTS,
    bytesPerExpert: BYTES_PER_EXPERT,
  })),
};
const T0 = 1_800_000_000_000;
const TTL_MS = 60_000;
const POLL_MS = 5_000;
const END_MS = 2_400_000;

type State = "waiting" | "downloading" | "serving" | "gone";

interface SimWorker {
  id: string;
  capacity: number;
  bandwidth: number;
  joinAt: number;
  strategy: "auto" | "list";
  /** Crashes after its first claim, never registering. */
  crashes: boolean;
  /** Leaves at this time (ms from the start) once it serves. */
  leavesAt: number | undefined;
  state: State;
  nextPoll: number;
  lease?: Lease;
  doneAt?: number;
  slice?: { layers: Range; experts: Range };
}

interface Outcome {
  placement: string;
  granted: number;
  conflicts: Record<string, number>;
  violations: string[];
  replacedCells: number;
  leftCells: number;
  expired: number;
  final: ReturnType<CoverageMarket["coverage"]>;
}

function simulate(seed: number): Outcome {
  const rand = rng(seed);
  let ids = 0;
  const market = new CoverageMarket({
    newId: () => `L${++ids}`,
    leaseTtlMs: TTL_MS,
    halfLifeMs: 24 * 3_600_000,
  });
  market.addModel(MODEL, T0);

  // routing counts: every expert within +-50% of the average but one hot expert per layer at 5x
  // (h ~ 4.7, target 3). A worker holds one rectangle, so each extra replica of a scattered hot
  // expert takes a worker of its own: the fleet must be large enough for that.
  const counts = new Map<number, number[]>();
  for (let layer = 0; layer < LAYERS; layer++) {
    const row = Array.from({ length: EXPERTS }, () => Math.round(1000 * (0.5 + rand())));
    row[Math.floor(rand() * EXPERTS)] = 5 * 1000;
    counts.set(layer, row);
  }
  market.addCounts("sim", counts, T0);

  const workers: SimWorker[] = Array.from({ length: 50 }, (_, i) => {
    // log-uniform capacity between 48 MiB (8 experts) and 3 GiB
    const capacity = Math.floor(48 * MiB * 64 ** rand());
    return {
      id: `w${String(i).padStart(2, "0")}`,
      capacity,
      bandwidth: (5 + 95 * rand()) * 1e6,
      // ten arrive together (a flash crowd polling one snapshot), the rest over 20 minutes
      joinAt: i < 10 ? 0 : Math.floor(rand() * 1_200_000),
      strategy: rand() < 0.5 ? "auto" : "list",
      crashes: i % 17 === 3,
      leavesAt: i % 7 === 2 ? 300_000 + Math.floor(rand() * 400_000) : undefined,
      state: "waiting",
      nextPoll: 0,
    };
  });
  for (const w of workers) w.nextPoll = T0 + w.joinAt;

  const out: Outcome = {
    placement: "",
    granted: 0,
    conflicts: {},
    violations: [],
    replacedCells: 0,
    leftCells: 0,
    expired: 0,
    final: market.coverage("sim", T0),
  };
  const vacated = new Set<string>();

  const check = (now: number, what: string) => {
    const g = market.coverage("sim", now);
    for (let r = 0; r < LAYERS; r++) {
      for (let e = 0; e < EXPERTS; e++) {
        const have = (g.replicas[r] as number[])[e]! + (g.pending[r] as number[])[e]!;
        const target = (g.targets[r] as number[])[e]!;
        if (have > target)
          out.violations.push(`${what} at ${now - T0}: layer ${r} expert ${e} has ${have} > ${target}`);
      }
    }
  };

  for (let t = 0; t <= END_MS; t += 1000) {
    const now = T0 + t;
    out.expired += market.expire(now).length;
    // downloads renew their lease every 20 s; finished ones register; crashed workers do neither
    for (const w of workers) {
      if (
        w.state === "downloading" &&
        !w.crashes &&
        w.lease &&
        t % 20_000 === 0 &&
        now < (w.doneAt as number)
      ) {
        w.lease = market.renew(w.lease.id, w.id, now);
      }
      if (w.state === "downloading" && w.doneAt !== undefined && now >= w.doneAt && w.lease) {
        if (w.crashes) {
          w.state = "gone";
          continue;
        }
        const { layers, experts } = w.lease;
        const ls = Array.from({ length: layers.end - layers.start }, (_, i) => layers.start + i);
        const es = Array.from({ length: experts.end - experts.start }, (_, i) => experts.start + i);
        const fulfilled = market.register(w.id, "sim", ls, es, now);
        expect(fulfilled.map((l) => l.id)).toEqual([w.lease.id]);
        for (const l of ls) for (const e of es) if (vacated.delete(`${l}:${e}`)) out.replacedCells++;
        w.state = "serving";
        w.slice = { layers, experts };
        check(now, `register ${w.id}`);
      }
      if (w.state === "serving" && w.leavesAt !== undefined && t >= w.leavesAt) {
        market.workerGone(w.id, now);
        w.state = "gone";
        const { layers, experts } = w.slice as { layers: Range; experts: Range };
        for (let l = layers.start; l < layers.end; l++) {
          for (let e = experts.start; e < experts.end; e++) {
            vacated.add(`${l}:${e}`);
            out.leftCells++;
          }
        }
      }
    }
    // everyone polling now sees the same snapshot, as concurrent HTTP clients would
    const snapshot = market.demand(now);
    for (const w of workers) {
      if (w.state !== "waiting" || now < w.nextPoll) continue;
      w.nextPoll = now + POLL_MS;
      try {
        let lease: Lease;
        if (w.strategy === "auto") {
          lease = market.autoClaim({ worker: w.id, capacity: { ramBytes: w.capacity } }, now);
        } else {
          // the range whose value, clipped to what fits, is largest (the list's order breaks ties)
          let fit: (typeof snapshot)[number] | undefined;
          let n = 0;
          let best = 0;
          for (const d of snapshot) {
            const k = Math.min(d.count, Math.floor(w.capacity / d.bytesPerExpert));
            if (k > 0 && (d.value * k) / d.count > best) {
              best = (d.value * k) / d.count;
              fit = d;
              n = k;
            }
          }
          if (!fit) continue;
          lease = market.claim(
            {
              worker: w.id,
              model: "sim",
              layers: { start: fit.layer, end: fit.layer + 1 },
              experts: { start: fit.experts.start, end: fit.experts.start + n },
              capacity: { ramBytes: w.capacity, bandwidthBps: w.bandwidth },
            },
            now,
          );
        }
        out.granted++;
        expect(lease.bytes).toBeLessThanOrEqual(w.capacity);
        w.lease = lease;
        w.state = "downloading";
        w.doneAt = now + Math.ceil((lease.bytes / w.bandwidth) * 1000);
        check(now, `claim ${w.id} ${formatRange(lease.layers)}/${formatRange(lease.experts)}`);
      } catch (error) {
        const reason = ["covered", "leased", "capacity"].find((r) => isMoeswarmHubConflict(error, r));
        if (!reason) throw error;
        out.conflicts[reason] = (out.conflicts[reason] ?? 0) + 1;
      }
    }
  }
  out.final = market.coverage("sim", T0 + END_MS);
  out.placement = JSON.stringify(market.placement("sim"));
  return out;
}

describe("coverage market simulation: 50 workers, 8 layers x 64 experts", () => {
  const run = simulate(7);

  it("covers every expert, hot experts up to their target", () => {
    const { replicas, targets } = run.final;
    const hot = targets.flat().filter((t) => t > 1).length;
    expect(hot).toBe(LAYERS); // one hot expert per layer
    expect(Math.max(...targets.flat())).toBe(3);
    for (let r = 0; r < LAYERS; r++) {
      for (let e = 0; e < EXPERTS; e++) {
        expect((replicas[r] as number[])[e], `layer ${r} expert ${e}`).toBeGreaterThanOrEqual(
          (targets[r] as number[])[e] as number,
        );
      }
    }
  });

  it("never lets a cell be held (live or leased) beyond its target", () => {
    expect(run.violations).toEqual([]);
    expect(run.granted).toBeGreaterThan(20);
  });

  it("makes concurrent pollers of one snapshot lose the race instead of taking the same slice", () => {
    expect(run.conflicts.leased ?? 0).toBeGreaterThan(0);
  });

  it("releases crashed workers' leases and has leavers' cells taken by the next pollers", () => {
    expect(run.expired).toBeGreaterThan(0);
    expect(run.leftCells).toBeGreaterThan(0);
    expect(run.replacedCells).toBeGreaterThan(0);
  });

  it("is deterministic for a seed", () => {
    const again = simulate(7);
    expect(again.placement).toBe(run.placement);
    expect(again.conflicts).toEqual(run.conflicts);
  });
});
