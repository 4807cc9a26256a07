import { describe, expect, it } from "vitest";
import { chooseSlices, type DemandRangeInput, type SliceChoice } from "../src/choose.js";

const M = "m";

function range(
  layer: number,
  experts: string,
  valuePerExpert: number,
  bytesPerExpert = 1000,
): DemandRangeInput {
  const [a, b] = experts.split(":").map(Number) as [number, number];
  return { model: M, layer, experts, value: valuePerExpert * (b - a), bytesPerExpert };
}

function uncoveredModel(layers: number, experts: number, bytesPerExpert = 1000): DemandRangeInput[] {
  return Array.from({ length: layers }, (_, l) => range(l, `0:${experts}`, 101, bytesPerExpert));
}

function brief(c: SliceChoice | undefined) {
  return c && `${c.model} L${c.layers.start}:${c.layers.end} E${c.experts.start}:${c.experts.end}`;
}

/**
 * An independent reference: every rectangle (consecutive layers x consecutive experts) whose
 * cells are all in demand and whose bytes fit, valued cell by cell.
 */
function bruteForce(
  ranges: DemandRangeInput[],
  capacity: number,
): { value: number; bytes: number } | undefined {
  const cell = new Map<string, number>();
  const bpe = new Map<number, number>();
  let maxLayer = -1;
  let maxExpert = 0;
  for (const r of ranges) {
    const [a, b] = r.experts.split(":").map(Number) as [number, number];
    for (let e = a; e < b; e++) cell.set(`${r.layer}/${e}`, r.value / (b - a));
    bpe.set(r.layer, r.bytesPerExpert);
    maxLayer = Math.max(maxLayer, r.layer);
    maxExpert = Math.max(maxExpert, b);
  }
  let best: { value: number; bytes: number } | undefined;
  for (let l0 = 0; l0 <= maxLayer; l0++) {
    for (let l1 = l0 + 1; l1 <= maxLayer + 1; l1++) {
      for (let e0 = 0; e0 < maxExpert; e0++) {
        for (let e1 = e0 + 1; e1 <= maxExpert; e1++) {
          let value = 0;
          let bytes = 0;
          let ok = true;
          for (let l = l0; l < l1 && ok; l++) {
            for (let e = e0; e < e1; e++) {
              const v = cell.get(`${l}/${e}`);
              if (v === undefined) {
                ok = false;
                break;
              }
              value += v;
              bytes += bpe.get(l) as number;
            }
          }
          if (!ok || bytes > capacity) continue;
          if (
            !best ||
            value > best.value + 1e-9 ||
            (Math.abs(value - best.value) <= 1e-9 && bytes < best.bytes)
          ) {
            best = { value, bytes };
          }
        }
      }
    }
  }
  return best;
}

describe("chooseSlices", () => {
  it("takes nothing when nothing is in demand or nothing fits", () => {
    expect(chooseSlices([], 1e9)).toEqual([]);
    expect(chooseSlices(uncoveredModel(2, 8), 999)).toEqual([]);
  });

  it("takes a whole uncovered layer that fits, and the first experts of it when only part fits", () => {
    const ranges = uncoveredModel(4, 64);
    expect(brief(chooseSlices(ranges, 64_000)[0])).toBe("m L0:1 E0:64");
    const part = chooseSlices(ranges, 32_500)[0] as SliceChoice;
    expect(brief(part)).toBe("m L0:1 E0:32");
    expect(part.bytes).toBe(32_000);
    expect(part.value).toBe(32 * 101);
  });

  it("fills its capacity across consecutive layers, preferring fewer layers on a tie", () => {
    const ranges = uncoveredModel(4, 64);
    // 128 cells either as 2 layers x 64 or 4 layers x 32: the same value and bytes
    expect(brief(chooseSlices(ranges, 128_000)[0])).toBe("m L0:2 E0:64");
    // 3 layers x 42 = 126 cells < 128: still two whole layers; one byte more, 3 x 43 = 129 wins
    expect(brief(chooseSlices(ranges, 128_999)[0])).toBe("m L0:2 E0:64");
    expect(brief(chooseSlices(ranges, 129_000)[0])).toBe("m L0:3 E0:43");
    // a layer held by someone else splits the model: rectangles never cross it
    const gap = ranges.filter((r) => r.layer !== 1);
    expect(brief(chooseSlices(gap, 128_000)[0])).toBe("m L2:4 E0:64");
  });

  it("ranks by the value added, not by value per byte alone", () => {
    // two hot experts worth more per byte, or ten uncovered ones worth more in all
    const ranges = [range(0, "0:2", 150), range(1, "0:10", 101)];
    const roomy = chooseSlices(ranges, 10_000);
    expect(brief(roomy[0])).toBe("m L1:2 E0:10");
    expect((roomy[0] as SliceChoice).value).toBe(1010);
    // with room for two experts only, the hot pair wins
    expect(brief(chooseSlices(ranges, 2_000)[0])).toBe("m L0:1 E0:2");
  });

  it("breaks equal value by value per byte: the cheaper download wins", () => {
    // room for one layer's pair: 200 either way, for 2000 bytes (layer 0), 1000 (layer 1) or
    // 1500 (one expert of both layers)
    const ranges = [range(0, "0:2", 100, 1000), range(1, "0:2", 100, 500)];
    const [first, second, third] = chooseSlices(ranges, 2_000);
    expect(brief(first)).toBe("m L1:2 E0:2");
    expect(first?.valuePerByte).toBeCloseTo(0.2, 12);
    expect(brief(second)).toBe("m L0:2 E0:1");
    expect(brief(third)).toBe("m L0:1 E0:2");
  });

  it("slides to the hottest window of a layer", () => {
    // experts 10 and 11 are uncovered and hot (value 200 each), 0..9 uncovered (101)
    const ranges = [range(0, "0:10", 101), range(0, "10:12", 200)];
    const c = chooseSlices(ranges, 4_000)[0] as SliceChoice;
    expect(brief(c)).toBe("m L0:1 E8:12");
    expect(c.value).toBe(2 * 101 + 2 * 200);
  });

  it("never returns a slice over the capacity, and agrees with brute force on random demand", () => {
    let seed = 7;
    const rand = () => {
      seed = (seed * 1103515245 + 12345) >>> 0;
      return seed / 2 ** 32;
    };
    for (let trial = 0; trial < 200; trial++) {
      const ranges: DemandRangeInput[] = [];
      const layers = 1 + Math.floor(rand() * 4);
      for (let l = 0; l < layers; l++) {
        const bpe = 100 * (1 + Math.floor(rand() * 4));
        let e = 0;
        while (e < 12) {
          const len = 1 + Math.floor(rand() * 5);
          const end = Math.min(12, e + len);
          if (rand() < 0.7) ranges.push(range(l, `${e}:${end}`, 1 + Math.floor(rand() * 200), bpe));
          e = end;
        }
      }
      const capacity = Math.floor(rand() * 3000);
      const choices = chooseSlices(ranges, capacity, { limit: 100 });
      for (const c of choices) {
        expect(c.bytes).toBeLessThanOrEqual(capacity);
        expect(c.valuePerByte).toBeCloseTo(c.value / c.bytes, 12);
      }
      const ref = bruteForce(ranges, capacity);
      if (!ref) {
        expect(choices).toEqual([]);
        continue;
      }
      expect(choices[0]?.value).toBeCloseTo(ref.value, 9);
    }
  });

  it("never chooses cells the worker already holds", () => {
    const ranges = [range(0, "0:8", 150), range(1, "0:8", 101)];
    // it serves layer 0 experts 2:6 already (their second replica is what the demand lists)
    const exclude = [{ model: M, layers: { start: 0, end: 1 }, experts: { start: 2, end: 6 } }];
    expect(brief(chooseSlices(ranges, 4_000)[0])).toBe("m L0:1 E0:4");
    const choices = chooseSlices(ranges, 4_000, { exclude, limit: 100 });
    // the best left: experts 0:2 of both layers (2 x (150 + 101)) beats layer 1's 0:4 (4 x 101)
    expect(brief(choices[0])).toBe("m L0:2 E0:2");
    expect(choices[0]?.value).toBe(502);
    for (const c of choices) {
      const overlaps = c.layers.start <= 0 && c.experts.start < 6 && c.experts.end > 2;
      expect(overlaps, brief(c)).toBe(false);
    }
    // another model's rectangle excludes nothing here
    expect(brief(chooseSlices(ranges, 4_000, { exclude: [{ ...exclude[0]!, model: "other" }] })[0])).toBe(
      "m L0:1 E0:4",
    );
  });

  /**
   * Workers of `capacity` bytes that keep choosing from the demand list (the uncovered cells of a
   * 4 x 64 model, as runs per layer) while they have room, taking turns; returns their slices.
   */
  function fill(workers: number, capacity: number, bytesPerExpert: number): Map<number, SliceChoice[]> {
    const covered = Array.from({ length: 4 }, () => new Uint8Array(64));
    const held = new Map<number, SliceChoice[]>();
    const full = new Set<number>();
    while (full.size < workers) {
      for (let w = 0; w < workers; w++) {
        if (full.has(w)) continue;
        const ranges: DemandRangeInput[] = [];
        for (let l = 0; l < 4; l++) {
          let e = 0;
          while (e < 64) {
            if (covered[l]![e]) {
              e++;
              continue;
            }
            const start = e;
            while (e < 64 && !covered[l]![e]) e++;
            ranges.push(range(l, `${start}:${e}`, 101, bytesPerExpert));
          }
        }
        const mine = held.get(w) ?? [];
        const left = capacity - mine.reduce((n, c) => n + c.bytes, 0);
        const [c] = chooseSlices(ranges, left, { limit: 1, exclude: mine });
        if (!c) {
          full.add(w);
          continue;
        }
        for (let l = c.layers.start; l < c.layers.end; l++)
          covered[l]!.fill(1, c.experts.start, c.experts.end);
        held.set(w, [...mine, c]);
      }
    }
    expect(covered.every((row) => row.every((x) => x === 1))).toBe(true);
    return held;
  }

  it("keeps choosing while room is left: two workers with 15% slack cover the small model", () => {
    const bpe = 209_920; // qwen3moe "small": 13.4 MB per layer of 64 experts
    const held = fill(2, Math.ceil(((256 * bpe) / 2) * 1.15), bpe);
    expect(held.get(0)?.map(brief)).toEqual(["m L0:3 E0:49"]);
    expect(held.get(1)?.map(brief)).toEqual(["m L3:4 E0:64", "m L0:3 E49:64"]);
  });

  it("covers the model with 1..8 equal workers of 15% slack each", () => {
    const bpe = 209_920;
    for (let n = 1; n <= 8; n++) {
      const held = fill(n, Math.ceil(((256 * bpe) / n) * 1.15), bpe);
      const cells = [...held.values()].flat().reduce((sum, c) => sum + c.bytes / bpe, 0);
      expect(cells, `${n} workers`).toBe(256);
    }
  });

  it("skips ranges it cannot read and validates the capacity", () => {
    const bad = [
      { model: M, layer: 0, experts: "nope", value: 5, bytesPerExpert: 10 },
      { model: M, layer: -1, experts: "0:1", value: 5, bytesPerExpert: 10 },
      { model: M, layer: 0, experts: "0:1", value: 5, bytesPerExpert: 0 },
    ];
    expect(chooseSlices(bad, 1000)).toEqual([]);
    expect(() => chooseSlices([], Number.NaN)).toThrow(/capacityBytes/);
  });
});

describe("chooseSlices: whole layers first", () => {
  // 4 layers x 64 experts, the hub listing each layer's expert count
  const whole = (layers: number) => uncoveredModel(layers, 64).map((r) => ({ ...r, nExpert: 64 }));

  it("takes whole layers over a larger part-layer rectangle worth less than twice as much", () => {
    // room for 147 experts: 3 layers x 49 experts (147 cells) or 2 whole layers (128 cells)
    const [c] = chooseSlices(whole(4), 147 * 1000, { limit: 1 });
    expect(brief(c)).toBe("m L0:2 E0:64");
    expect(c?.whole).toBe(true);
  });

  it("without the hub's expert counts it ranks by value alone, as before", () => {
    const [c] = chooseSlices(uncoveredModel(4, 64), 147 * 1000, { limit: 1 });
    expect(brief(c)).toBe("m L0:3 E0:49");
    expect(c?.whole).toBe(false);
  });

  it("a part-layer slice worth more than twice the whole layer wins (hot experts)", () => {
    // experts 0:16 of every layer are hot; room for 64 experts: one whole layer (16 hot + 48 cold)
    // or the hot strip of 4 layers (64 hot)
    const ranges = [0, 1, 2, 3].flatMap((l) => [
      { ...range(l, "0:16", 1000), nExpert: 64 },
      { ...range(l, "16:64", 101), nExpert: 64 },
    ]);
    const [c] = chooseSlices(ranges, 64 * 1000, { limit: 1 });
    expect(brief(c)).toBe("m L0:4 E0:16");
    expect(c?.whole).toBe(false);
  });

  it("a worker smaller than a layer gets the widest run, as before", () => {
    const [c] = chooseSlices(whole(4), 40 * 1000, { limit: 1 });
    expect(brief(c)).toBe("m L0:1 E0:40");
  });
});
