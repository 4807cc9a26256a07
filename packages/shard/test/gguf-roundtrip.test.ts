// Our writer and reader against each other: exact values and types, byte-identical rewrites,
// byte ranges of the stream, header-only sparse files, input validation, abort.

import { existsSync, readdirSync, readFileSync, statSync } from "node:fs";
import { join } from "node:path";
import { PassThrough } from "node:stream";
import { pathToFileURL } from "node:url";
import { type GgufError, InvalidArgumentError, isMoeswarmError } from "@moeswarm/core";
import { tempDir } from "@moeswarm/testkit";
import { afterAll, describe, expect, it } from "vitest";
import {
  type ByteSource,
  bufferSource,
  fileSource,
  GgmlType,
  type GgufArray,
  GgufValueType,
  type GgufWriteInput,
  type GgufWriteTensor,
  getArray,
  getBigInt,
  getBool,
  getInteger,
  getNumber,
  getNumberArray,
  getString,
  getStringArray,
  ggufByteStream,
  ggufValue,
  plainValue,
  planGguf,
  readGguf,
  writeGguf,
} from "../src/index.js";
import { kitchenSink, kitchenSinkMetadata, pseudoBytes, tensor } from "./gguf-fixtures.js";

const tmp = tempDir("moeswarm-gguf-rt-");
afterAll(() => tmp.remove());

async function collect(stream: AsyncIterable<Uint8Array>): Promise<Uint8Array> {
  const parts: Uint8Array[] = [];
  for await (const c of stream) parts.push(c.slice());
  return Buffer.concat(parts);
}

describe("write then read", () => {
  const input = kitchenSink();
  const path = join(tmp.dir, "sink.gguf");

  it("reads back every value with its type, in order, and every tensor", async () => {
    const plan = await writeGguf(input, path);
    const bytes = readFileSync(path);
    expect(BigInt(bytes.byteLength)).toBe(plan.totalSize);

    const header = await readGguf(path);
    expect(header.version).toBe(3);
    expect(header.alignment).toBe(64);
    expect(header.dataOffset).toBe(plan.dataOffset);
    expect(header.dataOffset % 64n).toBe(0n);
    expect(header.headerSize).toBe(plan.header.byteLength);
    expect(header.fileSize).toBe(plan.totalSize);
    expect(header.dataSize).toBe(plan.totalSize - plan.dataOffset);
    expect([...header.metadata.keys()]).toEqual([...kitchenSinkMetadata().keys()]);
    expect(header.metadata).toEqual(kitchenSinkMetadata());
    // -0 must survive as -0, not 0: compare the bits.
    const negZero = header.metadata.get("test.f32_neg_zero");
    expect(Object.is(negZero?.value, -0)).toBe(true);

    expect(header.tensors.map((t) => t.name)).toEqual(input.tensors.map((t) => t.name));
    for (const [i, t] of header.tensors.entries()) {
      const src = input.tensors[i]!;
      expect(t.type).toBe(src.type);
      expect(t.shape).toEqual(src.shape);
      expect(t.offset % 64n).toBe(0n);
      expect(t.offset).toBe(plan.tensors[i]!.offset);
      expect(t.absoluteOffset).toBe(header.dataOffset + t.offset);
      const data = src.data as Uint8Array;
      expect(t.nbytes).toBe(BigInt(data.byteLength));
      const at = Number(t.absoluteOffset);
      expect(Buffer.compare(bytes.subarray(at, at + data.byteLength), data)).toBe(0);
    }
    // The scalar tensor has no dims and one element.
    expect(header.tensors.at(-1)?.shape).toEqual([]);
    expect(header.tensors.at(-1)?.nElements).toBe(1);
  });

  it("write -> read -> write gives identical bytes (tensor data as file ranges)", async () => {
    const original = readFileSync(path);
    await using source = await fileSource(path);
    const header = await readGguf(source);
    const again = join(tmp.dir, "again.gguf");
    await writeGguf(
      {
        metadata: header.metadata,
        tensors: header.tensors.map((t) => ({
          ...t,
          data: { source, offset: t.absoluteOffset, length: t.nbytes },
        })),
      },
      again,
      { chunkSize: 7 },
    );
    expect(Buffer.compare(readFileSync(again), original)).toBe(0);
  });

  it("reads the same header from a path, bytes, a ByteSource and a file: URL", async () => {
    const fromPath = await readGguf(path);
    const bytes = new Uint8Array(readFileSync(path));
    expect(await readGguf(bytes)).toEqual(fromPath);
    expect(await readGguf(bufferSource(bytes), { blockSize: 64 })).toEqual(fromPath);
    expect(await readGguf(pathToFileURL(path))).toEqual(fromPath);
  });

  it("streams any byte range of the file exactly", async () => {
    const whole = readFileSync(path);
    const plan = planGguf(input);
    expect(Buffer.compare(await collect(ggufByteStream(plan, { chunkSize: 5 })), whole)).toBe(0);
    const n = whole.byteLength;
    const cuts = [
      [0, 0],
      [0, 1],
      [3, 100],
      [plan.header.byteLength - 2, plan.header.byteLength + 3],
      [Number(plan.dataOffset), n],
      [n - 1, n],
      [17, n - 17],
    ];
    for (const [a, b] of cuts) {
      const got = await collect(ggufByteStream(plan, { start: a, end: BigInt(b!), chunkSize: 13 }));
      expect(Buffer.compare(got, whole.subarray(a, b))).toBe(0);
    }
  });

  it("writes to a Writable", async () => {
    const sink = new PassThrough();
    const parts: Buffer[] = [];
    sink.on("data", (c: Buffer) => parts.push(c));
    await writeGguf(input, sink, { chunkSize: 1000 });
    sink.end();
    expect(Buffer.compare(Buffer.concat(parts), readFileSync(path))).toBe(0);
  });

  it("writes and reads GGUF v2", async () => {
    const p2 = join(tmp.dir, "v2.gguf");
    await writeGguf({ ...input, version: 2 }, p2);
    const header = await readGguf(p2);
    expect(header.version).toBe(2);
    expect(header.metadata).toEqual(kitchenSinkMetadata());
  });
});

describe("alignment", () => {
  const tensors = [tensor("a", GgmlType.F32, [3], 1), tensor("b", GgmlType.F16, [5], 2)];

  it("defaults to 32 and adds general.alignment only when it differs", async () => {
    const plain = planGguf({ metadata: {}, tensors });
    expect(plain.alignment).toBe(32);
    expect(plain.metadata.has("general.alignment")).toBe(false);
    expect(plain.tensors[1]!.offset).toBe(32n);

    const p = join(tmp.dir, "align.gguf");
    const plan = await writeGguf({ metadata: {}, tensors, alignment: 4096 }, p);
    expect(plan.metadata.get("general.alignment")).toEqual(ggufValue.u32(4096));
    const header = await readGguf(p);
    expect(header.alignment).toBe(4096);
    expect(header.dataOffset).toBe(4096n);
    expect(header.tensors[1]!.offset).toBe(4096n);
    expect(BigInt(statSync(p).size)).toBe(4096n * 3n);
  });

  it("rejects alignments that are not powers of two or disagree", () => {
    for (const alignment of [0, 3, 48, -32, 2 ** 32, 1.5]) {
      expect(() => planGguf({ metadata: {}, tensors, alignment })).toThrow(
        expect.objectContaining({ code: "MOESWARM_GGUF_BAD_ALIGNMENT" }),
      );
    }
    expect(() =>
      planGguf({ metadata: { "general.alignment": ggufValue.u32(64) }, tensors, alignment: 128 }),
    ).toThrow(expect.objectContaining({ code: "MOESWARM_GGUF_BAD_ALIGNMENT" }));
    expect(() => planGguf({ metadata: { "general.alignment": ggufValue.u64(64) }, tensors })).toThrow(
      expect.objectContaining({ code: "MOESWARM_GGUF_BAD_ALIGNMENT" }),
    );
  });
});

describe("header-only (sparse) files", () => {
  it("costs the header's blocks, not the data's, and reads as the full model", async () => {
    // 8 experts x 1.5 GiB-ish: far more than the test machine would want to write.
    const tensors: GgufWriteTensor[] = [];
    for (let l = 0; l < 4; l++) {
      tensors.push({ name: `blk.${l}.ffn_up_exps.weight`, type: GgmlType.Q4_K, shape: [4096, 1536, 128] });
      tensors.push({ name: `blk.${l}.attn_norm.weight`, type: GgmlType.F32, shape: [4096] });
    }
    const p = join(tmp.dir, "sparse.gguf");
    const plan = await writeGguf({ metadata: { "general.architecture": ggufValue.str("x") }, tensors }, p, {
      headerOnly: true,
    });
    const st = statSync(p);
    expect(BigInt(st.size)).toBe(plan.totalSize);
    expect(plan.totalSize).toBeGreaterThan(1n << 30n);
    expect(st.blocks * 512).toBeLessThan(1 << 20);
    const header = await readGguf(p);
    expect(header.tensors.map((t) => [t.name, t.nbytes, t.absoluteOffset])).toEqual(
      plan.tensors.map((t) => [t.name, t.nbytes, t.absoluteOffset]),
    );
  });

  it("needs data for a full write and a path for header-only", async () => {
    const input: GgufWriteInput = { metadata: {}, tensors: [{ name: "x", type: GgmlType.F32, shape: [4] }] };
    await expect(writeGguf(input, join(tmp.dir, "nodata.gguf"))).rejects.toThrow(InvalidArgumentError);
    await expect(writeGguf(input, new PassThrough(), { headerOnly: true })).rejects.toThrow(
      InvalidArgumentError,
    );
    expect(existsSync(join(tmp.dir, "nodata.gguf"))).toBe(false);
  });
});

describe("writer input validation", () => {
  const ok = () => tensor("ok", GgmlType.F32, [4], 1);
  const cases: [string, () => GgufWriteInput, string][] = [
    [
      "u8 out of range",
      () => ({ metadata: { k: ggufValue.u8(256) }, tensors: [] }),
      "MOESWARM_INVALID_ARGUMENT",
    ],
    [
      "i32 not an integer",
      () => ({ metadata: { k: ggufValue.i32(1.5) }, tensors: [] }),
      "MOESWARM_INVALID_ARGUMENT",
    ],
    [
      "u64 negative",
      () => ({ metadata: { k: ggufValue.u64(-1n) }, tensors: [] }),
      "MOESWARM_INVALID_ARGUMENT",
    ],
    [
      "i64 too big",
      () => ({ metadata: { k: ggufValue.i64(2n ** 63n) }, tensors: [] }),
      "MOESWARM_INVALID_ARGUMENT",
    ],
    [
      "string holding a number",
      () => ({ metadata: { k: { type: GgufValueType.STRING, value: 5 } as never }, tensors: [] }),
      "MOESWARM_INVALID_ARGUMENT",
    ],
    [
      "unknown value type",
      () => ({ metadata: { k: { type: 13, value: 1 } as never }, tensors: [] }),
      "MOESWARM_INVALID_ARGUMENT",
    ],
    [
      "array element of the wrong type",
      () => ({ metadata: { k: ggufValue.array(GgufValueType.STRING, ["a", 1 as never]) }, tensors: [] }),
      "MOESWARM_INVALID_ARGUMENT",
    ],
    [
      "typed array of the wrong kind",
      () => ({
        metadata: { k: ggufValue.array(GgufValueType.FLOAT32, new Float64Array(2) as never) },
        tensors: [],
      }),
      "MOESWARM_INVALID_ARGUMENT",
    ],
    ["empty key", () => ({ metadata: { "": ggufValue.u8(1) }, tensors: [] }), "MOESWARM_INVALID_ARGUMENT"],
    [
      "arrays nested 9 deep",
      () => {
        let v: GgufArray = ggufValue.array(GgufValueType.UINT8, [1]);
        for (let i = 0; i < 8; i++) v = ggufValue.array(GgufValueType.ARRAY, [v]);
        return { metadata: { k: v }, tensors: [] };
      },
      "MOESWARM_INVALID_ARGUMENT",
    ],
    [
      "an array that contains itself",
      () => {
        const items: GgufArray[] = [];
        const v = ggufValue.array(GgufValueType.ARRAY, items);
        items.push(v);
        return { metadata: { k: v }, tensors: [] };
      },
      "MOESWARM_INVALID_ARGUMENT",
    ],
    ["duplicate tensor", () => ({ metadata: {}, tensors: [ok(), ok()] }), "MOESWARM_GGUF_BAD_TENSOR"],
    [
      "name too long for ggml",
      () => ({ metadata: {}, tensors: [{ ...ok(), name: "n".repeat(64) }] }),
      "MOESWARM_GGUF_BAD_TENSOR",
    ],
    [
      "unknown ggml type",
      () => ({ metadata: {}, tensors: [{ ...ok(), type: 4 as GgmlType }] }),
      "MOESWARM_GGUF_BAD_TENSOR",
    ],
    [
      "five dims",
      () => ({ metadata: {}, tensors: [{ ...ok(), shape: [1, 1, 1, 1, 4], data: new Uint8Array(16) }] }),
      "MOESWARM_GGUF_BAD_TENSOR",
    ],
    [
      "row not a multiple of the block",
      () => ({ metadata: {}, tensors: [{ name: "q", type: GgmlType.Q4_0, shape: [31] }] }),
      "MOESWARM_GGUF_BAD_TENSOR",
    ],
    [
      "negative dim",
      () => ({ metadata: {}, tensors: [{ name: "q", type: GgmlType.F32, shape: [-1] }] }),
      "MOESWARM_GGUF_BAD_TENSOR",
    ],
    [
      "data length differs from the shape",
      () => ({ metadata: {}, tensors: [{ ...ok(), data: new Uint8Array(15) }] }),
      "MOESWARM_INVALID_ARGUMENT",
    ],
    [
      "range outside its source",
      () => ({
        metadata: {},
        tensors: [{ ...ok(), data: { source: bufferSource(new Uint8Array(20)), offset: 5, length: 16 } }],
      }),
      "MOESWARM_INVALID_ARGUMENT",
    ],
  ];
  it.each(cases)("%s", (_name, make, code) => {
    let caught: unknown;
    try {
      planGguf(make());
    } catch (error) {
      caught = error;
    }
    expect(isMoeswarmError(caught)).toBe(true);
    expect((caught as GgufError).code).toBe(code);
  });
});

describe("typed getters", () => {
  const meta = kitchenSinkMetadata();
  it("return plain values and check types", () => {
    expect(getString(meta, "general.architecture")).toBe("qwen3moe");
    expect(getNumber(meta, "test.u32")).toBe(4294967295);
    expect(getNumber(meta, "test.f32")).toBe(Math.fround(1.1));
    expect(getInteger(meta, "test.i16")).toBe(-32768);
    expect(getBigInt(meta, "test.u64")).toBe(18446744073709551615n);
    expect(getBool(meta, "test.bool_true")).toBe(true);
    expect(getStringArray(meta, "test.arr_str")).toEqual(["a", "", "Ġthe", "é", "\u{1F600}x"]);
    expect(getNumberArray(meta, "test.arr_i32")).toEqual([-2147483648, 2147483647, -1]);
    expect(getNumberArray(meta, "test.u16")).toEqual([65535]);
    expect(getArray(meta, "test.arr_nested").itemType).toBe(GgufValueType.ARRAY);
    expect(plainValue(getArray(meta, "test.arr_nested"))).toEqual([
      Int32Array.from([1, 2, 3]),
      ["x", "yz"],
      [Float32Array.from([0.5])],
    ]);
    expect(getNumber(meta, "absent", 7)).toBe(7);
    expect(getString({ metadata: meta }, "absent", "d")).toBe("d");
  });
  it("throw MOESWARM_GGUF_MISSING_KEY for absent keys and wrong types", () => {
    for (const f of [
      () => getString(meta, "absent"),
      () => getString(meta, "test.u8"),
      () => getNumber(meta, "test.u64"), // 2^64-1 is not a safe integer
      () => getInteger(meta, "test.f32"),
      () => getNumber(meta, "general.name", 1),
      () => getStringArray(meta, "test.arr_u8"),
    ]) {
      expect(f).toThrow(expect.objectContaining({ code: "MOESWARM_GGUF_MISSING_KEY" }));
    }
  });
});

describe("abort", () => {
  const input = kitchenSink();

  it("rejects with the reason of an already aborted signal", async () => {
    const reason = new Error("stop");
    const signal = AbortSignal.abort(reason);
    await expect(readGguf(new Uint8Array(16), { signal })).rejects.toBe(reason);
    await expect(writeGguf(input, join(tmp.dir, "never.gguf"), { signal })).rejects.toBe(reason);
    expect(existsSync(join(tmp.dir, "never.gguf"))).toBe(false);
  });

  it("stops a write mid-way, leaves no file behind and no listener", async () => {
    const controller = new AbortController();
    const reason = new Error("mid-way");
    const inner = bufferSource(pseudoBytes(1 << 16, 3));
    let reads = 0;
    const source: ByteSource = {
      ...inner,
      size: inner.size,
      async read(offset, length, options) {
        if (++reads === 3) controller.abort(reason);
        return inner.read(offset, length, options);
      },
    };
    const dir = join(tmp.dir, "abort");
    const { mkdirSync } = await import("node:fs");
    mkdirSync(dir);
    const target = join(dir, "mid.gguf");
    await expect(
      writeGguf(
        {
          metadata: {},
          tensors: [
            {
              name: "big",
              type: GgmlType.F32,
              shape: [1 << 14],
              data: { source, offset: 0, length: 1 << 16 },
            },
          ],
        },
        target,
        { signal: controller.signal, chunkSize: 1024 },
      ),
    ).rejects.toBe(reason);
    expect(readdirSync(dir)).toEqual([]);

    const sink = new PassThrough();
    sink.resume();
    const c2 = new AbortController();
    reads = 0;
    const s2: ByteSource = {
      ...source,
      async read(o, l, opt) {
        if (++reads === 2) c2.abort(reason);
        return inner.read(o, l, opt);
      },
    };
    await expect(
      writeGguf(
        {
          metadata: {},
          tensors: [
            {
              name: "big",
              type: GgmlType.F32,
              shape: [1 << 14],
              data: { source: s2, offset: 0, length: 1 << 16 },
            },
          ],
        },
        sink,
        {
          signal: c2.signal,
          chunkSize: 1024,
        },
      ),
    ).rejects.toBe(reason);
    expect(sink.listenerCount("error")).toBe(0);
  });
});
