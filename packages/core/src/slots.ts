import { InvalidArgumentError } from "./errors.js";

/** Shape of a dispatch: tokens, slots per token, embedding width. */
export interface SlotShape {
  n: number;
  k: number;
  embd: number;
}

/**
 * Reduces per-slot outputs (the "each" layout: n*k*embd, slot (i,j) at ((i*k)+j)*embd) to the
 * "sum" layout (n*embd) exactly as protocol v1 defines it, which is also how llama.cpp's
 * build_moe_ffn aggregates experts: for each token and element, each product w_ij*y_ij is rounded
 * to f32, and the products are added in f32 in slot order; the first non-empty slot starts the
 * sum (no addition to zero), empty slots (id -1) are skipped, and a token without any non-empty
 * slot gets +0.
 */
export function sumSlots(
  y: Float32Array,
  w: Float32Array,
  ids: Int32Array,
  shape: SlotShape,
  out: Float32Array = new Float32Array(shape.n * shape.embd),
): Float32Array {
  const { n, k, embd } = shape;
  if (
    !Number.isSafeInteger(n) ||
    !Number.isSafeInteger(k) ||
    !Number.isSafeInteger(embd) ||
    n < 0 ||
    k < 1 ||
    embd < 0 ||
    y.length !== n * k * embd ||
    w.length !== n * k ||
    ids.length !== n * k ||
    out.length !== n * embd
  ) {
    throw new InvalidArgumentError(
      `sumSlots: lengths y=${y.length}, w=${w.length}, ids=${ids.length}, out=${out.length} do not fit n=${n}, k=${k}, embd=${embd}`,
    );
  }
  for (let i = 0; i < n; i++) {
    const o = i * embd;
    let started = false;
    for (let j = 0; j < k; j++) {
      const s = i * k + j;
      if (ids[s] === -1) continue;
      const wij = w[s]!;
      const base = s * embd;
      // a Float32Array store rounds to f32; the f64 sum of two f32 values rounds to the same f32
      // as an f32 addition would (f64 has more than 2*24+2 bits), and so does the f64 product
      if (!started) {
        for (let e = 0; e < embd; e++) out[o + e] = wij * y[base + e]!;
      } else {
        for (let e = 0; e < embd; e++) out[o + e] = out[o + e]! + Math.fround(wij * y[base + e]!);
      }
      started = true;
    }
    if (!started) out.fill(0, o, o + embd);
  }
  return out;
}

/** How many of the slots are filled (id >= 0): the rows of a compact "each" result. */
export function filledSlots(ids: Int32Array): number {
  let filled = 0;
  for (let s = 0; s < ids.length; s++) if (ids[s]! >= 0) filled++;
  return filled;
}

/**
 * The compact layout of an "each" result (protocol section 5): the rows of the filled slots, in
 * slot order. `y` is the full layout (ids.length * embd); returned as is when every slot is filled.
 */
export function compactSlots(y: Float32Array, ids: Int32Array, embd: number): Float32Array {
  const filled = filledSlots(ids);
  if (y.length !== ids.length * embd) {
    throw new InvalidArgumentError(
      `compactSlots: y has ${y.length} values, ${ids.length} slots of ${embd} need ${ids.length * embd}`,
    );
  }
  if (filled === ids.length) return y;
  const out = new Float32Array(filled * embd);
  let row = 0;
  for (let s = 0; s < ids.length; s++) {
    if (ids[s]! < 0) continue;
    out.set(y.subarray(s * embd, (s + 1) * embd), row * embd);
    row++;
  }
  return out;
}

/**
 * The full "each" layout of a compact result: row r of `rows` goes to the r-th filled slot, empty
 * slots are zeros. `rows` must hold exactly one row per filled slot.
 */
export function expandSlots(rows: Float32Array, ids: Int32Array, embd: number): Float32Array {
  const filled = filledSlots(ids);
  if (rows.length !== filled * embd) {
    throw new InvalidArgumentError(
      `expandSlots: ${rows.length} values, ${filled} filled slots of ${embd} need ${filled * embd}`,
    );
  }
  const out = new Float32Array(ids.length * embd);
  let row = 0;
  for (let s = 0; s < ids.length; s++) {
    if (ids[s]! < 0) continue;
    out.set(rows.subarray(row * embd, (row + 1) * embd), s * embd);
    row++;
  }
  return out;
}
