// fast-check generators of valid frames of every type, within the protocol's limits.
import fc from "fast-check";
import type { Frame } from "../src/index.js";

const str = (min: number, maxChars: number, maxBytes: number) =>
  fc
    .string({ unit: "binary", minLength: min, maxLength: maxChars })
    .filter((s) => Buffer.byteLength(s) >= min && Buffer.byteLength(s) <= maxBytes);
const peer = str(1, 12, 128);
const u32 = fc.integer({ min: 0, max: 2 ** 32 - 1 });
// uint values that exercise every width
const uintAnyWidth = (max: number) =>
  fc.oneof(
    fc.integer({ min: 0, max: Math.min(300, max) }),
    fc.integer({ min: 0, max: Math.min(70000, max) }),
    fc.integer({ min: 0, max }),
  );
const float = fc.oneof(
  fc.double({ noNaN: true, noDefaultInfinity: true }),
  fc.integer({ min: -(2 ** 40), max: 2 ** 40 }),
  fc.constantFrom(0, -0, 2 ** 32, 2 ** 53, -(2 ** 31) - 1, 0.1),
);
const f32Bits = (n: number) =>
  fc.uint32Array({ minLength: n, maxLength: n }).map((u) => new Float32Array(u.buffer));
const finiteF32 = (n: number) =>
  fc
    .array(fc.float({ noNaN: true, noDefaultInfinity: true }), { minLength: n, maxLength: n })
    .map((a) => Float32Array.from(a));

const hello = fc.record(
  {
    t: fc.constant("hello" as const),
    v: fc.constant(1 as const),
    role: fc.constantFrom("worker" as const, "backbone" as const),
    id: peer,
    token: str(0, 40, 8192),
    caps: fc.record(
      {
        backends: fc.array(str(1, 8, 64), { maxLength: 4 }),
        dtypes: fc.array(str(1, 8, 64), { maxLength: 4 }),
        maxFrame: uintAnyWidth(2 ** 32 - 1),
      },
      { requiredKeys: [] },
    ),
  },
  { requiredKeys: ["t", "v", "role", "id", "token"] },
);

const register = fc.record(
  {
    t: fc.constant("register" as const),
    v: fc.constant(1 as const),
    model: str(1, 20, 256),
    layers: fc.array(fc.integer({ min: 0, max: 65535 }), { maxLength: 20 }),
    experts: fc.uniqueArray(uintAnyWidth(2 ** 31 - 1), { maxLength: 20 }).map((a) => a.sort((x, y) => x - y)),
    capacity: fc.oneof(uintAnyWidth(2 ** 32), fc.maxSafeNat()),
    backend: str(1, 8, 64),
  },
  { requiredKeys: ["t", "v", "model", "layers", "experts"] },
);

const dispatch = fc
  .record({
    n: fc.integer({ min: 1, max: 4 }),
    embd: fc.integer({ min: 1, max: 9 }),
    k: fc.integer({ min: 1, max: 4 }),
    dtype: fc.constantFrom("f32" as const, "f16" as const, "bf16" as const),
    mode: fc.constantFrom("each" as const, "sum" as const),
    withW: fc.boolean(),
  })
  .chain(({ n, embd, k, dtype, mode, withW }) =>
    fc.record(
      {
        t: fc.constant("dispatch" as const),
        v: fc.constant(1 as const),
        id: uintAnyWidth(2 ** 32 - 1),
        to: peer,
        from: peer,
        model: str(1, 20, 256),
        layer: fc.integer({ min: 0, max: 65535 }),
        n: fc.constant(n),
        embd: fc.constant(embd),
        dtype: fc.constant(dtype),
        x: dtype === "f32" ? f32Bits(n * embd) : fc.uint16Array({ minLength: n * embd, maxLength: n * embd }),
        k: fc.constant(k),
        ids: fc
          .array(fc.integer({ min: -1, max: 2 ** 31 - 1 }), { minLength: n * k, maxLength: n * k })
          .map((a) => Int32Array.from(a)),
        ...(mode === "sum" || withW ? { w: finiteF32(n * k) } : {}),
        mode: fc.constant(mode),
        deadline: u32,
        ...(mode === "each" ? { compact: fc.boolean() } : {}),
      },
      {
        requiredKeys: [
          "t",
          "v",
          "id",
          "model",
          "layer",
          "n",
          "embd",
          "dtype",
          "x",
          "k",
          "ids",
          "mode",
          ...(mode === "sum" ? ["w" as const] : []),
        ],
      },
    ),
  );

const result = fc
  .record({
    n: fc.integer({ min: 1, max: 3 }),
    embd: fc.integer({ min: 1, max: 6 }),
    k: fc.integer({ min: 1, max: 3 }),
    mode: fc.constantFrom("each" as const, "sum" as const),
    // a compact "each" result: the rows of some filled slots only (here n of the n*k)
    compact: fc.boolean(),
  })
  .chain(({ n, embd, k, mode, compact }) =>
    fc.record(
      {
        t: fc.constant("result" as const),
        v: fc.constant(1 as const),
        id: u32,
        to: peer,
        from: peer,
        mode: fc.constant(mode),
        n: fc.constant(n),
        k: fc.constant(k),
        embd: fc.constant(embd),
        y: f32Bits(mode === "each" && !compact ? n * k * embd : n * embd),
        ms: fc.oneof(fc.double({ min: 0, noNaN: true, noDefaultInfinity: true }), fc.nat()),
        ...(mode === "each" && compact ? { compact: fc.constant(true) } : {}),
      },
      {
        requiredKeys: [
          "t",
          "v",
          "id",
          "mode",
          "n",
          "k",
          "embd",
          "y",
          ...(mode === "each" && compact ? ["compact" as const] : []),
        ],
      },
    ),
  );

const error = fc.record(
  {
    t: fc.constant("error" as const),
    v: fc.constant(1 as const),
    id: u32,
    to: peer,
    from: peer,
    code: fc.stringMatching(/^MOESWARM_[A-Z0-9_]{1,40}$/),
    msg: str(0, 300, 16384),
  },
  { requiredKeys: ["t", "v", "code", "msg"] },
);

const ping = fc.record({
  t: fc.constantFrom("ping" as const, "pong" as const),
  v: fc.constant(1 as const),
  seq: fc.oneof(uintAnyWidth(2 ** 32), fc.maxSafeNat()),
  ts: float,
});

const drain = fc.record(
  { t: fc.constant("drain" as const), v: fc.constant(1 as const), reason: str(0, 40, 1024) },
  { requiredKeys: ["t", "v"] },
);

export const validFrame: fc.Arbitrary<Frame> = fc.oneof(
  hello,
  register,
  dispatch,
  result,
  error,
  ping,
  drain,
) as fc.Arbitrary<Frame>;
