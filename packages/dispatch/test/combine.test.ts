import fc from "fast-check";
import { describe, expect, it } from "vitest";
import { combineSlotsF32, combineSlotsF32Js, combineSlotsF64, type SlotSources } from "../src/combine.js";
import { combineSlotsWasm } from "../src/combine-slots-wasm.js";
import { combineBackend, combineModuleBytes, combineWasm } from "../src/combine-wasm.js";

// The fast combines (WebAssembly SIMD, the reshaped JS loop) against the combine as it was before
// (copied here unchanged as the reference), bit for bit, and against an f64 sum within rounding.

/** The combine before issue #15, verbatim: the reference for the bits. */
function combineBefore(
  out: Float32Array,
  n: number,
  k: number,
  embd: number,
  weights: Float32Array,
  slots: SlotSources<Float32Array>,
): void {
  for (let i = 0; i < n; i++) {
    const o = i * embd;
    let first = true;
    for (let j = 0; j < k; j++) {
      const s = i * k + j;
      const y = slots.src[s];
      if (y === undefined) continue;
      const w = weights[s]!;
      const yo = slots.off[s]!;
      if (first) {
        for (let c = 0; c < embd; c++) out[o + c] = w * y[yo + c]!;
        first = false;
      } else {
        for (let c = 0; c < embd; c++) out[o + c]! += Math.fround(w * y[yo + c]!);
      }
    }
  }
}

/** Bit equality, except that any NaN equals any NaN (WebAssembly leaves NaN payloads open). */
function firstBitDifference(a: Float32Array, b: Float32Array): number {
  const ua = new Uint32Array(a.buffer, a.byteOffset, a.length);
  const ub = new Uint32Array(b.buffer, b.byteOffset, b.length);
  for (let i = 0; i < a.length; i++) {
    if (ua[i] !== ub[i] && !(Number.isNaN(a[i]) && Number.isNaN(b[i]))) return i;
  }
  return a.length === b.length ? -1 : Math.min(a.length, b.length);
}

// f32 values from every corner: ±0, subnormals, the extremes of the normal range, ordinary ones
const special = [0, -0, 1e-45, -1e-45, 1.1754942e-38, 1.1754944e-38, 3.4028235e38, -3.4028235e38, 1, -1];
const f32Value = fc.oneof(
  { weight: 3, arbitrary: fc.float({ noNaN: true, noDefaultInfinity: true }) },
  { weight: 3, arbitrary: fc.float({ min: -4, max: 4, noNaN: true }) },
  { weight: 1, arbitrary: fc.constantFrom(...special) },
  // subnormals
  {
    weight: 1,
    arbitrary: fc.float({ min: Math.fround(-1.1754942e-38), max: Math.fround(1.1754942e-38), noNaN: true }),
  },
);

/** A combine problem: n tokens, k slots, some slots empty, sources in one or several arrays. */
const problem = fc
  .record({
    n: fc.integer({ min: 1, max: 64 }),
    k: fc.integer({ min: 1, max: 8 }),
    embd: fc.integer({ min: 1, max: 67 }),
    seed: fc.integer(),
    parts: fc.integer({ min: 1, max: 3 }),
  })
  .chain(({ n, k, embd, seed, parts }) =>
    fc.record({
      n: fc.constant(n),
      k: fc.constant(k),
      embd: fc.constant(embd),
      parts: fc.constant(parts),
      seed: fc.constant(seed),
      weights: fc.array(f32Value, { minLength: n * k, maxLength: n * k }),
      values: fc.array(f32Value, { minLength: 1, maxLength: 256 }),
      missing: fc.array(fc.boolean(), { minLength: n * k, maxLength: n * k }),
    }),
  )
  .map(({ n, k, embd, parts, weights, values, missing }) => {
    // each part holds the mode-"each" layout [n x k x embd]; slot s reads part s % parts, so runs
    // of consecutive slots in one source occur (parts 1) and do not (parts > 1)
    const arrays = Array.from({ length: parts }, (_, p) =>
      Float32Array.from({ length: n * k * embd }, (_, i) => values[(i * 7 + p * 13) % values.length]!),
    );
    const src: (Float32Array | undefined)[] = new Array(n * k);
    const off = new Float64Array(n * k);
    for (let s = 0; s < n * k; s++) {
      if (missing[s]) continue;
      src[s] = arrays[s % parts];
      off[s] = s * embd;
    }
    return { n, k, embd, weights: Float32Array.from(weights), slots: { src, off } };
  });

type Problem = {
  n: number;
  k: number;
  embd: number;
  weights: Float32Array;
  slots: SlotSources<Float32Array>;
};
type Combine = typeof combineBefore;

function run(combine: Combine, p: Problem): Float32Array {
  // a recognisable prior content: a token with no filled slot keeps it
  const out = new Float32Array(p.n * p.embd).fill(7);
  combine(out, p.n, p.k, p.embd, p.weights, p.slots);
  return out;
}

const wasm = combineWasm();
const viaWasm: Combine = (out, n, k, embd, weights, slots) => {
  if (!wasm) throw new Error("no WebAssembly SIMD");
  combineSlotsWasm(wasm, out, n, k, embd, weights, slots);
};

describe("the f32 combine: the same bits as before #15", () => {
  it("uses WebAssembly SIMD on Node 20 (the module compiles)", () => {
    expect(combineModuleBytes().length).toBeLessThan(256);
    expect(wasm).not.toBeNull();
    expect(combineBackend()).toBe("wasm-simd");
  });

  for (const [label, combine] of [
    ["WebAssembly SIMD", viaWasm],
    ["the JS fallback", combineSlotsF32Js],
    ["combineSlotsF32 (the path in use)", combineSlotsF32],
  ] as const) {
    it(`${label} equals the old JS combine bit for bit`, () => {
      fc.assert(
        fc.property(problem, (p) => {
          const want = run(combineBefore, p);
          const got = run(combine, p);
          expect(firstBitDifference(got, want)).toBe(-1);
        }),
        { numRuns: 300 },
      );
    });
  }

  it("keeps -0 from slot 0's product and subnormal sums (no flush to zero)", () => {
    const embd = 5;
    const y = Float32Array.from([-0, 1e-45, 1.4e-44, -2e-45, 3, /* slot 1 */ -0, 1e-45, -1.4e-44, 2e-45, -3]);
    const weights = Float32Array.from([1, 1]);
    const slots = { src: [y, y], off: Float64Array.from([0, embd]) };
    const out = run(viaWasm, { n: 1, k: 2, embd, weights, slots });
    const bits = new Uint32Array(out.buffer);
    expect(bits[0]).toBe(0x80000000); // -0 + -0 = -0
    expect(out[1]).toBe(2 * 1.401298464324817e-45); // two smallest subnormals
    expect(out[2]).toBe(0);
    expect(out[3]).toBe(0);
    expect(out[4]).toBe(0);
    const one = run(viaWasm, { n: 1, k: 1, embd, weights, slots: { src: [y], off: Float64Array.from([0]) } });
    expect(new Uint32Array(one.buffer)[0]).toBe(0x80000000); // 1 * -0, not 0 + -0
  });

  it("overflows to ±Infinity the same way (and NaN for Inf - Inf)", () => {
    const y = Float32Array.from([3e38, 3e38, /* slot 1 */ 3e38, -3e38, /* slot 2 */ -3e38, 0]);
    const weights = Float32Array.from([1, 1, 1]);
    const slots = { src: [y, y, y], off: Float64Array.from([0, 2, 4]) };
    const out = run(viaWasm, { n: 1, k: 3, embd: 2, weights, slots });
    expect(out[0]).toBe(Number.POSITIVE_INFINITY); // (3e38 + 3e38) + -3e38: Inf first, stays Inf
    expect(out[1]).toBe(0);
  });

  it("grows the module's memory for a wide row and keeps working after", () => {
    const embd = 20000; // 8 rows x 80 KB > one 64 KiB page
    const k = 8;
    const y = Float32Array.from({ length: k * embd }, (_, i) => Math.sin(i) * 100);
    const weights = Float32Array.from({ length: k }, (_, j) => 0.1 * (j + 1));
    const slots = { src: new Array(k).fill(y), off: Float64Array.from({ length: k }, (_, j) => j * embd) };
    const p = { n: 1, k, embd, weights, slots };
    expect(firstBitDifference(run(viaWasm, p), run(combineBefore, p))).toBe(-1);
    const small = { ...p, embd: 3, slots: { src: [y], off: Float64Array.from([0]) }, k: 1 };
    expect(firstBitDifference(run(viaWasm, small), run(combineBefore, small))).toBe(-1);
  });
});

describe("the f32 combine against the f64 oracle", () => {
  it("is within the rounding of k f32 products and sums", () => {
    fc.assert(
      fc.property(
        fc.integer({ min: 1, max: 8 }),
        fc.integer({ min: 1, max: 8 }),
        fc.integer({ min: 1, max: 67 }),
        fc.integer({ min: -60, max: 60 }),
        fc.integer(),
        (n, k, embd, scale, seed) => {
          let r = seed >>> 0;
          const rand = () => {
            r = (Math.imul(r, 1664525) + 1013904223) >>> 0;
            return r / 2 ** 32 - 0.5;
          };
          // magnitudes 2^-60 .. 2^60 around the chosen scale, both signs
          const y = Float32Array.from({ length: n * k * embd }, () => rand() * 2 ** (scale + 8 * rand()));
          const weights = Float32Array.from({ length: n * k }, () => Math.abs(rand()));
          const slots = {
            src: new Array(n * k).fill(y),
            off: Float64Array.from({ length: n * k }, (_, s) => s * embd),
          };
          const got = new Float32Array(n * embd);
          combineSlotsF32(got, n, k, embd, weights, slots);
          const want = new Float64Array(n * embd);
          combineSlotsF64(want, n, k, embd, weights, slots);
          for (let i = 0; i < n; i++) {
            for (let c = 0; c < embd; c++) {
              // each of the 2k-1 roundings errs by at most half an ulp of a value <= sum |w y|
              // (relative 2^-24), or by half the smallest subnormal where it underflows
              let mag = 0;
              for (let j = 0; j < k; j++) mag += Math.abs(weights[i * k + j]! * y[(i * k + j) * embd + c]!);
              const err = Math.abs(got[i * embd + c]! - want[i * embd + c]!);
              expect(err).toBeLessThanOrEqual(2 * k * (mag * 2 ** -24 + 2 ** -150));
            }
          }
        },
      ),
      { numRuns: 200 },
    );
  });
});
