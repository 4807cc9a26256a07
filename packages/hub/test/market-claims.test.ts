import { describe, expect, it } from "vitest";
import { cap, EXAMPLE, MiB, market, T0 } from "./market-fixtures.js";
import {
  DemandCounters,
  demandPolicy,
  hotness,
  isMoeswarmHubConflict,
  type MarketModel,
  targetReplicas,
} from "./market-helpers.js";

describe("demand formula", () => {
  it("decays counts by half per half-life, from the timestamps alone", () => {
    const d = new DemandCounters(2, 0);
    d.add(0, [100, 40], 0, 1000);
    d.add(0, [0, 0], 1000, 1000);
    expect([...d.counts]).toEqual([50, 20]);
    d.add(1, [10], 3000, 1000); // two more half-lives: 12.5, 5 + 10
    expect([...d.counts]).toEqual([12.5, 15]);
    // a clock that goes back decays nothing
    d.add(0, [1], 2000, 1000);
    expect([...d.counts]).toEqual([13.5, 15]);
    expect(d.at).toBe(3000);
  });

  it("targets and values follow the README's worked example", () => {
    const p = demandPolicy();
    // f64 reference, written out: h = n (d + prior) / (D + n prior)
    const h = [60, 20, 10, 10].map((d) => (4 * (d + 1)) / (100 + 4));
    expect(h.map((x) => hotness(x === h[0] ? 60 : x === h[1] ? 20 : 10, 100, 4, 1))).toEqual(h);
    expect(h.map((x) => targetReplicas(x, p))).toEqual([2, 1, 1, 1]);

    const m = market();
    m.addModel(EXAMPLE, T0);
    m.addCounts("ex", new Map([[0, [60, 20, 10, 10]]]), T0);
    m.register("w1", "ex", [0], [0, 1], T0);
    const ranges = m.demand(T0);
    expect(ranges).toEqual([
      {
        model: "ex",
        layer: 0,
        experts: { start: 2, end: 4 },
        count: 2,
        target: 1,
        coverage: 0,
        pending: 0,
        missing: 1,
        hot: false,
        value: Math.round(2 * (100 + (h[2] as number)) * 1e6) / 1e6,
        bytes: 2 * MiB,
        bytesPerExpert: MiB,
        nExpert: 4,
      },
      {
        model: "ex",
        layer: 0,
        experts: { start: 0, end: 1 },
        count: 1,
        target: 2,
        coverage: 1,
        pending: 0,
        missing: 1,
        hot: true,
        value: Math.round((h[0] as number) * 1e6) / 1e6,
        bytes: MiB,
        bytesPerExpert: MiB,
        nExpert: 4,
      },
    ]);
    expect(ranges[0]?.value).toBe(200.846154);
    expect(ranges[1]?.value).toBe(2.346154);
  });

  it("treats a layer nobody reported as uniform, and caps targets at maxReplicas", () => {
    const m = market({ maxReplicas: 3, prior: 0 });
    m.addModel(EXAMPLE, T0);
    expect(m.coverage("ex", T0).targets).toEqual([[1, 1, 1, 1]]);
    m.addCounts("ex", new Map([[0, [1000, 0, 0, 0]]]), T0);
    // h = 4 for expert 0 (all the load), ceil(4/2) = 2; the others 0 -> 1
    expect(m.coverage("ex", T0).targets).toEqual([[2, 1, 1, 1]]);
    const hot = market({ maxReplicas: 3, prior: 0, hotLoad: 1 });
    hot.addModel(EXAMPLE, T0);
    hot.addCounts("ex", new Map([[0, [1000, 0, 0, 0]]]), T0);
    expect(hot.coverage("ex", T0).targets).toEqual([[3, 1, 1, 1]]);
  });

  it("refuses counts of a dense layer or of the wrong length", () => {
    const m = market();
    m.addModel(EXAMPLE, T0);
    expect(() => m.addCounts("ex", new Map([[1, [1, 2, 3, 4]]]), T0)).toThrow(/no routed experts/);
    expect(() => m.addCounts("ex", new Map([[0, [1, 2, 3]]]), T0)).toThrow(/has 4 experts/);
    expect(() => m.addCounts("ex", new Map([[0, [1, 2, 3, Number.NaN]]]), T0)).toThrow(/finite/);
    expect(m.coverage("ex", T0).load).toEqual([[1, 1, 1, 1]]);
  });
});

describe("claims and leases", () => {
  const TWO: MarketModel = {
    id: "two",
    layers: [
      { layer: 1, nExpert: 8, bytesPerExpert: MiB },
      { layer: 2, nExpert: 8, bytesPerExpert: 2 * MiB },
    ],
  };

  it("grants a lease, counts it as pending, and refuses a second claim of the same cells", () => {
    const m = market();
    m.addModel(TWO, T0);
    const lease = m.claim(
      {
        worker: "a",
        model: "two",
        layers: { start: 1, end: 3 },
        experts: { start: 0, end: 4 },
        capacity: cap(12 * MiB),
      },
      T0,
    );
    expect(lease).toMatchObject({
      id: "lease-1",
      worker: "a",
      bytes: 12 * MiB,
      grantedAt: T0,
      expiresAt: T0 + 120_000,
    });
    expect(m.coverage("two", T0).pending).toEqual([
      [1, 1, 1, 1, 0, 0, 0, 0],
      [1, 1, 1, 1, 0, 0, 0, 0],
    ]);
    let error: unknown;
    try {
      m.claim(
        {
          worker: "b",
          model: "two",
          layers: { start: 2, end: 3 },
          experts: { start: 3, end: 6 },
          capacity: cap(64 * MiB),
        },
        T0 + 5000,
      );
    } catch (e) {
      error = e;
    }
    expect(isMoeswarmHubConflict(error, "leased")).toBe(true);
    expect((error as { details: Record<string, unknown> }).details).toMatchObject({
      reason: "leased",
      cells: [{ layer: 2, experts: "3:4" }],
      retryAfterMs: 115_000,
    });
    // what is still free can be claimed
    const b = m.claim(
      {
        worker: "b",
        model: "two",
        layers: { start: 2, end: 3 },
        experts: { start: 4, end: 6 },
        capacity: cap(64 * MiB),
      },
      T0,
    );
    expect(b.bytes).toBe(4 * MiB);
  });

  it("refuses a slice over capacity, and cells live workers already cover to target", () => {
    const m = market();
    m.addModel(TWO, T0);
    const claim = (worker: string, experts: [number, number], bytes: number) =>
      m.claim(
        {
          worker,
          model: "two",
          layers: { start: 1, end: 2 },
          experts: { start: experts[0], end: experts[1] },
          capacity: cap(bytes),
        },
        T0,
      );
    expect(() => claim("a", [0, 4], 4 * MiB - 1)).toThrow(/more than the/);
    try {
      claim("a", [0, 4], 4 * MiB - 1);
    } catch (e) {
      expect(isMoeswarmHubConflict(e, "capacity")).toBe(true);
    }
    m.register("w", "two", [1], [2, 3], T0);
    try {
      claim("a", [0, 4], 4 * MiB);
      expect.unreachable();
    } catch (e) {
      expect(isMoeswarmHubConflict(e, "covered")).toBe(true);
      expect((e as { details: Record<string, unknown> }).details.cells).toEqual([
        { layer: 1, experts: "2:4" },
      ]);
    }
    // a worker never claims cells it already serves (a second replica on one machine adds nothing)
    const own = (experts: [number, number], bytes: number) =>
      m.claim(
        {
          worker: "w",
          model: "two",
          layers: { start: 1, end: 2 },
          experts: { start: experts[0], end: experts[1] },
          capacity: cap(bytes),
        },
        T0,
      );
    try {
      own([0, 8], 64 * MiB);
      expect.unreachable();
    } catch (e) {
      expect(isMoeswarmHubConflict(e, "held")).toBe(true);
      expect((e as { details: Record<string, unknown> }).details.cells).toEqual([
        { layer: 1, experts: "2:4" },
      ]);
    }
    // what it holds counts against the capacity it declares: 2 MiB registered + 4 MiB > 5 MiB
    try {
      own([4, 8], 5 * MiB);
      expect.unreachable();
    } catch (e) {
      expect(isMoeswarmHubConflict(e, "capacity")).toBe(true);
      expect((e as { details: Record<string, unknown> }).details).toMatchObject({
        bytes: 4 * MiB,
        capacity: 5 * MiB,
        held: 2 * MiB,
      });
    }
    expect(own([4, 8], 6 * MiB).bytes).toBe(4 * MiB);
  });

  it("sizes a GPU worker's claims by its device memory, a CPU worker's by host memory", () => {
    const m = market();
    m.addModel(TWO, T0);
    const claim = (worker: string, experts: [number, number], capacity: Record<string, unknown>) =>
      m.claim(
        {
          worker,
          model: "two",
          layers: { start: 1, end: 2 },
          experts: { start: experts[0], end: experts[1] },
          capacity,
        },
        T0,
      );
    // 64 MiB of RAM does not make room on a 3 MiB GPU: the 4 MiB slice is refused for capacity
    for (const backend of ["cuda", "vulkan", "CUDA"]) {
      try {
        claim("g", [0, 4], { ramBytes: 64 * MiB, vramBytes: 3 * MiB, backend });
        expect.unreachable();
      } catch (e) {
        expect(isMoeswarmHubConflict(e, "capacity")).toBe(true);
        expect((e as { details: Record<string, unknown> }).details).toMatchObject({ capacity: 3 * MiB });
      }
    }
    expect(claim("g", [0, 4], { ramBytes: MiB, vramBytes: 4 * MiB, backend: "cuda" }).bytes).toBe(4 * MiB);
    // a CPU worker computes from host memory: ram + vram, as before device memory was counted apart
    expect(claim("c", [4, 8], { ramBytes: 3 * MiB, vramBytes: MiB, backend: "cpu" }).bytes).toBe(4 * MiB);
  });

  it("checks ranges against the model: dense layers, expert bounds, unknown models", () => {
    const m = market();
    m.addModel(TWO, T0);
    const base = { worker: "a", model: "two", capacity: cap(1 << 30) };
    expect(() =>
      m.claim({ ...base, layers: { start: 0, end: 2 }, experts: { start: 0, end: 1 } }, T0),
    ).toThrow(expect.objectContaining({ code: "MOESWARM_GGUF_NOT_MOE" }));
    expect(() =>
      m.claim({ ...base, layers: { start: 1, end: 2 }, experts: { start: 0, end: 9 } }, T0),
    ).toThrow(expect.objectContaining({ code: "MOESWARM_INVALID_RANGE" }));
    expect(() =>
      m.claim({ ...base, model: "nope", layers: { start: 1, end: 2 }, experts: { start: 0, end: 1 } }, T0),
    ).toThrow(expect.objectContaining({ code: "MOESWARM_HUB_NOT_FOUND" }));
    expect(() =>
      m.claim({ ...base, worker: "", layers: { start: 1, end: 2 }, experts: { start: 0, end: 1 } }, T0),
    ).toThrow(expect.objectContaining({ code: "MOESWARM_INVALID_ARGUMENT" }));
    expect(() =>
      m.claim(
        { ...base, capacity: { ramBytes: -1 }, layers: { start: 1, end: 2 }, experts: { start: 0, end: 1 } },
        T0,
      ),
    ).toThrow(/ramBytes/);
    expect(() =>
      m.claim(
        { ...base, ttlMs: 10 * 3_600_000, layers: { start: 1, end: 2 }, experts: { start: 0, end: 1 } },
        T0,
      ),
    ).toThrow(/ttlMs/);
    expect(m.leases()).toEqual([]);
  });

  it("expires, renews, releases, and fulfils leases by registration", () => {
    const m = market({ leaseTtlMs: 1000 });
    m.addModel(TWO, T0);
    const claim = (worker: string, start: number, end: number, now: number) =>
      m.claim(
        {
          worker,
          model: "two",
          layers: { start: 1, end: 2 },
          experts: { start, end },
          capacity: cap(1 << 30),
        },
        now,
      );
    const a = claim("a", 0, 2, T0);
    expect(m.renew(a.id, "a", T0 + 900).expiresAt).toBe(T0 + 1900);
    expect(() => m.renew(a.id, "b", T0 + 900)).toThrow(
      expect.objectContaining({ code: "MOESWARM_AUTH_ROLE" }),
    );
    expect(m.expire(T0 + 1899)).toEqual([]);
    expect(m.expire(T0 + 1900).map((l) => l.id)).toEqual([a.id]);
    expect(() => m.renew(a.id, "a", T0 + 1901)).toThrow(
      expect.objectContaining({ code: "MOESWARM_HUB_NOT_FOUND" }),
    );
    expect(m.coverage("two", T0 + 1901).pending[0]).toEqual([0, 0, 0, 0, 0, 0, 0, 0]);

    const b = claim("b", 2, 4, T0 + 2000);
    expect(m.release(b.id, undefined, T0 + 2001).id).toBe(b.id);
    expect(m.leases()).toEqual([]);

    const c = claim("c", 4, 6, T0 + 3000);
    // a registration that does not hold the whole lease leaves it pending
    expect(m.register("c", "two", [1], [4], T0 + 3100)).toEqual([]);
    expect(m.leases().map((l) => l.id)).toEqual([c.id]);
    expect(m.register("c", "two", [1], [3, 4, 5, 6], T0 + 3200).map((l) => l.id)).toEqual([c.id]);
    expect(m.leases()).toEqual([]);
    expect(m.coverage("two", T0 + 3200).replicas[0]).toEqual([0, 0, 0, 1, 1, 1, 1, 0]);
    const changes = m.takeChanges();
    expect(changes.deadLeases.sort()).toEqual([a.id, c.id].sort());
  });

  it("a new claim of the same worker and model replaces its lease", () => {
    const m = market();
    m.addModel(TWO, T0);
    const claim = (start: number, end: number) =>
      m.claim(
        {
          worker: "a",
          model: "two",
          layers: { start: 1, end: 2 },
          experts: { start, end },
          capacity: cap(1 << 30),
        },
        T0,
      );
    claim(0, 4);
    const second = claim(2, 6);
    expect(m.leases().map((l) => l.id)).toEqual([second.id]);
    expect(m.coverage("two", T0).pending[0]).toEqual([0, 0, 1, 1, 1, 1, 0, 0]);
  });

  it("drain and disconnect withdraw coverage; register ends a drain", () => {
    const m = market();
    m.addModel(TWO, T0);
    m.register("w", "two", [1, 2], [0, 1], T0);
    const v1 = m.version("two");
    expect(m.summary("two", T0)).toMatchObject({ cells: 16, uncovered: 12 });
    m.drain("w", T0 + 1);
    expect(m.summary("two", T0)).toMatchObject({ uncovered: 16 });
    expect(m.placement("two").registrations).toEqual([]);
    const v2 = m.version("two");
    expect(v2).toBeGreaterThan(v1);
    m.register("w", "two", [1], [0, 1, 2], T0 + 2);
    expect(m.summary("two", T0)).toMatchObject({ uncovered: 13 });
    m.workerGone("w", T0 + 3);
    expect(m.summary("two", T0)).toMatchObject({ uncovered: 16 });
    expect(m.version("two")).toBeGreaterThan(v2);
  });

  it("auto-claim picks the most valuable slice that fits, uncovered before replicas", () => {
    const m = market();
    m.addModel(TWO, T0);
    // 5 MiB: five experts of layer 1 (1 MiB each), or two of layer 2 (2 MiB each); layer 1 is worth more
    const first = m.autoClaim({ worker: "a", capacity: cap(5 * MiB) }, T0);
    expect([first.layers, first.experts]).toEqual([
      { start: 1, end: 2 },
      { start: 0, end: 5 },
    ]);
    // 3 MiB per column over both layers: the largest block is 8 experts x 2 layers = 24 MiB
    const big = m.autoClaim({ worker: "b", capacity: cap(100 * MiB) }, T0);
    expect([big.layers, big.experts]).toEqual([
      { start: 2, end: 3 },
      { start: 0, end: 8 },
    ]);
    const rest = m.autoClaim({ worker: "c", capacity: cap(100 * MiB) }, T0);
    expect([rest.layers, rest.experts]).toEqual([
      { start: 1, end: 2 },
      { start: 5, end: 8 },
    ]);
    expect(() => m.autoClaim({ worker: "d", capacity: cap(100 * MiB) }, T0)).toThrow(
      expect.objectContaining({ code: "MOESWARM_HUB_CONFLICT", details: { reason: "covered" } }),
    );
    // a hot expert wants a second replica: auto finds it
    m.addCounts("two", new Map([[1, [0, 0, 0, 900, 0, 0, 0, 0]]]), T0);
    const replica = m.autoClaim({ worker: "d", capacity: cap(100 * MiB) }, T0);
    expect([replica.layers, replica.experts]).toEqual([
      { start: 1, end: 2 },
      { start: 3, end: 4 },
    ]);
    const small = market();
    small.addModel(TWO, T0);
    expect(() => small.autoClaim({ worker: "e", capacity: cap(MiB - 1) }, T0)).toThrow(
      expect.objectContaining({ details: expect.objectContaining({ reason: "capacity" }) }),
    );
  });
});
