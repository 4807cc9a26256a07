// The f32 combine of one token in WebAssembly SIMD, bit-identical to the JS combine in combine.ts
// (and so to llama.cpp's ggml_mul + ggml_add chain).
//
// Why the same bits: f32x4.mul and f32x4.add are IEEE-754 binary32 operations rounding to
// nearest-even with subnormals kept (the WebAssembly spec allows no flush-to-zero and no implicit
// fused multiply-add), and per lane they run in llama.cpp's order: slot 0's product itself, then
// each later slot's rounded product added left to right. JS gets the same numbers from
// `fround(w * y)` (the double product of two f32 is exact, rounded once) and an f64 add of two f32
// rounded by the Float32Array store (innocuous double rounding: 53 >= 2*24 + 2). Only NaN payloads
// may differ (a NaN's sign and payload bits are nondeterministic in WebAssembly); the combine
// reads only finite values (acceptResult refuses the rest), so a NaN can only come from an
// overflow to ±Infinity and is a NaN on either path.
//
// Why bytes written here rather than WAT compiled by a tool (wabt): the module is one function
// (176 bytes in all); a build-time compiler would be a devDependency and a build step that the tests, which
// import sources, would have to run too, for less code than the WAT itself. The emitter below
// names every opcode (WebAssembly core spec 1.1 §5.4 and the SIMD proposal's opcode table).

// Instruction and section bytes (one name per byte used, spec §5).
const OP = {
  block: 0x02,
  loop: 0x03,
  end: 0x0b,
  br: 0x0c,
  brIf: 0x0d,
  localGet: 0x20,
  localSet: 0x21,
  localTee: 0x22,
  f32Load: 0x2a,
  i32Const: 0x41,
  i32GeU: 0x4f,
  i32Add: 0x6a,
  i32Shl: 0x74,
  simd: 0xfd,
  void: 0x40,
  i32: 0x7f,
  v128: 0x7b,
  func: 0x60,
} as const;
/** SIMD sub-opcodes (after 0xfd), LEB128-encoded. */
const SIMD = {
  v128Load: [0x00],
  v128Store: [0x0b],
  f32x4Splat: [0x13],
  f32x4Add: [0xe4, 0x01], // 228
  f32x4Mul: [0xe6, 0x01], // 230
} as const;

/** A section: its id, then its byte length (LEB128; every section here is < 128 bytes) and bytes. */
function section(id: number, bytes: number[]): number[] {
  if (bytes.length >= 128) throw new Error("combine-wasm: section too long for a one-byte length");
  return [id, bytes.length, ...bytes];
}

/** A name as the binary format writes it: its length, then its UTF-8 (ASCII here) bytes. */
function name(s: string): number[] {
  return [s.length, ...Array.from(s, (ch) => ch.charCodeAt(0))];
}

// The function `combine(out, y, w, count, bytes)`, all i32 byte addresses into memory 0:
//   for (c = 0; c < bytes; c += 16) {
//     acc = splat(w[0]) * y[c..c+16)                     // slot 0's product itself
//     for (j = 1, p = y + c; j < count; j++) { p += bytes; acc = acc + splat(w[j]) * p[0..16) }
//     out[c..c+16) = acc
//   }
// `count` >= 1 rows of `bytes` (a multiple of 16) each lie one after the other from `y`; `w` holds
// `count` f32 weights. The lanes past a row's embd are padding, computed and never read.
const P_OUT = 0;
const P_Y = 1;
const P_W = 2;
const P_COUNT = 3;
const P_BYTES = 4;
const L_C = 5;
const L_J = 6;
const L_P = 7;
const L_ACC = 8;
const MEM_F32 = [0x02, 0x00]; // align 2^2, offset 0
const MEM_V128 = [0x04, 0x00]; // align 2^4, offset 0

const splatWeightTimesRow = (wAddr: number[], rowAddr: number[]): number[] => [
  ...wAddr,
  OP.f32Load,
  ...MEM_F32,
  OP.simd,
  ...SIMD.f32x4Splat,
  ...rowAddr,
  OP.simd,
  ...SIMD.v128Load,
  ...MEM_V128,
  OP.simd,
  ...SIMD.f32x4Mul,
];

const body: number[] = [
  // locals: c, j, p (i32), acc (v128)
  2,
  3,
  OP.i32,
  1,
  OP.v128,
  ...[OP.block, OP.void, OP.loop, OP.void],
  // if (c >= bytes) break
  ...[OP.localGet, L_C, OP.localGet, P_BYTES, OP.i32GeU, OP.brIf, 1],
  // acc = splat(w[0]) * (p = y + c)[0..16)
  ...splatWeightTimesRow(
    [OP.localGet, P_W],
    [OP.localGet, P_Y, OP.localGet, L_C, OP.i32Add, OP.localTee, L_P],
  ),
  ...[OP.localSet, L_ACC],
  ...[OP.i32Const, 1, OP.localSet, L_J],
  ...[OP.block, OP.void, OP.loop, OP.void],
  // if (j >= count) break
  ...[OP.localGet, L_J, OP.localGet, P_COUNT, OP.i32GeU, OP.brIf, 1],
  // acc = acc + splat(w[j]) * (p += bytes)[0..16)
  ...[OP.localGet, L_ACC],
  ...splatWeightTimesRow(
    [OP.localGet, P_W, OP.localGet, L_J, OP.i32Const, 2, OP.i32Shl, OP.i32Add],
    [OP.localGet, L_P, OP.localGet, P_BYTES, OP.i32Add, OP.localTee, L_P],
  ),
  ...[OP.simd, ...SIMD.f32x4Add, OP.localSet, L_ACC],
  // j++
  ...[OP.localGet, L_J, OP.i32Const, 1, OP.i32Add, OP.localSet, L_J, OP.br, 0],
  ...[OP.end, OP.end],
  // out[c..c+16) = acc; c += 16
  ...[
    OP.localGet,
    P_OUT,
    OP.localGet,
    L_C,
    OP.i32Add,
    OP.localGet,
    L_ACC,
    OP.simd,
    ...SIMD.v128Store,
    ...MEM_V128,
  ],
  ...[OP.localGet, L_C, OP.i32Const, 16, OP.i32Add, OP.localSet, L_C, OP.br, 0],
  ...[OP.end, OP.end, OP.end],
];

/** The module's bytes: one memory (exported "memory", 1 page to start) and `combine`. */
export function combineModuleBytes(): Uint8Array {
  return new Uint8Array([
    ...[0x00, 0x61, 0x73, 0x6d, 0x01, 0x00, 0x00, 0x00], // "\0asm", version 1
    ...section(1, [1, OP.func, 5, OP.i32, OP.i32, OP.i32, OP.i32, OP.i32, 0]), // type 0: (i32 x5) -> ()
    ...section(3, [1, 0]), // function 0 has type 0
    ...section(5, [1, 0x00, 1]), // memory 0: min 1 page, no max
    ...section(7, [2, ...name("combine"), 0x00, 0, ...name("memory"), 0x02, 0]),
    ...section(10, [1, body.length, ...body]),
  ]);
}

type CombineFn = (out: number, y: number, w: number, count: number, bytes: number) => void;

// The few WebAssembly JS-API members used here (the repository's types are Node's, which do not
// declare the WebAssembly namespace; the DOM lib would bring in much else).
/** A WebAssembly.Memory: its current bytes (replaced, the old ones detached, by a grow). */
export interface WasmMemory {
  readonly buffer: ArrayBuffer;
  grow(pages: number): number;
}
interface WasmApi {
  Module: new (bytes: Uint8Array) => object;
  Instance: new (module: object) => { readonly exports: Record<string, unknown> };
}

/** The instantiated module: its function and memory. */
export interface CombineWasm {
  readonly combine: CombineFn;
  readonly memory: WasmMemory;
}

let instance: CombineWasm | null | undefined;

/**
 * The module, compiled once at first use (synchronously: 176 bytes); null where WebAssembly or
 * its SIMD is missing (the caller then combines in JS). `MOESWARM_COMBINE=js` forces the JS path.
 */
export function combineWasm(): CombineWasm | null {
  if (instance !== undefined) return instance;
  instance = null;
  const forced = typeof process !== "undefined" ? process.env?.MOESWARM_COMBINE : undefined;
  const api = (globalThis as { WebAssembly?: WasmApi }).WebAssembly;
  if (forced === "js" || api === undefined) return instance;
  try {
    const { exports } = new api.Instance(new api.Module(combineModuleBytes()));
    instance = { combine: exports.combine as CombineFn, memory: exports.memory as WasmMemory };
  } catch {
    // a runtime without SIMD refuses the module at validation: the JS path serves
  }
  return instance;
}

/** Which combine this process uses: "wasm-simd" or "js". */
export function combineBackend(): "wasm-simd" | "js" {
  return combineWasm() ? "wasm-simd" : "js";
}
