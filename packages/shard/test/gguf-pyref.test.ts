// Our reader and writer against gguf-py of the pinned llama.cpp (an independent implementation):
// gguf-py reads what we write, we read what gguf-py writes, and rewriting its file is
// byte-identical.

import { createHash } from "node:crypto";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { tempDir } from "@moeswarm/testkit";
import { afterAll, describe, expect, it } from "vitest";
import {
  fileSource,
  type GgufArray,
  type GgufMetadataValue,
  GgufValueType,
  planGguf,
  readGguf,
  writeGguf,
} from "../src/index.js";
import { kitchenSink, runGgufPy } from "./gguf-fixtures.js";

const tmp = tempDir("moeswarm-gguf-py-");
afterAll(() => tmp.remove());

// Values cross the process boundary as tagged strings, so 64-bit integers and float bits are exact.
const READ_SCRIPT = `
import sys, json, hashlib, struct
import numpy as np
from gguf import GGUFReader, GGUFValueType

def enc(v, t):
    if t == GGUFValueType.STRING: return "s:" + v
    if t == GGUFValueType.BOOL: return "b:" + ("1" if v else "0")
    if t in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64): return "f:" + struct.pack("<d", float(v)).hex()
    return "i:" + str(int(v))

r = GGUFReader(sys.argv[1])
out = {"alignment": int(r.alignment), "data_offset": int(r.data_offset), "fields": [], "tensors": []}
for name, f in r.fields.items():
    if name.startswith("GGUF."):
        continue
    types = [int(t) for t in f.types]
    item = {"name": name, "types": types, "parts": [p.tobytes().hex() for p in f.parts[3:]]}
    if types[0] == GGUFValueType.ARRAY and (len(types) == 1 or types[1] != GGUFValueType.ARRAY):
        sub = types[-1] if len(types) > 1 else None
        item["value"] = [enc(x, sub) for x in f.contents()]
    elif types[0] != GGUFValueType.ARRAY:
        item["value"] = enc(f.contents(), types[0])
    out["fields"].append(item)
for t in r.tensors:
    raw = r.data[t.data_offset:t.data_offset + t.n_bytes].tobytes()
    out["tensors"].append({
        "name": t.name, "type": int(t.tensor_type), "shape": [int(x) for x in t.shape],
        "n_elements": int(t.n_elements), "n_bytes": int(t.n_bytes), "data_offset": int(t.data_offset),
        "sha256": hashlib.sha256(raw).hexdigest(),
    })
print(json.dumps(out))
`;

const WRITE_SCRIPT = String.raw`
import sys, json, hashlib
import numpy as np
from gguf import GGUFWriter, GGUFValueType, GGMLQuantizationType
from gguf.quants import quantize

path, alignment = sys.argv[1], int(sys.argv[2])
w = GGUFWriter(path, "qwen3moe")
if alignment != 32:
    w.add_custom_alignment(alignment)
w.add_uint8("t.u8", 200)
w.add_int8("t.i8", -5)
w.add_uint16("t.u16", 60000)
w.add_int16("t.i16", -30000)
w.add_uint32("t.u32", 4000000000)
w.add_int32("t.i32", -2000000000)
w.add_float32("t.f32", 0.1)
w.add_uint64("t.u64", 2**64 - 1)
w.add_int64("t.i64", -2**63)
w.add_float64("t.f64", 0.1)
w.add_bool("t.true", True)
w.add_bool("t.false", False)
w.add_string("t.str", "h\u00e9llo \u2713 \U0001F600")
w.add_array("t.strs", ["a", "\u0120b", "\u00fc", ""])
w.add_array("t.ints", [1, -2, 3])
w.add_array("t.floats", [0.5, -1.25])
w.add_array("t.bools", [True, False, False])
w.add_key_value("t.u64s", [1, 2**64 - 1], GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT64)
w.add_key_value("t.i16s", [-1, 7], GGUFValueType.ARRAY, sub_type=GGUFValueType.INT16)
w.add_key_value("t.f64s", [0.1, -0.0], GGUFValueType.ARRAY, sub_type=GGUFValueType.FLOAT64)
w.add_key_value("t.nested", [[1, 2], [3], ["x", "yz"]], GGUFValueType.ARRAY)

rng = np.random.default_rng(7)
tensors = []
def add(name, arr, raw_dtype=None):
    w.add_tensor(name, arr, raw_dtype=raw_dtype)
    tensors.append((name, arr.tobytes()))
add("t.f32", rng.standard_normal((3, 8)).astype(np.float32))
add("t.f16", rng.standard_normal((2, 16)).astype(np.float16))
add("t.i8", rng.integers(-128, 127, (5,), dtype=np.int8))
add("t.i32", rng.integers(-9, 9, (2, 2, 3), dtype=np.int32))
add("t.f64", rng.standard_normal((4,)))
x = rng.standard_normal((4, 64)).astype(np.float32)
add("t.q8_0", quantize(x, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
add("t.q4_0", quantize(x, GGMLQuantizationType.Q4_0), GGMLQuantizationType.Q4_0)
add("t.bf16", quantize(x, GGMLQuantizationType.BF16), GGMLQuantizationType.BF16)
add("blk.0.ffn_up_exps.weight", rng.integers(0, 255, (3, 2, 144 * 2), dtype=np.uint8), GGMLQuantizationType.Q4_K)
add("t.q6_k", rng.integers(0, 255, (2, 210), dtype=np.uint8), GGMLQuantizationType.Q6_K)
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
print(json.dumps([{"name": n, "sha256": hashlib.sha256(b).hexdigest(), "n_bytes": len(b)} for n, b in tensors]))
`;

function f64hex(x: number): string {
  const b = Buffer.alloc(8);
  b.writeDoubleLE(x);
  return b.toString("hex");
}

function enc(v: unknown, type: GgufValueType): string {
  switch (type) {
    case GgufValueType.STRING:
      return `s:${v as string}`;
    case GgufValueType.BOOL:
      return `b:${v ? 1 : 0}`;
    case GgufValueType.FLOAT32:
    case GgufValueType.FLOAT64:
      return `f:${f64hex(v as number)}`;
    default:
      return `i:${String(v)}`;
  }
}

/** gguf-py's part boundaries for an array, computed from our value: type, length, then items. */
function arrayParts(a: GgufArray): string[] {
  const u32 = (n: number) => Buffer.from(new Uint32Array([n]).buffer).toString("hex");
  const u64 = (n: number) => Buffer.from(new BigUint64Array([BigInt(n)]).buffer).toString("hex");
  const parts = [u32(a.itemType), u64(a.value.length)];
  for (const item of a.value as ArrayLike<unknown> & Iterable<unknown>) {
    if (a.itemType === GgufValueType.ARRAY) parts.push(...arrayParts(item as GgufArray));
    else if (a.itemType === GgufValueType.STRING) {
      const b = Buffer.from(item as string, "utf8");
      parts.push(u64(b.byteLength), b.toString("hex"));
    } else {
      parts.push(Buffer.from(itemBytes(a.itemType, item)).toString("hex"));
    }
  }
  return parts;
}

function itemBytes(type: GgufValueType, item: unknown): Uint8Array {
  const b = Buffer.alloc(8);
  switch (type) {
    case GgufValueType.UINT8:
      return b.subarray(0, b.writeUInt8(item as number));
    case GgufValueType.INT32:
      return b.subarray(0, b.writeInt32LE(item as number));
    case GgufValueType.FLOAT32:
      return b.subarray(0, b.writeFloatLE(item as number));
    case GgufValueType.STRING:
      return Buffer.from(item as string);
    default:
      throw new Error(`test helper lacks type ${type}`);
  }
}

interface PyField {
  name: string;
  types: number[];
  parts: string[];
  value?: string | string[];
}
interface PyTensor {
  name: string;
  type: number;
  shape: number[];
  n_elements: number;
  n_bytes: number;
  data_offset: number;
  sha256: string;
}

function sha256(b: Uint8Array): string {
  return createHash("sha256").update(b).digest("hex");
}

describe("gguf-py reads what we write", () => {
  it("same keys, value types, values, tensor infos, offsets and bytes", async () => {
    const input = kitchenSink();
    const path = join(tmp.dir, "ours.gguf");
    const plan = await writeGguf(input, path);
    const py = JSON.parse(await runGgufPy(READ_SCRIPT, [path])) as {
      alignment: number;
      data_offset: number;
      fields: PyField[];
      tensors: PyTensor[];
    };
    expect(py.alignment).toBe(plan.alignment);
    expect(BigInt(py.data_offset)).toBe(plan.dataOffset);

    const meta = [...plan.metadata.entries()];
    expect(py.fields.map((f) => f.name)).toEqual(meta.map(([k]) => k));
    for (const [i, [key, v]] of meta.entries()) {
      const f = py.fields[i]!;
      expect(f.types[0], key).toBe(v.type);
      if (v.type !== GgufValueType.ARRAY) {
        expect(f.value, key).toBe(enc(v.value, v.type));
        continue;
      }
      if (v.value.length > 0) expect(f.types[1], key).toBe(v.itemType);
      if (v.itemType === GgufValueType.ARRAY) {
        // gguf-py flattens nested arrays in contents(); its raw parts must split where ours do.
        expect(f.parts, key).toEqual(arrayParts(v));
      } else {
        const items = [...(v.value as Iterable<unknown>)].map((x) => enc(x, v.itemType));
        expect(f.value, key).toEqual(items);
      }
    }

    expect(py.tensors.map((t) => t.name)).toEqual(plan.tensors.map((t) => t.name));
    for (const [i, t] of plan.tensors.entries()) {
      const p = py.tensors[i]!;
      expect(p.type, t.name).toBe(t.type);
      expect(p.shape, t.name).toEqual(t.shape);
      expect(p.n_elements, t.name).toBe(t.nElements);
      expect(BigInt(p.n_bytes), t.name).toBe(t.nbytes);
      expect(BigInt(p.data_offset), t.name).toBe(t.absoluteOffset);
      expect(p.sha256, t.name).toBe(sha256(input.tensors[i]!.data as Uint8Array));
    }
  });
});

describe("we read what gguf-py writes", () => {
  for (const alignment of [32, 64]) {
    it(`values, types, tensors and bytes (alignment ${alignment}); rewriting is byte-identical`, async () => {
      const path = join(tmp.dir, `py-${alignment}.gguf`);
      const written = JSON.parse(await runGgufPy(WRITE_SCRIPT, [path, String(alignment)])) as {
        name: string;
        sha256: string;
        n_bytes: number;
      }[];
      const header = await readGguf(path);
      const bytes = readFileSync(path);
      expect(header.alignment).toBe(alignment);

      const T = GgufValueType;
      const f32 = Math.fround;
      const expected: [string, GgufMetadataValue][] = [
        ["general.architecture", { type: T.STRING, value: "qwen3moe" }],
        ...(alignment !== 32
          ? [["general.alignment", { type: T.UINT32, value: alignment }] as [string, GgufMetadataValue]]
          : []),
        ["t.u8", { type: T.UINT8, value: 200 }],
        ["t.i8", { type: T.INT8, value: -5 }],
        ["t.u16", { type: T.UINT16, value: 60000 }],
        ["t.i16", { type: T.INT16, value: -30000 }],
        ["t.u32", { type: T.UINT32, value: 4000000000 }],
        ["t.i32", { type: T.INT32, value: -2000000000 }],
        ["t.f32", { type: T.FLOAT32, value: f32(0.1) }],
        ["t.u64", { type: T.UINT64, value: 2n ** 64n - 1n }],
        ["t.i64", { type: T.INT64, value: -(2n ** 63n) }],
        ["t.f64", { type: T.FLOAT64, value: 0.1 }],
        ["t.true", { type: T.BOOL, value: true }],
        ["t.false", { type: T.BOOL, value: false }],
        ["t.str", { type: T.STRING, value: "h\u00e9llo \u2713 \u{1F600}" }],
        ["t.strs", { type: T.ARRAY, itemType: T.STRING, value: ["a", "\u0120b", "\u00fc", ""] }],
        ["t.ints", { type: T.ARRAY, itemType: T.INT32, value: Int32Array.from([1, -2, 3]) }],
        ["t.floats", { type: T.ARRAY, itemType: T.FLOAT32, value: Float32Array.from([0.5, -1.25]) }],
        ["t.bools", { type: T.ARRAY, itemType: T.BOOL, value: [true, false, false] }],
        ["t.u64s", { type: T.ARRAY, itemType: T.UINT64, value: BigUint64Array.from([1n, 2n ** 64n - 1n]) }],
        ["t.i16s", { type: T.ARRAY, itemType: T.INT16, value: Int16Array.from([-1, 7]) }],
        ["t.f64s", { type: T.ARRAY, itemType: T.FLOAT64, value: Float64Array.from([0.1, -0]) }],
        [
          "t.nested",
          {
            type: T.ARRAY,
            itemType: T.ARRAY,
            value: [
              { type: T.ARRAY, itemType: T.INT32, value: Int32Array.from([1, 2]) },
              { type: T.ARRAY, itemType: T.INT32, value: Int32Array.from([3]) },
              { type: T.ARRAY, itemType: T.STRING, value: ["x", "yz"] },
            ],
          },
        ],
      ];
      expect([...header.metadata.keys()]).toEqual(expected.map(([k]) => k));
      expect(header.metadata).toEqual(new Map(expected));

      const want: Record<string, [number, number[]]> = {
        "t.f32": [0, [8, 3]],
        "t.f16": [1, [16, 2]],
        "t.i8": [24, [5]],
        "t.i32": [26, [3, 2, 2]],
        "t.f64": [28, [4]],
        "t.q8_0": [8, [64, 4]],
        "t.q4_0": [2, [64, 4]],
        "t.bf16": [30, [64, 4]],
        "blk.0.ffn_up_exps.weight": [12, [512, 2, 3]],
        "t.q6_k": [14, [256, 2]],
      };
      expect(header.tensors.map((t) => t.name)).toEqual(written.map((t) => t.name));
      for (const [i, t] of header.tensors.entries()) {
        expect([t.type, t.shape], t.name).toEqual(want[t.name]);
        expect(Number(t.nbytes), t.name).toBe(written[i]!.n_bytes);
        const at = Number(t.absoluteOffset);
        expect(sha256(bytes.subarray(at, at + Number(t.nbytes))), t.name).toBe(written[i]!.sha256);
      }

      // Same layout rules as gguf-py: our rewrite of its file, from its byte ranges, is identical.
      await using source = await fileSource(path);
      const plan = planGguf({
        metadata: header.metadata,
        tensors: header.tensors.map((t) => ({
          ...t,
          data: { source, offset: t.absoluteOffset, length: t.nbytes },
        })),
      });
      expect(plan.totalSize).toBe(BigInt(bytes.byteLength));
      const again = join(tmp.dir, `py-${alignment}-again.gguf`);
      await writeGguf(plan, again);
      expect(Buffer.compare(readFileSync(again), bytes)).toBe(0);
    });
  }
});
