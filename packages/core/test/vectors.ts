// The frames behind the hex test vectors of docs/protocol.md (print them with
// `pnpm --filter @moeswarm/core protocol-vectors`). Small sizes, values exactly
// representable in f32/f16/bf16, and together every frame type, optional field and encoding width
// the canonical form has (fixmap and map16, fixint..uint64, negative ints, float64, str8, bin8).
import { encodeF16, f32ToBf16Bits } from "../src/half.js";
import {
  dispatchFrame,
  drainFrame,
  errorFrame,
  type Frame,
  helloFrame,
  pingFrame,
  pongFrame,
  registerFrame,
  resultFrame,
  sumSlots,
} from "../src/index.js";

export interface Vector {
  name: string;
  note: string;
  frame: Frame;
}

const x = new Float32Array([1, 2, 3, 4, 0.5, -1, 0, -2.5]);
const ids = new Int32Array([0, 5, 3, -1]);
const w = new Float32Array([0.75, 0.25, 1, 0]);
// outputs of slot (i, j) at ((i*2)+j)*4; the empty slot (token 1, slot 1) is zero
const yEach = new Float32Array([1, 2, 3, 4, -4, 8, 0.5, 0, 0.25, -1, 2, 16, 0, 0, 0, 0]);
const ySum = sumSlots(yEach, w, ids, { n: 2, k: 2, embd: 4 });

export const VECTORS: Vector[] = [
  {
    name: "hello",
    note: "A worker introduces itself with capabilities (`caps` is a nested map; `maxFrame` 64 MiB is a uint32).",
    frame: helloFrame({
      role: "worker",
      id: "w1",
      token: "tok",
      caps: { backends: ["cpu"], dtypes: ["f32", "f16"], maxFrame: 64 * 1024 * 1024 },
    }),
  },
  {
    name: "hello-minimal",
    note: "A backbone without `caps` and with an empty token.",
    frame: helloFrame({ role: "backbone", id: "bb", token: "" }),
  },
  {
    name: "register",
    note: "`capacity` 80 GB is above 2^32, so it is a uint64 (0xcf); `experts` ascending.",
    frame: registerFrame({
      model: "qwen3-30b-a3b",
      layers: [0, 1, 47],
      experts: [0, 1, 2, 200],
      capacity: 80_000_000_000,
      backend: "cuda",
    }),
  },
  {
    name: "dispatch-f32-each",
    note: 'n=2 tokens, embd=4, k=2 slots, f32 activations, mode "each" (no `w`); slot (1,1) is empty (id -1). The padding entry `_` before `x` holds 3 zero bytes, so that the data of `x` starts at byte 64.',
    frame: dispatchFrame({
      id: 7,
      model: "m",
      layer: 3,
      n: 2,
      embd: 4,
      dtype: "f32",
      x,
      k: 2,
      ids,
      mode: "each",
    }),
  },
  {
    name: "dispatch-f16-sum",
    note: 'The same activations as f16 bits, mode "sum" with router weights, relay addressing and a deadline: 17 keys with the padding entry, so a map16 header (0xde 0x00 0x11), and 1 padding byte puts `x` at byte 80; `id` 300 is a uint16.',
    frame: dispatchFrame({
      id: 300,
      to: "w1",
      from: "bb",
      model: "m",
      layer: 3,
      n: 2,
      embd: 4,
      dtype: "f16",
      x: encodeF16(x),
      k: 2,
      ids,
      w,
      mode: "sum",
      deadline: 250,
    }),
  },
  {
    name: "dispatch-bf16",
    note: "One token, embd=2, one slot, bf16 bits (1.0 = 0x3f80, -2.0 = 0xc000); 2 padding bytes.",
    frame: dispatchFrame({
      id: 0,
      model: "m",
      layer: 0,
      n: 1,
      embd: 2,
      dtype: "bf16",
      x: new Uint16Array([f32ToBf16Bits(1), f32ToBf16Bits(-2)]),
      k: 1,
      ids: new Int32Array([9]),
      w: new Float32Array([1]),
      mode: "sum",
    }),
  },
  {
    name: "result-each",
    note: "The answer to `dispatch-f32-each`: `n*k*embd` = 16 f32, zero for the empty slot (1 padding byte puts `y` at byte 48); `ms` is a float64.",
    frame: resultFrame({ id: 7, mode: "each", n: 2, k: 2, embd: 4, y: yEach, ms: 1.5 }),
  },
  {
    name: "result-sum",
    note: "The same outputs reduced with the weights of `dispatch-f16-sum` (products rounded to f32, summed in slot order, empty slot skipped): token 0 = `0.75*[1,2,3,4] + 0.25*[-4,8,0.5,0]` = `[-0.25, 3.5, 2.375, 3]`; token 1 = `1*[0.25,-1,2,16]`. `ms` 2 is an integer, so a fixint; 2 padding bytes.",
    frame: resultFrame({ id: 300, to: "bb", from: "w1", mode: "sum", n: 2, k: 2, embd: 4, y: ySum, ms: 2 }),
  },
  {
    name: "error",
    note: "A request-level error (with `id`).",
    frame: errorFrame({
      id: 7,
      code: "MOESWARM_PROTOCOL_BAD_LENGTH",
      msg: "dispatch.x: 31 bytes, expected 32",
    }),
  },
  {
    name: "error-connection",
    note: "A connection-level error (no `id`): here a rejected token.",
    frame: errorFrame({ code: "MOESWARM_AUTH_INVALID", msg: "bad token" }),
  },
  {
    name: "ping",
    note: "`ts` with a fractional part is a float64.",
    frame: pingFrame({ seq: 1, ts: 1234.5 }),
  },
  {
    name: "pong",
    note: "`ts` here is an integer above 2^32 (a Date.now() reading), so a uint64; `seq` 200 a uint8.",
    frame: pongFrame({ seq: 200, ts: 1_732_900_000_000 }),
  },
  {
    name: "drain",
    note: "A worker going away.",
    frame: drainFrame({ reason: "shutdown" }),
  },
  {
    name: "drain-minimal",
    note: "No reason: the smallest frame.",
    frame: drainFrame(),
  },
];

/** A frame as JSON-compatible values: typed arrays become arrays of their elements. */
export function frameToJson(frame: Frame): Record<string, unknown> {
  const out: Record<string, unknown> = {};
  for (const [key, value] of Object.entries(frame)) {
    if (value === undefined) continue;
    out[key] = ArrayBuffer.isView(value) ? Array.from(value as unknown as ArrayLike<number>) : value;
  }
  return out;
}
