// Hostile input: hand-made files for each check of the reader, then a mutation fuzzer over valid
// files. Every failure must be a GgufError with a code; nothing may hang, crash or allocate what
// the file asks for.
import { GgufError, InvalidArgumentError, isMoeswarmError } from "@moeswarm/core";
import { rng } from "@moeswarm/testkit";
import { describe, expect, it } from "vitest";
import {
  type ByteSource,
  bufferSource,
  checkedNumber,
  DEFAULT_GGUF_LIMITS,
  GgmlType,
  type GgufHeader,
  type GgufLimits,
  GgufValueType,
  planGguf,
  readGguf,
  resolveGgufLimits,
} from "../src/index.js";
import { kitchenSink, smallInput } from "./gguf-fixtures.js";

type Part =
  | ["u8", number]
  | ["u32", number]
  | ["u64", bigint | number]
  | ["str", string]
  | ["bytes", Uint8Array | number[]]
  | ["pad", number];

/** Hand-assembled little-endian bytes. `pad` zero-fills up to an absolute offset. */
function raw(...parts: Part[]): Uint8Array {
  const out: number[] = [];
  for (const [kind, v] of parts) {
    const b = Buffer.alloc(8);
    switch (kind) {
      case "u8":
        out.push(v);
        break;
      case "u32":
        b.writeUInt32LE(v >>> 0);
        out.push(...b.subarray(0, 4));
        break;
      case "u64":
        b.writeBigUInt64LE(BigInt(v));
        out.push(...b);
        break;
      case "str": {
        const s = Buffer.from(v, "utf8");
        b.writeBigUInt64LE(BigInt(s.byteLength));
        out.push(...b, ...s);
        break;
      }
      case "bytes":
        out.push(...v);
        break;
      case "pad":
        while (out.length < v) out.push(0);
        break;
    }
  }
  return Uint8Array.from(out);
}

const MAGIC: Part = ["bytes", [0x47, 0x47, 0x55, 0x46]];
const head = (nTensors: number | bigint, nKv: number | bigint, version = 3): Part[] => [
  MAGIC,
  ["u32", version],
  ["u64", nTensors],
  ["u64", nKv],
];
const kvU32 = (key: string, value: number): Part[] => [
  ["str", key],
  ["u32", GgufValueType.UINT32],
  ["u32", value],
];
/** A tensor info: name, dims, ggml type, offset. */
const info = (name: string, shape: (number | bigint)[], type: number, offset: number | bigint): Part[] => [
  ["str", name],
  ["u32", shape.length],
  ...shape.map((ne): Part => ["u64", ne]),
  ["u32", type],
  ["u64", offset],
];

async function codeOf(bytes: Uint8Array | ByteSource, limits?: Partial<GgufLimits>): Promise<string> {
  try {
    await readGguf(bytes, { limits });
    return "ok";
  } catch (error) {
    if (!(error instanceof GgufError)) throw error;
    return error.code;
  }
}

describe("crafted files get the right code", () => {
  const cases: [string, () => Uint8Array, string, Partial<GgufLimits>?][] = [
    ["empty file", () => new Uint8Array(0), "MOESWARM_GGUF_BAD_MAGIC"],
    ["wrong magic", () => raw(["bytes", [0x47, 0x47, 0x55, 0x58]], ["pad", 64]), "MOESWARM_GGUF_BAD_MAGIC"],
    ["magic only", () => raw(MAGIC), "MOESWARM_GGUF_TRUNCATED"],
    ["v1", () => raw(...head(0, 0, 1)), "MOESWARM_GGUF_UNSUPPORTED_VERSION"],
    ["v0", () => raw(...head(0, 0, 0)), "MOESWARM_GGUF_UNSUPPORTED_VERSION"],
    ["v4", () => raw(...head(0, 0, 4)), "MOESWARM_GGUF_UNSUPPORTED_VERSION"],
    [
      "big-endian v3",
      () => raw(MAGIC, ["bytes", [0, 0, 0, 3]], ["pad", 24]),
      "MOESWARM_GGUF_UNSUPPORTED_VERSION",
    ],
    ["counts cut short", () => raw(MAGIC, ["u32", 3], ["u64", 0]), "MOESWARM_GGUF_TRUNCATED"],
    ["tensor count 2^63-1", () => raw(...head(2n ** 63n - 1n, 0)), "MOESWARM_GGUF_LIMIT"],
    ["kv count 2^64-1", () => raw(...head(0, 2n ** 64n - 1n)), "MOESWARM_GGUF_LIMIT"],
    ["kv count 2^32", () => raw(...head(0, 2n ** 32n)), "MOESWARM_GGUF_LIMIT"],
    ["1000 kvs in a short file", () => raw(...head(0, 1000), ["pad", 100]), "MOESWARM_GGUF_TRUNCATED"],
    [
      "key length 2^63-1",
      () => raw(...head(0, 1), ["u64", 2n ** 63n - 1n], ["pad", 64]),
      "MOESWARM_GGUF_LIMIT",
    ],
    [
      "key length past the end",
      () => raw(...head(0, 1), ["u64", 1000], ["pad", 60]),
      "MOESWARM_GGUF_TRUNCATED",
    ],
    [
      "value type 13",
      () => raw(...head(0, 1), ["str", "k"], ["u32", 13], ["pad", 64]),
      "MOESWARM_GGUF_BAD_VALUE_TYPE",
    ],
    [
      "array item type 99",
      () => raw(...head(0, 1), ["str", "k"], ["u32", 9], ["u32", 99], ["u64", 1], ["pad", 80]),
      "MOESWARM_GGUF_BAD_VALUE_TYPE",
    ],
    [
      "array count 2^62",
      () => raw(...head(0, 1), ["str", "k"], ["u32", 9], ["u32", 4], ["u64", 2n ** 62n]),
      "MOESWARM_GGUF_LIMIT",
    ],
    [
      "array of 1M u64 in a short file (no allocation)",
      () => raw(...head(0, 1), ["str", "k"], ["u32", 9], ["u32", 10], ["u64", 1_000_000], ["pad", 200]),
      "MOESWARM_GGUF_TRUNCATED",
    ],
    [
      "array of 1M strings in a short file",
      () => raw(...head(0, 1), ["str", "k"], ["u32", 9], ["u32", 8], ["u64", 1_000_000], ["pad", 200]),
      "MOESWARM_GGUF_TRUNCATED",
    ],
    [
      "array longer than the limit",
      () => raw(...head(0, 1), ["str", "k"], ["u32", 9], ["u32", 0], ["u64", 11], ["pad", 100]),
      "MOESWARM_GGUF_LIMIT",
      { maxArrayLength: 10 },
    ],
    [
      "too many elements in total",
      () =>
        raw(
          ...head(0, 2),
          ...[1, 2].flatMap((i): Part[] => [
            ["str", `k${i}`],
            ["u32", 9],
            ["u32", 0],
            ["u64", 6],
            ["bytes", [1, 2, 3, 4, 5, 6]],
          ]),
        ),
      "MOESWARM_GGUF_LIMIT",
      { maxMetadataElements: 10 },
    ],
    [
      "arrays nested 9 deep",
      () =>
        raw(
          ...head(0, 1),
          ["str", "k"],
          ["u32", 9],
          ...Array.from({ length: 8 }, (): Part[] => [
            ["u32", 9],
            ["u64", 1],
          ]).flat(),
          ["u32", 4],
          ["u64", 0],
        ),
      "MOESWARM_GGUF_LIMIT",
    ],
    [
      "string over the limit",
      () => raw(...head(0, 1), ["str", "k"], ["u32", 8], ["str", "x".repeat(33)]),
      "MOESWARM_GGUF_LIMIT",
      { maxStringBytes: 32 },
    ],
    [
      "duplicate key",
      () => raw(...head(0, 2), ...kvU32("a", 1), ...kvU32("a", 2)),
      "MOESWARM_GGUF_DUPLICATE_KEY",
    ],
    [
      "alignment not u32",
      () => raw(...head(0, 1), ["str", "general.alignment"], ["u32", GgufValueType.UINT64], ["u64", 32]),
      "MOESWARM_GGUF_BAD_ALIGNMENT",
    ],
    [
      "alignment 48",
      () => raw(...head(0, 1), ...kvU32("general.alignment", 48)),
      "MOESWARM_GGUF_BAD_ALIGNMENT",
    ],
    [
      "alignment 0",
      () => raw(...head(0, 1), ...kvU32("general.alignment", 0)),
      "MOESWARM_GGUF_BAD_ALIGNMENT",
    ],
    [
      "5 dims",
      () => raw(...head(1, 0), ...info("t", [1, 1, 1, 1, 4], 0, 0), ["pad", 256]),
      "MOESWARM_GGUF_BAD_TENSOR",
    ],
    [
      "ne 2^63",
      () => raw(...head(1, 0), ...info("t", [2n ** 63n], 0, 0), ["pad", 256]),
      "MOESWARM_GGUF_BAD_TENSOR",
    ],
    [
      "ne product past 2^53",
      () => raw(...head(1, 0), ...info("t", [2 ** 30, 2 ** 30], 0, 0), ["pad", 256]),
      "MOESWARM_GGUF_BAD_TENSOR",
    ],
    [
      "removed ggml type 4",
      () => raw(...head(1, 0), ...info("t", [32], 4, 0), ["pad", 256]),
      "MOESWARM_GGUF_BAD_TENSOR",
    ],
    [
      "ggml type 2^31",
      () => raw(...head(1, 0), ...info("t", [32], 2 ** 31, 0), ["pad", 256]),
      "MOESWARM_GGUF_BAD_TENSOR",
    ],
    [
      "row not a multiple of the block",
      () => raw(...head(1, 0), ...info("t", [33], GgmlType.Q8_0, 0), ["pad", 256]),
      "MOESWARM_GGUF_BAD_TENSOR",
    ],
    [
      "quantized scalar (ne[0] = 1)",
      () => raw(...head(1, 0), ...info("t", [], GgmlType.Q8_0, 0), ["pad", 256]),
      "MOESWARM_GGUF_BAD_TENSOR",
    ],
    [
      "name of 64 bytes",
      () => raw(...head(1, 0), ...info("n".repeat(64), [4], 0, 0), ["pad", 512]),
      "MOESWARM_GGUF_BAD_TENSOR",
    ],
    [
      "duplicate tensor name",
      () => raw(...head(2, 0), ...info("t", [8], 0, 0), ...info("t", [8], 0, 32), ["pad", 256]),
      "MOESWARM_GGUF_BAD_TENSOR",
    ],
    [
      "offset not aligned",
      () => raw(...head(1, 0), ...info("t", [8], 0, 16), ["pad", 256]),
      "MOESWARM_GGUF_BAD_ALIGNMENT",
    ],
    [
      "data past the end of the file",
      () => raw(...head(1, 0), ...info("t", [64], 0, 0), ["pad", 96 + 100]),
      "MOESWARM_GGUF_BAD_OFFSET",
    ],
    [
      "offset 2^64-32",
      () => raw(...head(1, 0), ...info("t", [8], 0, 2n ** 64n - 32n), ["pad", 256]),
      "MOESWARM_GGUF_BAD_OFFSET",
    ],
    [
      "overlapping tensors",
      () => raw(...head(2, 0), ...info("a", [16], 0, 0), ...info("b", [8], 0, 32), ["pad", 512]),
      "MOESWARM_GGUF_BAD_OFFSET",
    ],
    [
      "overlapping tensors listed out of order",
      () => raw(...head(2, 0), ...info("a", [16], 0, 64), ...info("b", [16], 0, 32), ["pad", 512]),
      "MOESWARM_GGUF_BAD_OFFSET",
    ],
    [
      "header padding past the end",
      () => raw(...head(1, 0), ...info("t", [0], 0, 0)),
      "MOESWARM_GGUF_TRUNCATED",
    ],
  ];
  it.each(cases)("%s", async (_name, make, code, limits) => {
    expect(await codeOf(make(), limits)).toBe(code);
  });

  it("accepts what ggml accepts: zero-element tensors, no tensors, empty arrays and keys", async () => {
    const bytes = raw(
      ...head(2, 2),
      ["str", ""],
      ["u32", 9],
      ["u32", 8],
      ["u64", 0],
      ...kvU32("x", 1),
      ...info("empty", [0, 4], 0, 0),
      ...info("one", [4], 0, 0),
      ["pad", 256],
    );
    const header = await readGguf(bytes);
    expect(header.tensors.map((t) => [t.name, t.nbytes])).toEqual([
      ["empty", 0n],
      ["one", 16n],
    ]);
    expect((await readGguf(raw(...head(0, 0)))).dataOffset).toBe(32n);
    // Out of order but disjoint: ggml would refuse to load it, the format allows it.
    const swapped = await readGguf(
      raw(...head(2, 0), ...info("a", [8], 0, 32), ...info("b", [8], 0, 0), ["pad", 256]),
    );
    expect(swapped.tensors.map((t) => t.offset)).toEqual([32n, 0n]);
  });

  it("reports a big-endian file as such", async () => {
    const error = await readGguf(raw(MAGIC, ["bytes", [0, 0, 0, 3]], ["pad", 24])).catch((e: unknown) => e);
    expect((error as GgufError).details).toMatchObject({ bigEndian: true });
    expect((error as GgufError).message).toMatch(/big-endian/);
  });
});

describe("limits", () => {
  it("validates options and converts 64-bit values only when they fit", async () => {
    expect(resolveGgufLimits({ maxStringBytes: 5 }).maxStringBytes).toBe(5);
    expect(resolveGgufLimits({}).maxKvCount).toBe(DEFAULT_GGUF_LIMITS.maxKvCount);
    for (const bad of [{ maxStringBytes: -1 }, { maxStringBytes: 1.5 }, { nope: 1 }]) {
      expect(() => resolveGgufLimits(bad as Partial<GgufLimits>)).toThrow(InvalidArgumentError);
    }
    await expect(readGguf(new Uint8Array(8), { limits: { maxKvCount: -3 } })).rejects.toBeInstanceOf(
      InvalidArgumentError,
    );
    expect(checkedNumber(2n ** 53n - 1n, "x", "MOESWARM_GGUF_LIMIT")).toBe(2 ** 53 - 1);
    expect(() => checkedNumber(2n ** 53n, "x", "MOESWARM_GGUF_LIMIT")).toThrow(
      expect.objectContaining({ code: "MOESWARM_GGUF_LIMIT" }),
    );
    expect(() => checkedNumber(-1n, "x", "MOESWARM_GGUF_BAD_OFFSET")).toThrow(
      expect.objectContaining({ code: "MOESWARM_GGUF_BAD_OFFSET" }),
    );
  });
});

/** A source that claims to be 1 PB and answers every read with a repeating pattern. */
function endlessSource(prefix: Uint8Array, fill: Uint8Array): ByteSource & { bytesRead: number } {
  const source = {
    size: 2n ** 50n,
    description: "endless",
    bytesRead: 0,
    async read(offset: bigint | number, length: number) {
      const o = Number(offset);
      const out = new Uint8Array(length);
      for (let i = 0; i < length; i++) {
        const p = o + i;
        out[i] = p < prefix.length ? prefix[p]! : fill[(p - prefix.length) % fill.length]!;
      }
      source.bytesRead += length;
      return out;
    },
    async close() {},
    async [Symbol.asyncDispose]() {},
  };
  return source;
}

describe("a hostile source that never ends", () => {
  it("stops at the string limit without reading the string", async () => {
    const src = endlessSource(raw(...head(0, 1), ["u64", 2n ** 40n]), new Uint8Array([0]));
    expect(await codeOf(src)).toBe("MOESWARM_GGUF_LIMIT");
    expect(src.bytesRead).toBeLessThanOrEqual(1 << 20);
  });

  it("stops at the header limit however plausible each value looks", async () => {
    // 1M keys, each an array of 15 u64: fits every per-value limit, not the header limit.
    const prefix = raw(...head(0, 1_000_000));
    const kv = raw(["str", "k"], ["u32", 9], ["u32", 10], ["u64", 15], ["pad", 21 + 120]);
    const src = endlessSource(prefix, kv);
    // Repeated keys would fail as duplicates first; the header limit must come before either.
    expect(await codeOf(src, { maxHeaderBytes: 100 })).toBe("MOESWARM_GGUF_LIMIT");
    expect(src.bytesRead).toBeLessThanOrEqual(1 << 20);
  });

  it("reads 2^24 empty strings only as far as the header limit allows", async () => {
    const src = endlessSource(
      raw(...head(0, 1), ["str", "k"], ["u32", 9], ["u32", 8], ["u64", 2 ** 24]),
      new Uint8Array([0]),
    );
    expect(await codeOf(src, { maxHeaderBytes: 4 << 20 })).toBe("MOESWARM_GGUF_LIMIT");
    expect(src.bytesRead).toBeLessThanOrEqual(4 << 20);
  });
});

// --- mutation fuzzer ---------------------------------------------------------------------------

async function collectFile(
  input: ReturnType<typeof smallInput>,
): Promise<{ bytes: Uint8Array; headerSize: number }> {
  const plan = planGguf(input);
  const bytes = new Uint8Array(Number(plan.totalSize));
  bytes.set(plan.header);
  for (const t of plan.tensors) bytes.set(t.data as Uint8Array, Number(t.absoluteOffset));
  return { bytes, headerSize: plan.header.byteLength };
}

interface FuzzStats {
  cases: number;
  accepted: number;
  codes: Map<string, number>;
  failures: string[];
}

// Tighter than the defaults so a mutated count cannot make one case read megabytes.
const FUZZ_LIMITS: Partial<GgufLimits> = { maxHeaderBytes: 1 << 20, maxArrayLength: 1 << 16 };

async function check(bytes: Uint8Array, label: string, stats: FuzzStats): Promise<void> {
  stats.cases++;
  let header: GgufHeader;
  try {
    header = await readGguf(bufferSource(bytes), { limits: FUZZ_LIMITS, blockSize: 64 });
  } catch (error) {
    if (error instanceof GgufError && isMoeswarmError(error)) {
      stats.codes.set(error.code, (stats.codes.get(error.code) ?? 0) + 1);
    } else if (stats.failures.length < 20) {
      stats.failures.push(`${label}: ${String((error as Error)?.stack ?? error)}`);
    }
    return;
  }
  stats.accepted++;
  // Whatever is accepted must be internally consistent.
  for (const t of header.tensors) {
    if (
      t.absoluteOffset + t.nbytes > BigInt(bytes.byteLength) ||
      t.absoluteOffset % BigInt(header.alignment) !== 0n
    ) {
      stats.failures.push(`${label}: accepted tensor ${t.name} outside the file or unaligned`);
    }
  }
}

describe("mutation fuzzing", () => {
  it("gives only GgufErrors on thousands of damaged files", async () => {
    const stats: FuzzStats = { cases: 0, accepted: 0, codes: new Map(), failures: [] };
    const random = rng(0x6775_6766);
    const files = [await collectFile(smallInput()), await collectFile(kitchenSink())];
    const started = Date.now();

    for (const [f, { bytes }] of files.entries()) {
      // Truncation at every offset.
      for (let n = 0; n < bytes.byteLength; n++)
        await check(bytes.subarray(0, n), `file${f} cut at ${n}`, stats);
    }
    const { bytes, headerSize } = files[0]!;
    // Every single bit of the header flipped.
    for (let bit = 0; bit < headerSize * 8; bit++) {
      const m = bytes.slice();
      m[bit >> 3]! ^= 1 << (bit & 7);
      await check(m, `bit ${bit}`, stats);
    }
    // Length/count/offset-sized fields overwritten with extreme values at every offset.
    const specials64 = [2n ** 63n - 1n, 2n ** 64n - 1n, 2n ** 32n, 2n ** 31n, 0n, 1n, 2n ** 53n];
    const specials32 = [0xffffffff, 0x80000000, 0, 4, 9, 13, 2 ** 16];
    for (let at = 0; at + 8 <= headerSize; at++) {
      for (const v of specials64) {
        const m = bytes.slice();
        new DataView(m.buffer).setBigUint64(at, v, true);
        await check(m, `u64 ${v} at ${at}`, stats);
      }
      for (const v of specials32) {
        const m = bytes.slice();
        new DataView(m.buffer).setUint32(at, v, true);
        await check(m, `u32 ${v} at ${at}`, stats);
      }
    }
    // Random multi-bit flips and random byte runs anywhere in either file.
    for (let i = 0; i < 3000; i++) {
      const src = files[i & 1]!.bytes;
      const m = src.slice();
      const flips = 1 + Math.floor(random() * 8);
      for (let k = 0; k < flips; k++) {
        const p = Math.floor(random() * Math.min(m.length, files[i & 1]!.headerSize + 64));
        m[p]! ^= 1 << Math.floor(random() * 8);
      }
      await check(m, `flips #${i}`, stats);
    }
    for (let i = 0; i < 1500; i++) {
      const m = bytes.slice();
      const p = Math.floor(random() * headerSize);
      const n = 1 + Math.floor(random() * 16);
      for (let k = p; k < Math.min(m.length, p + n); k++) m[k] = Math.floor(random() * 256);
      await check(m, `run #${i}`, stats);
    }
    // Garbage after a valid magic and version.
    for (let i = 0; i < 500; i++) {
      const m = new Uint8Array(8 + Math.floor(random() * 512));
      for (let k = 8; k < m.length; k++) m[k] = Math.floor(random() * 256);
      m.set([0x47, 0x47, 0x55, 0x46, 3, 0, 0, 0]);
      await check(m, `garbage #${i}`, stats);
    }

    const seconds = (Date.now() - started) / 1000;
    // The figures for the report: cases run, accepted, and the codes seen.
    console.info(
      `gguf fuzz: ${stats.cases} cases in ${seconds.toFixed(2)} s, ${stats.accepted} accepted, codes ${JSON.stringify(Object.fromEntries(stats.codes))}`,
    );
    expect(stats.failures).toEqual([]);
    expect(stats.cases).toBeGreaterThan(10_000);
    // The mutations must reach the deep checks, not stop at the magic.
    for (const code of [
      "MOESWARM_GGUF_TRUNCATED",
      "MOESWARM_GGUF_LIMIT",
      "MOESWARM_GGUF_BAD_VALUE_TYPE",
      "MOESWARM_GGUF_BAD_TENSOR",
      "MOESWARM_GGUF_BAD_OFFSET",
      "MOESWARM_GGUF_BAD_ALIGNMENT",
      "MOESWARM_GGUF_UNSUPPORTED_VERSION",
      "MOESWARM_GGUF_BAD_MAGIC",
    ]) {
      expect(stats.codes.get(code) ?? 0, code).toBeGreaterThan(0);
    }
  });
});
