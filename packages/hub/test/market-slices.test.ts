import { Placement } from "@moeswarm/dispatch";
import { describe, expect, it } from "vitest";
import { cap, market, T0 } from "./market-fixtures.js";
import { type CoverageMarket, isMoeswarmHubConflict, type MarketModel } from "./market-helpers.js";

describe("several slices per worker", () => {
  // 4 layers x 64 experts, as the synthetic qwen3moe "small" model: one layer is 64 * B bytes
  const B = 209_920;
  const SMALL: MarketModel = {
    id: "small",
    layers: [0, 1, 2, 3].map((layer) => ({ layer, nExpert: 64, bytesPerExpert: B })),
  };
  const range = (start: number, end: number) => Array.from({ length: end - start }, (_, i) => start + i);

  it("adds each registered slice; a worker counts once per cell; placement lists one entry per slice", () => {
    const m = market();
    m.addModel(SMALL, T0);
    const v0 = m.version("small");
    m.register("a", "small", [0, 1, 2], range(0, 49), T0);
    m.register("a", "small", [3], range(0, 64), T0 + 1);
    m.register("b", "small", [0, 1, 2], range(49, 64), T0 + 2);
    expect(m.version("small")).toBeGreaterThan(v0);
    expect(m.summary("small", T0)).toMatchObject({ cells: 256, uncovered: 0 });
    // the same slice again changes nothing; an overlapping one adds only what is new
    const v1 = m.version("small");
    m.register("a", "small", [3], range(0, 64), T0 + 3);
    expect(m.version("small")).toBe(v1);
    m.register("a", "small", [2, 3], range(40, 56), T0 + 4);
    const g = m.coverage("small", T0 + 4);
    expect(g.replicas[2]?.slice(38, 58)).toEqual([...Array(11).fill(1), ...Array(7).fill(2), 1, 1]);
    expect(g.replicas[3]?.every((r) => r === 1)).toBe(true);
    const json = JSON.parse(JSON.stringify(m.placement("small")));
    expect(json.registrations.map((r: { id: string; layers: number[] }) => [r.id, r.layers])).toEqual([
      ["a", [0, 1, 2]],
      ["a", [3]],
      ["a", [2, 3]],
      ["b", [0, 1, 2]],
    ]);
    expect(json.owners).toContainEqual({ layer: 3, experts: "0:64", workers: ["a"] });
    expect(json.owners).toContainEqual({ layer: 2, experts: "49:56", workers: ["a", "b"] });
    const placement = Placement.fromRegistrations(json.registrations, { model: "small" });
    expect(placement.missing({ layers: [0, 1, 2, 3], nExpert: 64 })).toEqual([]);
    expect(placement.owners(3, 50)).toEqual(["a"]);
    expect(placement.owners(2, 50)).toEqual(["a", "b"]);
    // a drain withdraws every slice of the worker; a register after it starts a new set
    m.drain("a", T0 + 5);
    expect(m.summary("small", T0)).toMatchObject({ uncovered: 256 - 45 });
    m.register("a", "small", [3], range(0, 8), T0 + 6);
    expect(m.placement("small").registrations.filter((r) => r.id === "a")).toHaveLength(1);
    expect(m.summary("small", T0)).toMatchObject({ uncovered: 256 - 45 - 8 });
    m.workerGone("a", T0 + 7);
    expect(m.summary("small", T0)).toMatchObject({ uncovered: 256 - 45 });
  });

  it("bounds the work of a register by the model's cells, whatever a worker lists", () => {
    const m = market();
    m.addModel(SMALL, T0);
    // the protocol's limits: 4096 layers, 65536 experts per frame; several such slices
    // (a union over what they list, not over the grid, would take minutes and gigabytes: the
    // test's timeout would fail it)
    const huge = range(0, 65_536);
    for (let i = 0; i < 4; i++) m.register("h", "small", range(i, 4096), huge.slice(i), T0 + i);
    expect(m.summary("small", T0)).toMatchObject({ uncovered: 0 });
    expect(
      m
        .coverage("small", T0)
        .replicas.flat()
        .every((r) => r === 1),
    ).toBe(true);
    // the placement lists what the model has, not what the frames listed
    expect(m.placement("small").registrations.map((r) => [r.layers, r.experts.length])).toEqual([
      [[0, 1, 2, 3], 64],
      [[1, 2, 3], 63],
      [[2, 3], 62],
      [[3], 61],
    ]);
  });

  it("holds several leases; an overlapping claim replaces one; auto-claims fit what is left", () => {
    const m = market();
    m.addModel(SMALL, T0);
    const capacity = cap(100 * B);
    const claim = (layers: [number, number], experts: [number, number]) =>
      m.claim(
        {
          worker: "a",
          model: "small",
          layers: { start: layers[0], end: layers[1] },
          experts: { start: experts[0], end: experts[1] },
          capacity,
        },
        T0,
      );
    const first = claim([0, 1], [0, 40]);
    const second = claim([1, 2], [0, 40]);
    expect(m.leases().map((l) => l.id)).toEqual([first.id, second.id]);
    // 80 experts leased: 20 left
    expect(() => claim([2, 3], [0, 21])).toThrow(
      expect.objectContaining({ details: expect.objectContaining({ reason: "capacity", held: 80 * B }) }),
    );
    // overlapping its first lease: replaces it (40 freed, 30 taken)
    const third = claim([0, 1], [30, 60]);
    expect(
      m
        .leases()
        .map((l) => l.id)
        .sort(),
    ).toEqual([second.id, third.id].sort());
    expect(m.coverage("small", T0).pending[0]?.slice(28, 62)).toEqual([0, 0, ...Array(30).fill(1), 0, 0]);
    // auto: the most valuable rectangle in the 30 experts left, not touching its own leases
    const auto = m.autoClaim({ worker: "a", capacity, model: "small" }, T0);
    expect(auto.bytes).toBe(30 * B);
    expect(m.leases().filter((l) => l.worker === "a")).toHaveLength(3);
    expect(() => m.autoClaim({ worker: "a", capacity, model: "small" }, T0)).toThrow(
      expect.objectContaining({ details: expect.objectContaining({ reason: "capacity" }) }),
    );
    // registering fulfils each lease by the slice that holds it
    const fulfilled = m.register("a", "small", [1], range(0, 40), T0 + 1);
    expect(fulfilled.map((l) => l.id)).toEqual([second.id]);
    expect(m.leases().filter((l) => l.worker === "a")).toHaveLength(2);
    // a worker that restarted gives back what a previous run of it still had leased
    const fresh = m.claim(
      {
        worker: "a",
        model: "small",
        layers: { start: 3, end: 4 },
        experts: { start: 0, end: 10 },
        capacity,
        replaceLeases: true,
      },
      T0 + 2,
    );
    expect(
      m
        .leases()
        .filter((l) => l.worker === "a")
        .map((l) => l.id),
    ).toEqual([fresh.id]);
    expect(m.coverage("small", T0 + 2).pending[0]?.every((p) => p === 0)).toBe(true);
  });

  /**
   * Workers that keep claiming (`autoClaim`) and registering while they have room, taking turns,
   * as runtimes polling the hub do; each worker offers `capacity`.
   */
  function fill(n: number, capacity: number): ReturnType<CoverageMarket["placement"]> {
    const m = market();
    m.addModel(SMALL, T0);
    const full = new Set<number>();
    let now = T0;
    while (full.size < n) {
      for (let w = 0; w < n; w++) {
        if (full.has(w)) continue;
        try {
          const lease = m.autoClaim({ worker: `w${w}`, capacity: cap(capacity) }, ++now);
          const { layers, experts } = lease;
          expect(
            m.register(
              `w${w}`,
              "small",
              range(layers.start, layers.end),
              range(experts.start, experts.end),
              ++now,
            ),
          ).toHaveLength(1);
        } catch (e) {
          if (!isMoeswarmHubConflict(e, "capacity") && !isMoeswarmHubConflict(e, "covered")) throw e;
          full.add(w);
        }
      }
    }
    return m.placement("small");
  }

  it("covers the model with two workers and slack: whole layers each, one owner per layer", () => {
    // 30.7 MB each: layers 0:3 x experts 0:49 is the largest rectangle that fits, but two whole
    // layers (128 cells) are worth more than half of it: a token's layer then needs one request
    const capacity = Math.ceil(((256 * B) / 2) * 1.15);
    const p = fill(2, capacity);
    expect(p.missing).toEqual([]);
    expect(
      p.registrations.map((r) => [
        r.id,
        `${r.layers[0]}:${r.layers.at(-1)! + 1}`,
        `${r.experts[0]}:${r.experts.at(-1)! + 1}`,
      ]),
    ).toEqual([
      ["w0", "0:2", "0:64"],
      ["w1", "2:4", "0:64"],
    ]);
  });

  it("a worker smaller than a layer still takes the most valuable part-layer slice", () => {
    // 40 experts' worth: no whole layer fits, so the widest run of one layer (value first)
    const p = fill(1, 40 * B);
    const r = p.registrations[0]!;
    expect([`${r.layers[0]}:${r.layers.at(-1)! + 1}`, `${r.experts[0]}:${r.experts.at(-1)! + 1}`]).toEqual([
      "0:1",
      "0:40",
    ]);
  });

  it("covers the model with 1..8 equal workers of 15% slack each, every cell exactly once", () => {
    for (let n = 1; n <= 8; n++) {
      const p = fill(n, Math.ceil(((256 * B) / n) * 1.15));
      expect(p.missing, `${n} workers`).toEqual([]);
      expect(
        p.owners.every((o) => o.workers.length === 1),
        `${n} workers`,
      ).toBe(true);
      const cells = p.registrations.reduce((sum, r) => sum + r.layers.length * r.experts.length, 0);
      expect(cells, `${n} workers`).toBe(256);
    }
  });
});

describe("placement", () => {
  it("publishes registrations that dispatch's Placement is built from, with per-cell owners", () => {
    const m = market();
    const model: MarketModel = {
      id: "p",
      layers: [0, 1, 2].map((layer) => ({ layer, nExpert: 6, bytesPerExpert: 10 })),
    };
    m.addModel(model, T0);
    m.register("b", "p", [0, 1], [0, 1, 2], T0);
    m.register("a", "p", [1], [2, 3, 4, 5], T0);
    m.register("c", "p", [2], [0, 1, 2, 3, 4, 5], T0);
    m.register("d", "p", [2], [5], T0);
    m.drain("d", T0);
    const json = JSON.parse(JSON.stringify(m.placement("p")));
    const placement = Placement.fromRegistrations(json.registrations, { model: json.model });
    expect(placement.workers()).toEqual(["a", "b", "c"]);
    for (const layer of [0, 1, 2]) {
      for (let e = 0; e < 6; e++) {
        const fromOwners = json.owners
          .filter((o: { layer: number; experts: string }) => {
            const [s, t] = o.experts.split(":").map(Number);
            return o.layer === layer && e >= (s as number) && e < (t as number);
          })
          .flatMap((o: { workers: string[] }) => o.workers);
        expect([...placement.owners(layer, e)].sort()).toEqual([...fromOwners].sort());
      }
    }
    expect(json.owners).toContainEqual({ layer: 1, experts: "2:3", workers: ["a", "b"] });
    expect(json.missing).toEqual(placement.missing({ layers: [0, 1, 2], nExpert: 6 }));
    expect(json.missing).toEqual([{ layer: 0, experts: "3:6", count: 3 }]);
  });
});
