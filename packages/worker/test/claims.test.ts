// pickClaim: the cache says where a slice's bytes come from, never which slice is claimed.
import { describe, expect, it } from "vitest";
import type { SliceChoice } from "../src/choose.js";
import { pickClaim } from "../src/claims.js";
import type { CachedSlice } from "../src/slice-cache.js";

const M = "m";
function choice(l0: number, l1: number, e0: number, e1: number, value: number, whole = false): SliceChoice {
  const bytes = (l1 - l0) * (e1 - e0);
  return {
    model: M,
    layers: { start: l0, end: l1 },
    experts: { start: e0, end: e1 },
    bytes,
    value,
    valuePerByte: value / bytes,
    whole,
  };
}
function cached(l0: number, l1: number, e0: number, e1: number, savedAt: number): CachedSlice {
  const path = `/c/${M}/${l0}-${l1}_${e0}-${e1}.gguf`;
  return {
    model: M,
    layers: { start: l0, end: l1 },
    experts: { start: e0, end: e1 },
    path,
    metaPath: path.replace(/gguf$/, "json"),
    meta: {
      model: M,
      layers: `${l0}:${l1}`,
      experts: `${e0}:${e1}`,
      fileBytes: (l1 - l0) * (e1 - e0),
      savedAt,
    },
  };
}
const rect = (p: ReturnType<typeof pickClaim>) =>
  p &&
  `${p.layers.start}:${p.layers.end}x${p.experts.start}:${p.experts.end} ${p.kind} ${p.cached ? "c" : "-"}`;

describe("pickClaim", () => {
  const wholeL0 = choice(0, 1, 0, 64, 6400, true);
  const wholeL1 = choice(1, 2, 0, 64, 6400, true);
  const part = choice(2, 3, 0, 16, 1600);
  const smalls = Array.from({ length: 50 }, (_, i) => cached(i % 4, (i % 4) + 1, i, i + 1, 1000 - i));

  it("downloads the best choice rather than re-claiming many small cached slices", () => {
    expect(rect(pickClaim([wholeL0, wholeL1, part], smalls, { fresh: true }))).toBe("0:1x0:64 demand -");
    expect(rect(pickClaim([wholeL0, wholeL1, part], smalls, { fresh: false }))).toBe("0:1x0:64 demand -");
  });

  it("reuses the cached bytes of the best choice, or of a choice of its shape", () => {
    expect(rect(pickClaim([wholeL0, wholeL1], [...smalls, cached(0, 1, 0, 64, 1)], { fresh: false }))).toBe(
      "0:1x0:64 demand c",
    );
    expect(rect(pickClaim([wholeL0, wholeL1], [...smalls, cached(1, 2, 0, 64, 1)], { fresh: false }))).toBe(
      "1:2x0:64 cached-same-shape c",
    );
    // a part-layer choice is not the shape of a whole layer
    expect(rect(pickClaim([wholeL0, part], [cached(2, 3, 0, 16, 1)], { fresh: false }))).toBe(
      "0:1x0:64 demand -",
    );
  });

  it("first in a run: the previous run's largest slice when the demand offers nothing as large", () => {
    // its own leases still count in the demand: nothing offered, the whole layer it held is claimed back
    const c = [...smalls, cached(3, 4, 0, 64, 1)];
    expect(rect(pickClaim([], c, { fresh: true }))).toBe("3:4x0:64 cached-fresh c");
    expect(rect(pickClaim([part], c, { fresh: true }))).toBe("3:4x0:64 cached-fresh c");
    expect(pickClaim([], c, { fresh: false })).toBeUndefined();
    // already tried (refused): not again
    expect(rect(pickClaim([part], c, { fresh: true, tried: new Set([c.at(-1)!.path]) }))).toBe(
      "2:3x0:16 demand -",
    );
  });
});
