import type { CombineWasm } from "./combine-wasm.js";

// The slot combine of combine.ts driven through the WebAssembly module: per token, the filled
// slots' rows are copied into the module's memory (WebAssembly reads only its own memory), combined
// there four lanes at a time, and the row copied back. The copies are memcpy (TypedArray.set);
// at n_embd 3072, k 8 the copy in and out plus the SIMD pass take well under the JS loop's time
// (`pnpm bench combine`).
//
// Memory layout (byte addresses), rebuilt per call: the output row at 0, the weights at `stride`,
// the slot rows from `yBase`, each `stride` bytes (n_embd rounded up to 4 lanes; the padding lanes
// are computed and never read back).

const PAGE = 65536;

/**
 * `out[i]` = llama.cpp's f32 combine of token i's filled slots (`src[s]` at `off[s]` for slot
 * `s = i*k + j`); a token with no filled slot keeps its row.
 */
export function combineSlotsWasm(
  wasm: CombineWasm,
  out: Float32Array,
  n: number,
  k: number,
  embd: number,
  weights: Float32Array,
  slots: { readonly src: (Float32Array | undefined)[]; readonly off: Float64Array },
): void {
  const { src, off } = slots;
  const strideF = (embd + 3) & ~3;
  const stride = strideF * 4;
  const wBase = stride;
  const yBase = wBase + ((k * 4 + 15) & ~15);
  const need = yBase + k * stride;
  const memory = wasm.memory;
  if (memory.buffer.byteLength < need) memory.grow(Math.ceil((need - memory.buffer.byteLength) / PAGE));
  // after a grow the old buffer is detached: views made now
  const heap = new Float32Array(memory.buffer, 0, need >> 2);
  const wAt = wBase >> 2;
  const yAt = yBase >> 2;
  for (let i = 0; i < n; i++) {
    let count = 0;
    // a run of slots that lie one after the other in one source (a mode-"each" part's rows, when
    // n_embd is a multiple of 4) is copied with one set
    let runSrc: Float32Array | undefined;
    let runFrom = 0;
    let runEnd = 0;
    let runAt = 0;
    for (let j = 0; j < k; j++) {
      const s = i * k + j;
      const y = src[s];
      if (y === undefined) continue;
      const yo = off[s] as number;
      heap[wAt + count] = weights[s] as number;
      if (y === runSrc && yo === runEnd && strideF === embd) {
        runEnd += embd;
      } else {
        if (runSrc !== undefined) heap.set(runSrc.subarray(runFrom, runEnd), runAt);
        runSrc = y;
        runFrom = yo;
        runEnd = yo + embd;
        runAt = yAt + count * strideF;
      }
      count++;
    }
    if (runSrc === undefined) continue;
    heap.set(runSrc.subarray(runFrom, runEnd), runAt);
    wasm.combine(0, yBase, wBase, count, stride);
    out.set(heap.subarray(0, embd), i * embd);
  }
}
